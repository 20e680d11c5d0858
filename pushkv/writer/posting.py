"""Posting and reaping: a writer's NIXL transfers and notifications (a part the shell holds,
``shell.py``).

A transfer is posted by index into the prepared descriptor lists when every region is
whole descriptors of both sides' grids, else with descriptors built for it (the fallback
for transfers off the grids: a head slice, a partial block); each posted transfer is an
``InFlight`` until every handle of it completes, fails or overstays (abandoned at twice
the transfer deadline), and then ``transfer_finished``. Notifications from peers are
polled every pass and dispatched by type to the shell's ``notif_<Type>(msg, agent, now)``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import numpy as np

from pushkv import messages as m
from pushkv.protocol import actions as A
from pushkv.protocol.mapping import map_transfer
from pushkv.transport.grid import IndexPlan, index_plan, indices, plan_indices
from pushkv.transport.nixl_agent import NixlAgent, TransferError
from pushkv.writer.memory import Memory
from pushkv.writer.peers import Peer, Peers

log = logging.getLogger(__name__)

# right after a post, spin on it this long before going back to the loop (a small WRITE on
# GPUs is done in ~30 us, a loop pass later costs more)
SETTLE_S = 100e-6


@dataclass
class InFlight:
    """One posted NIXL transfer (possibly several handles, one per peer rank)."""

    transfer_id: str
    generation: int
    handles: list = field(default_factory=list)
    posted: float = 0.0
    nbytes: int = 0  # (spin_s of it: how long we drive progress at full rate)
    num_descs: int = 0
    failed: str = ""
    part: bool = False  # a streamed part WRITE (no notification; the last WRITE follows)
    info: Any = None  # the writer's own (what to report when it ends)
    queued: int = 0  # posts of it still waiting in a link queue (it ends once they went and ended)
    number: int = 0  # P: the WRITE's number in its transfer (1, 2, ...; its w<n>_ stamps)


@dataclass
class SpanPost:
    """A planned transfer with one peer, not posted yet: by grid ``indices`` (local, remote) or
    by byte ``regions`` (local offset, remote offset, nbytes)."""

    op: str
    peer: Peer
    nbytes: int
    runs: int
    indices: Optional[tuple[Any, Any]] = None
    regions: Any = None


class PartHost(Protocol):
    """What every part of the writer shell asks of it (``Posting``, ``warm.WarmUp``): its name
    and counters, our rank, its NIXL agent and memory (set in its setup), the peer table."""

    name: str
    counters: Any
    rank: int
    nixl: NixlAgent
    memory: Memory
    peers: Peers


class PostHost(PartHost, Protocol):
    """What :class:`Posting` asks of its shell besides: tracing, and the role's ``notif_<Type>``
    handlers and transfer hooks."""

    stuck_s: float  # an InFlight older than this is abandoned (a peer that vanished mid-transfer)
    last_activity: float

    def trace_msg(self, direction: str, peer: str, msg: Any, data: bytes = b"") -> None: ...
    def grid_of_peer(self, h: Any) -> Any: ...
    def transfer_finished(self, fl: InFlight, now: float) -> None: ...
    def handles_ended(self, handles: list, now: float) -> None: ...
    def release_links(self) -> None: ...


class Posting:
    """Posts and reaps over the shell's ``memory``; ``inflight`` holds what is on the wire."""

    def __init__(self, host: PostHost):
        self.host = host
        self.inflight: dict[tuple, InFlight] = {}  # (tid, gen), or (tid, gen, n) for a streamed part

    def peer_added(self, peer: Peer, h: Any) -> None:
        """Once per peer: every later transfer names its descriptors by index."""
        host = self.host
        try:
            grid = host.grid_of_peer(h) if host.memory.grid is not None else None
            if grid is not None:
                host.nixl.prepare_remote(peer.agent, grid.strided(peer.pool_base, peer.dev_id))
                peer.grid = grid
        except Exception as e:
            host.counters["prepare_remote_failed"] += 1
            log.warning("%s: cannot prepare %s's descriptors (ad-hoc posts instead): %s", host.name, peer.agent, e)

    def release_all(self) -> None:
        for fl in self.inflight.values():
            for h in fl.handles:
                self.host.nixl.release(h)
        self.inflight.clear()

    # -- notifications --------------------------------------------------------------
    def notify(self, peer: Peer, msg: m.Msg) -> None:
        host = self.host
        data = m.encode(msg)
        host.trace_msg("send", peer.agent, msg, data)  # stamped before the send: never after the peer's recv
        try:
            host.nixl.send_notif(peer.agent, data)
        except Exception as e:  # dead or unknown peer: the deadline covers it
            host.counters["notif_send_failed"] += 1
            log.error("%s: notification %s to %s failed: %s transfer_id=%s", host.name,
                      type(msg).__name__, peer.agent, e, getattr(msg, "transfer_id", ""))

    # -- control on the handshake link ----------------------------------------------------
    def control(self, peer: Peer, msg: m.Msg) -> None:
        """Send a control message (Register, CancelTransfer, WriteFailed) to ``peer`` over our
        handshake link with it (ZMQ), where no KV byte can hold it back; as a NIXL notification
        when there is no link (a peer that never did the handshake with us)."""
        if self.host.peers.send_to(peer, msg):  # (traced by send, as every message is)
            self.host.counters["control_sent"] += 1
        else:
            self.host.counters["control_by_notif"] += 1
            self.notify(peer, msg)

    def on_control(self, msg: m.Msg, identity: Optional[bytes]) -> None:
        """A control message on a handshake link: handled as that peer's notification would be,
        and only from a peer whose handshake on this very link completed (its identity at our
        ROUTER, or the link we opened to it)."""
        host = self.host
        peer = host.peers.sender(identity)
        if peer is None:
            host.counters["control_from_unknown_peer"] += 1
            log.error("%s: %s on a handshake link with no peer behind it transfer_id=%s", host.name,
                      type(msg).__name__, getattr(msg, "transfer_id", ""))
            return
        handler = getattr(host, f"notif_{type(msg).__name__}", None)
        if handler is None:
            host.counters["unexpected_control"] += 1
            log.error("%s: unexpected %s from %s", host.name, type(msg).__name__, peer.agent)
            return
        now = time.monotonic()
        host.last_activity = now
        host.counters["control_received"] += 1
        handler(msg, peer.agent, now)

    def poll_notifs(self, now: float) -> None:
        host = self.host
        for agent, payload, msg in host.nixl.poll_decoded(m.DEC_PEER):
            host.last_activity = now
            if isinstance(msg, Exception):
                host.counters["bad_notif"] += 1
                log.error("%s: undecodable notification from %s: %s", host.name, agent, msg)
                continue
            host.trace_msg("recv", agent, msg, payload)
            handler = getattr(host, f"notif_{type(msg).__name__}", None)
            if handler is None:
                host.counters["unexpected_notif"] += 1
                log.error("%s: unexpected %s from %s", host.name, type(msg).__name__, agent)
                continue
            try:
                handler(msg, agent, now)
            except Exception:
                host.counters["handler_error"] += 1
                log.exception("%s: notification handler %s failed", host.name, type(msg).__name__)

    # -- posting ------------------------------------------------------------------------
    def post(self, op: str, peer: Peer, regions, notif: bytes = b""):
        """Post ``op`` of ``(local_off, remote_off, nbytes)`` regions with ``peer``: by index
        into the prepared lists when every region is whole sub-blocks on both grids, else
        with descriptors built for this transfer."""
        host = self.host
        ours, theirs = host.memory.grid, peer.grid
        if ours is not None and theirs is not None and host.nixl.has_prepared(peer.agent):
            idx = indices(ours, theirs, regions)
            if idx is not None:
                host.counters["posts_prepped"] += 1
                return host.nixl.post_prepped(op, idx[0], peer.agent, idx[1], notif)
        host.counters["posts_adhoc"] += 1
        return host.nixl.post(op, regions, host.memory.base_addr, peer.agent, peer.pool_base, notif, peer.dev_id)

    def _prepared_with(self, peer: Peer) -> bool:
        """Both memories' descriptor grids are prepared in NIXL: transfers with ``peer`` post by index."""
        return self.host.memory.grid is not None and peer.grid is not None and self.host.nixl.has_prepared(peer.agent)

    def _index_plan(self, peer: Peer, heads: Optional[tuple[int, int]], we_send: bool) -> Optional[IndexPlan]:
        """The whole-region plan between our pool and ``peer``'s (source first: ours when
        ``we_send``), built once per peer, direction and heads; None when either grid is not
        prepared or the pair needs the general mapping."""
        if not self._prepared_with(peer):
            return None
        key = (heads, we_send)
        if key not in peer.plans:
            ours = self.host.memory.layout
            src, dst = (ours, peer.layout) if we_send else (peer.layout, ours)
            peer.plans[key] = index_plan(src, dst, heads)
        return peer.plans[key]

    def post_blocks(self, op: str, peer: Peer, heads: Optional[tuple[int, int]], src_blocks, dst_blocks,
                    num_tokens: int, notif: Callable[[int, int], bytes] = lambda n, r: b"",
                    before: Callable[[int], None] = lambda nbytes: None):
        """Post ``op`` moving ``num_tokens`` tokens of ``heads`` between pushkv pools: a WRITE
        from our ``src_blocks`` into the peer's ``dst_blocks``, a READ from the peer's
        ``src_blocks`` into ours. A planned pair posts grid indices computed straight from the
        block ids (no byte regions); any other maps byte regions (``protocol/mapping.py``) and
        posts them. ``notif(nbytes, runs)`` makes the notification; ``before(nbytes)`` runs just
        before the post. Returns (handle, nbytes, descriptor runs)."""
        return self.post_spans(op, peer, heads, [(src_blocks, dst_blocks, num_tokens, None)], notif, before)

    def post_spans(self, op: str, peer: Peer, heads: Optional[tuple[int, int]], spans,
                   notif: Callable[[int, int], bytes] = lambda n, r: b"",
                   before: Callable[[int], None] = lambda nbytes: None):
        """``post_blocks`` of several ``(src_blocks, dst_blocks, num_tokens, layer groups or None)``
        spans as one transfer (one notification): a layer-streamed WRITE moves each layer
        group from its own first token."""
        sp = self.plan_spans(op, peer, heads, spans)
        before(sp.nbytes)
        return self.post_planned(sp, notif(sp.nbytes, sp.runs)), sp.nbytes, sp.runs

    def plan_spans(self, op: str, peer: Peer, heads: Optional[tuple[int, int]], spans) -> "SpanPost":
        """What ``post_spans`` would post, without posting it: its size is known before it goes
        (P's link queue orders and bounds posts by it)."""
        we_send = op == "WRITE"
        plan = self._index_plan(peer, heads, we_send)
        if plan is not None:
            parts = [plan_indices(plan, s, d, n, g) for s, d, n, g in spans]
            si, di = parts[0][:2] if len(parts) == 1 else (
                np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
            nbytes, runs = sum(p[2] for p in parts), sum(p[3] for p in parts)
            local, remote = (si, di) if we_send else (di, si)
            return SpanPost(op, peer, nbytes, runs, indices=(local, remote))
        ours = self.host.memory.layout
        src, dst = (ours, peer.layout) if we_send else (peer.layout, ours)
        regions = [r for s, d, n, g in spans for r in map_transfer(src, s, dst, d, n, heads, g)]
        local_regions = regions if we_send else [(d, s, n) for s, d, n in regions]  # (local, remote, bytes)
        return SpanPost(op, peer, sum(r[2] for r in regions), len(regions), regions=local_regions)

    def post_planned(self, sp: "SpanPost", notif: bytes = b""):
        """Post what ``plan_spans`` planned; returns the handle."""
        if sp.indices is not None:
            self.host.counters["posts_prepped"] += 1  # by index into the prepared lists, as post() does
            self.host.counters["posts_planned"] += 1  # ... with indices straight from block ids
            return self.host.nixl.post_prepped(sp.op, sp.indices[0], sp.peer.agent, sp.indices[1], notif)
        return self.post(sp.op, sp.peer, sp.regions, notif)

    def post_regions(self, a: A.PostWrite, regions_of: Callable[[m.Register, Peer], Optional[list]],
                     now: float) -> InFlight:
        """Post WRITE ``a``'s share to each registered D rank as byte regions (``regions_of(reg,
        peer)``; None: that rank holds no head of ours); a last WRITE carries its WriteDone (a streamed
        part none). Returns its InFlight, failed when a post failed."""
        fl = InFlight(a.transfer_id, a.generation, posted=now, part=not a.last)
        try:
            for reg in a.registrations:
                peer = self.host.peers.get((reg.d_engine_id, reg.d_rank))
                if peer is None:
                    raise TransferError(f"no handshake with {reg.d_engine_id} rank {reg.d_rank}")
                regions = regions_of(reg, peer)
                if regions is None:
                    continue
                nbytes = sum(r[2] for r in regions)
                done = m.WriteDone(a.transfer_id, a.generation, self.host.rank, a.first_token, nbytes, len(regions))
                fl.handles.append(self.post("WRITE", peer, regions, m.encode(done) if a.last else b""))
                fl.nbytes += nbytes
                fl.num_descs += len(regions)
        except Exception as e:
            log.error("%s: WRITE failed to post: %s transfer_id=%s", self.host.name, e, a.transfer_id)
            fl.failed = f"WRITE failed to post: {e}"
        return fl

    def book(self, key: tuple, fl: InFlight, now: float) -> bool:
        """A transfer just posted (or that failed to): in flight while a handle of it or a queued
        post is out, else finished now (``transfer_finished``). True when in flight."""
        if fl.handles or fl.queued:
            self.inflight[key] = fl
            return True
        self.host.transfer_finished(fl, now)
        return False

    # -- reaping --------------------------------------------------------------------------
    def check(self, now: float) -> None:
        for key, fl in list(self.inflight.items()):
            self._check_one(key, fl, now)

    def settle(self, key, budget_s: float = SETTLE_S) -> None:
        """Spin on a just-posted transfer for up to ``budget_s``: a small one completes within
        tens of microseconds, before the loop's next pass would look at it."""
        end = time.perf_counter() + budget_s
        while key in self.inflight:
            self._check_one(key, self.inflight[key], time.monotonic())
            if time.perf_counter() >= end:
                break

    def _check_one(self, key, fl: InFlight, now: float) -> None:
        host = self.host
        before = fl.handles
        if now - fl.posted > host.stuck_s:  # a peer that vanished mid-transfer may never answer
            host.counters["transfer_stuck"] += 1
            fl.failed = fl.failed or f"transfer stuck for {host.stuck_s:.0f}s; abandoned"
            for h in fl.handles:
                host.nixl.release(h)
            fl.handles = []
        pending, failure = host.nixl.reap(fl.handles, "transfer failed in flight")
        fl.failed = fl.failed or failure
        fl.handles = pending
        ended = len(pending) < len(before)
        if ended:  # (handles may be plain ints: compare by identity)
            host.handles_ended([h for h in before if all(h is not p for p in pending)], now)
        try:
            if not fl.handles and not fl.queued and key in self.inflight:
                del self.inflight[key]
                host.last_activity = now
                host.transfer_finished(fl, now)
        finally:
            if ended:  # a link queue's rooms, once what the ends asked for (a last WRITE) is offered
                host.release_links()
