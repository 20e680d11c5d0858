"""Posting and reaping: a writer's NIXL transfers and notifications.

A transfer is posted by index into the prepared descriptor lists when every region is
whole descriptors of both sides' grids, else with descriptors built for it (the fallback
for transfers off the grids: a head slice, a partial block); each posted transfer is an
``InFlight`` until every handle of it completes, fails or overstays (abandoned at twice
the transfer deadline), and then ``transfer_finished``. Notifications from peers are
polled every pass and dispatched by type to ``notif_<Type>(msg, agent, now)``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from pushkv import messages as m
from pushkv.protocol.mapping import map_transfer
from pushkv.transport.grid import IndexPlan, index_plan, indices, plan_indices
from pushkv.writer.memory import Memory
from pushkv.writer.peers import Peer, PeerWriter

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


class PostingWriter(PeerWriter):
    """Posts and reaps over ``memory`` (set by the subclass's setup)."""

    memory: Memory
    stuck_s = 60.0  # an InFlight older than this is abandoned (a peer that vanished mid-transfer)

    def init_posting(self) -> None:
        self.inflight: dict[tuple, InFlight] = {}  # (tid, gen), or (tid, gen, n) for a streamed part
        self._last_activity = 0.0

    def peer_added(self, peer: Peer, h: Any) -> None:
        """Once per peer: every later transfer names its descriptors by index."""
        super().peer_added(peer, h)
        try:
            grid = self.grid_of_peer(h) if self.memory.grid is not None else None
            if grid is not None:
                self.nixl.prepare_remote(peer.agent, grid.strided(peer.pool_base, peer.dev_id))
                peer.grid = grid
        except Exception as e:
            self.counters["prepare_remote_failed"] += 1
            log.warning("%s: cannot prepare %s's descriptors (ad-hoc posts instead): %s", self.name, peer.agent, e)

    def grid_of_peer(self, h: Any) -> Any:
        """The descriptor grid of the peer's memory (None: none; its transfers build descriptors)."""
        return None

    def release_inflight(self) -> None:
        for fl in self.inflight.values():
            for h in fl.handles:
                self.nixl.release(h)
        self.inflight.clear()

    # -- notifications --------------------------------------------------------------
    def notify(self, peer: Peer, msg: m.Msg) -> None:
        data = m.encode(msg)
        self.trace_msg("send", peer.agent, msg, data)  # stamped before the send: never after the peer's recv
        try:
            self.nixl.send_notif(peer.agent, data)
        except Exception as e:  # dead or unknown peer: the deadline covers it
            self.counters["notif_send_failed"] += 1
            log.error("%s: notification %s to %s failed: %s transfer_id=%s", self.name,
                      type(msg).__name__, peer.agent, e, getattr(msg, "transfer_id", ""))

    # -- control on the handshake link ----------------------------------------------------
    def control(self, peer: Peer, msg: m.Msg) -> None:
        """Send a control message (Register, CancelTransfer, WriteFailed) to ``peer`` over our
        handshake link with it (ZMQ), where no KV byte can hold it back; as a NIXL notification
        when there is no link (a peer that never did the handshake with us)."""
        if self.send_to_peer(peer, msg):  # (traced by send, as every message is)
            self.counters["control_sent"] += 1
        else:
            self.counters["control_by_notif"] += 1
            self.notify(peer, msg)

    def on_control(self, msg: m.Msg, identity: Optional[bytes]) -> None:
        """A control message on a handshake link: handled as that peer's notification would be,
        and only from a peer whose handshake on this very link completed (its identity at our
        ROUTER, or the link we opened to it)."""
        peer = self.sender(identity)
        if peer is None:
            self.counters["control_from_unknown_peer"] += 1
            log.error("%s: %s on a handshake link with no peer behind it transfer_id=%s", self.name,
                      type(msg).__name__, getattr(msg, "transfer_id", ""))
            return
        handler = getattr(self, f"notif_{type(msg).__name__}", None)
        if handler is None:
            self.counters["unexpected_control"] += 1
            log.error("%s: unexpected %s from %s", self.name, type(msg).__name__, peer.agent)
            return
        now = time.monotonic()
        self._last_activity = now
        self.counters["control_received"] += 1
        handler(msg, peer.agent, now)

    def on_Register(self, msg: m.Register, identity: Optional[bytes] = None) -> None:
        self.on_control(msg, identity)

    def on_CancelTransfer(self, msg: m.CancelTransfer, identity: Optional[bytes] = None) -> None:
        self.on_control(msg, identity)

    def on_WriteFailed(self, msg: m.WriteFailed, identity: Optional[bytes] = None) -> None:
        self.on_control(msg, identity)

    def poll_notifs(self, now: float) -> None:
        for agent, payload, msg in self.nixl.poll_decoded(m.DEC_PEER):
            self._last_activity = now
            if isinstance(msg, Exception):
                self.counters["bad_notif"] += 1
                log.error("%s: undecodable notification from %s: %s", self.name, agent, msg)
                continue
            self.trace_msg("recv", agent, msg, payload)
            handler = getattr(self, f"notif_{type(msg).__name__}", None)
            if handler is None:
                self.counters["unexpected_notif"] += 1
                log.error("%s: unexpected %s from %s", self.name, type(msg).__name__, agent)
                continue
            try:
                handler(msg, agent, now)
            except Exception:
                self.counters["handler_error"] += 1
                log.exception("%s: notification handler %s failed", self.name, type(msg).__name__)

    # -- posting ------------------------------------------------------------------------
    def post(self, op: str, peer: Peer, regions, notif: bytes = b""):
        """Post ``op`` of ``(local_off, remote_off, nbytes)`` regions with ``peer``: by index
        into the prepared lists when every region is whole sub-blocks on both grids, else
        with descriptors built for this transfer."""
        ours, theirs = self.memory.grid, peer.grid
        if ours is not None and theirs is not None and self.nixl.has_prepared(peer.agent):
            idx = indices(ours, theirs, regions)
            if idx is not None:
                self.counters["posts_prepped"] += 1
                return self.nixl.post_prepped(op, idx[0], peer.agent, idx[1], notif)
        self.counters["posts_adhoc"] += 1
        return self.nixl.post(op, regions, self.memory.base_addr, peer.agent, peer.pool_base, notif, peer.dev_id)

    def _prepared_with(self, peer: Peer) -> bool:
        """Both memories' descriptor grids are prepared in NIXL: transfers with ``peer`` post by index."""
        return self.memory.grid is not None and peer.grid is not None and self.nixl.has_prepared(peer.agent)

    def _index_plan(self, peer: Peer, heads: Optional[tuple[int, int]], we_send: bool) -> Optional[IndexPlan]:
        """The whole-region plan between our pool and ``peer``'s (source first: ours when
        ``we_send``), built once per peer, direction and heads; None when either grid is not
        prepared or the pair needs the general mapping."""
        if not self._prepared_with(peer):
            return None
        key = (heads, we_send)
        if key not in peer.plans:
            ours = self.memory.layout
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
        ours = self.memory.layout
        src, dst = (ours, peer.layout) if we_send else (peer.layout, ours)
        regions = [r for s, d, n, g in spans for r in map_transfer(src, s, dst, d, n, heads, g)]
        local_regions = regions if we_send else [(d, s, n) for s, d, n in regions]  # (local, remote, bytes)
        return SpanPost(op, peer, sum(r[2] for r in regions), len(regions), regions=local_regions)

    def post_planned(self, sp: "SpanPost", notif: bytes = b""):
        """Post what ``plan_spans`` planned; returns the handle."""
        if sp.indices is not None:
            self.counters["posts_prepped"] += 1  # by index into the prepared lists, as post() does
            self.counters["posts_planned"] += 1  # ... with indices straight from block ids
            return self.nixl.post_prepped(sp.op, sp.indices[0], sp.peer.agent, sp.indices[1], notif)
        return self.post(sp.op, sp.peer, sp.regions, notif)

    # -- reaping --------------------------------------------------------------------------
    def check_inflight(self, now: float) -> None:
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
        before = fl.handles
        if now - fl.posted > self.stuck_s:  # a peer that vanished mid-transfer may never answer
            self.counters["transfer_stuck"] += 1
            fl.failed = fl.failed or f"transfer stuck for {self.stuck_s:.0f}s; abandoned"
            for h in fl.handles:
                self.nixl.release(h)
            fl.handles = []
        pending, failure = self.nixl.reap(fl.handles, "transfer failed in flight")
        fl.failed = fl.failed or failure
        fl.handles = pending
        if len(pending) < len(before):  # (handles may be plain ints: compare by identity)
            self.handles_ended([h for h in before if all(h is not p for p in pending)], now)
        if not fl.handles and not fl.queued and key in self.inflight:
            del self.inflight[key]
            self._last_activity = now
            self.transfer_finished(fl, now)

    def handles_ended(self, handles: list, now: float) -> None:
        """These handles' transfers ended (done, failed or abandoned): a link queue's room."""

    def transfer_finished(self, fl: InFlight, now: float) -> None:
        raise NotImplementedError
