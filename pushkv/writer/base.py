"""Writer process base: owns the KV pool and the NIXL agent.

Both sides share: pool allocation and registration, the scheduler channel, the
peer handshake (ZMQ DEALER -> ROUTER, once per peer rank, exchanging NIXL
metadata, pool base address and layout; driven by the loop, never blocking it),
NIXL notification polling, posting by index into prepared descriptor lists, and
tracking of posted transfers. Side-specific protocol lives in prefill.py / decode.py.

The loop drives UCX itself (no progress thread); how often it looks is ``poll.py``'s
``poll_ms`` (spin while a transfer is young, announced or, with warm on, expected; back off
for a stuck one; else the pending or idle rate). ZMQ messages wake the loop at once.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import zmq

from pushkv import faults, limits
from pushkv import messages as m
from pushkv.actor import Actor
from pushkv.config import DeploymentConfig, InstanceConfig, marks_endpoint, model_fingerprint, rank_device
from pushkv.kv import layout as L
from pushkv.kv.pool import Pool, create_pool, shm_name
from pushkv.protocol.mapping import map_transfer
from pushkv.transport.grid import DescGrid, IndexPlan, grid_of, index_plan, indices, plan_indices
from pushkv.transport import poster
from pushkv.transport.nixl_agent import NixlAgent
from pushkv.writer.poll import poll_ms, spin_s, warm_enabled

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
# right after a post, spin on it this long before going back to the loop (a small WRITE on
# GPUs is done in ~30 us, a loop pass later costs more)
SETTLE_S = 100e-6
# keep-warm WRITEs: while a WRITE to a peer is expected, one of BEAT_BYTES into the peer's sink
# every BEAT_MS. A post after 20 ms without one costs ~15x a post right after another even with
# the loop spinning; a 1 ms beat keeps it at the back-to-back cost (nixl_probe --heartbeat-ms)
BEAT_MS = 1.0
BEAT_BYTES = 256 << 10


@dataclass
class Peer:
    engine_id: str
    rank: int
    tp: int
    agent: str
    pool_base: int
    layout: m.KVLayoutDesc
    dev_id: int = 0
    grid: Optional[DescGrid] = None  # its pool's descriptor grid, prepared in NIXL (None: ad-hoc only)
    identity: Optional[bytes] = None  # its DEALER's identity at our handshake ROUTER (it initiated)
    plans: dict = field(default_factory=dict)  # (heads, we send) -> IndexPlan or None (grid.index_plan)
    sink_addr: int = 0  # its keep-warm sink (Hello.sink_addr); 0: none
    sink_bytes: int = 0
    device_uuid: str = ""  # its pool's GPU (Hello.device_uuid)
    post_agent: str = ""  # the agent its WRITEs come from, when not ``agent`` (Hello.post_agent)


@dataclass
class PeerLink:
    """A handshake we initiated: a DEALER to the peer's handshake ROUTER, kept open once
    answered as the channel for wake hints to that peer."""

    engine_id: str
    rank: int
    endpoint: str
    channel: object  # pushkv.actor.Channel
    deadline: float
    connected: bool = False


@dataclass
class PeerWait:
    """Something (a request) waiting for handshakes with ``keys`` ((engine_id, rank))."""

    key: object
    keys: tuple
    then: Callable[[list], None]
    failed: Callable[[str], None]


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


class WriterBase(Actor):
    def __init__(self, cfg: DeploymentConfig, inst: InstanceConfig, rank: int):
        super().__init__(f"{inst.name}-writer-{rank}", cfg.control_endpoint, cfg.trace_endpoint, cfg.secret_file,
                         limits.msg_cap_bytes(cfg))
        self.cfg = cfg
        self.inst = inst
        self.rank = rank
        self.layout = L.instance_layout(cfg, inst, rank)  # cut to match the peer instance
        self.model_id = model_fingerprint(cfg.model)  # peers must agree on what the KV means
        self.pool: Optional[Pool] = None
        self.nixl: Optional[NixlAgent] = None
        self.grid: Optional[DescGrid] = None  # our pool's descriptor grid, prepared in NIXL
        self.peers: dict[tuple[str, int], Peer] = {}  # (engine_id, rank) -> peer
        self.peers_by_agent: dict[str, Peer] = {}
        self.inflight: dict[tuple, InFlight] = {}  # (tid, gen), or (tid, gen, n) for a streamed part
        self.links: dict[tuple[str, int], PeerLink] = {}  # handshakes we initiated
        self.waits: dict[object, PeerWait] = {}  # requests waiting for handshakes
        self._link_failed: dict[tuple[str, int], str] = {}  # failures not yet told to waits
        self._expected: dict[tuple[str, int], float] = {}  # transfers peers announced -> spin until
        # keep the loop hot while a transfer with us is expected (config writer_warm)
        self.warm = warm_enabled(cfg.writer_warm, rank_device(inst, rank))
        self._warm: dict[tuple[str, int], float] = {}  # transfers expected -> warm until (a cap)
        self.sink = None  # our keep-warm sink (warm on): peers' beats land here, never in the pool
        self._beat_keys: dict[str, set] = {}  # peer agent -> warm keys whose WRITE to it is coming
        self._beats: dict[str, object] = {}  # peer agent -> its beat's handle, in flight
        self._last_beat: dict[str, float] = {}
        self._lost = ""  # while ending transfers with a dead peer instance: KVFailed.lost for them
        self.handshake = None  # our ROUTER for handshakes peers initiate
        self._last_activity = 0.0

    @property
    def agent_name(self) -> str:
        return f"{self.inst.engine_id}-w{self.rank}"

    # -- lifecycle --------------------------------------------------------------
    def setup(self) -> None:
        name = shm_name(self.cfg.deployment_id, self.inst.name, self.rank, os.getpid())
        device = rank_device(self.inst, self.rank)
        self.pool = create_pool(name, self.layout, self.cfg.model.dtype, device)
        post_thread = self.inst.role == "prefill" and poster.wanted(self.cfg.writer_post_thread,
                                                                     os.environ.get("UCX_TLS", ""))
        self.nixl = NixlAgent(self.agent_name, device=device, post_thread=post_thread)
        if post_thread:
            log.info("%s: WRITEs posted by agent %s on its own thread", self.name, self.nixl.post_agent)
        self.device_uuid = ""
        if device != "cpu":
            import torch

            self.device_uuid = str(torch.cuda.get_device_properties(torch.device(device)).uuid)
        extra = []
        if self.warm and BEAT_MS > 0:
            import torch

            self.sink = torch.empty(BEAT_BYTES, dtype=torch.uint8, device=device)
            extra.append((self.sink.data_ptr(), BEAT_BYTES))
        self.nixl.register(self.pool.base_addr, self.pool.nbytes, extra)
        try:
            grid = grid_of(self.layout)
            if grid is not None:
                self.nixl.prepare_local(grid.strided(self.pool.base_addr, self.nixl.dev_id))
                self.grid = grid
        except Exception as e:  # every transfer then builds its own descriptors
            log.warning("%s: cannot prepare the pool's descriptors (ad-hoc posts instead): %s", self.name, e)
        sched = self.socket(zmq.DEALER, self.inst.writer_endpoints[self.rank], bind=True)
        self.sched = self.add_channel(sched, m.DEC_SCHED_TO_WRITER, f"{self.inst.name}-scheduler")
        if self.takes_marks():
            marks = self.socket(zmq.PULL, marks_endpoint(self.inst.writer_endpoints[self.rank]), bind=True)
            self.add_channel(marks, m.DEC_WORKER_TO_WRITER, f"{self.inst.name}-worker-{self.rank}")
        if self.inst.handshake_endpoints:
            hs = self.socket(zmq.ROUTER, self.inst.handshake_endpoints[self.rank], bind=True,
                             max_msg_bytes=limits.CONTROL_MSG_BYTES)  # Hello, TransferStarting: no request's size
            self.handshake = self.add_channel(hs, m.DEC_HANDSHAKE, "peer-handshake", routed=True)
        if self.cfg.events_endpoint:
            sub = self.socket(zmq.SUB, self.cfg.events_endpoint, bind=False)
            sub.setsockopt(zmq.SUBSCRIBE, b"pushkv.")
            self.add_channel(sub, m.DEC_EVENT, "supervisor-events")
        log.info("%s: pool %d blocks x %d B = %.1f MiB at %s", self.name, self.layout.num_blocks,
                 L.block_bytes(self.layout), self.pool.nbytes / 2**20, self.pool.handle.name or self.pool.handle.kind)

    def ready_msg(self) -> m.Ready:
        return m.Ready(self.name, os.getpid(), pool=self.pool.handle if self.pool else None, agent=self.agent_name)

    def teardown(self) -> None:
        for key in list(self.links):
            self._close_link(key)
        for fl in self.inflight.values():
            for h in fl.handles:
                self.nixl.release(h)
        self.inflight.clear()
        for h in self._beats.values():
            self.nixl.release(h)
        self._beats.clear()
        if self.nixl is not None:
            self.nixl.deregister()
        if self.pool is not None:
            self.pool.close()

    def hello(self) -> m.Hello:
        return m.Hello(
            engine_id=self.inst.engine_id, rank=self.rank, tp=self.inst.tp,
            agent_name=self.agent_name, agent_metadata=self.nixl.metadata(),
            pool_base=self.pool.base_addr, layout=self.layout, device_id=self.nixl.dev_id,
            sink_addr=self.sink.data_ptr() if self.sink is not None else 0,
            sink_bytes=BEAT_BYTES if self.sink is not None else 0, device_uuid=self.device_uuid,
            wire_version=m.WIRE_VERSION, model_id=self.model_id, post_agent=self.nixl.post_agent,
        )

    # -- handshake ----------------------------------------------------------------
    def _add_peer(self, h: m.Hello) -> Peer:
        from pushkv.protocol.mapping import check_compatible

        if h.wire_version != m.WIRE_VERSION:
            raise ValueError(f"wire version differs: ours {m.WIRE_VERSION}, {h.engine_id} rank {h.rank}'s {h.wire_version}")
        if h.model_id != self.model_id:
            raise ValueError(f"model differs: ours {self.model_id}, {h.engine_id} rank {h.rank}'s {h.model_id or 'unnamed'} "
                             "(every instance must serve the same model, geometry and dtype)")
        check_compatible(self.layout, h.layout)
        old = self.peers.get((h.engine_id, h.rank))
        if old is not None:  # the peer restarted: drop its old NIXL metadata first
            self.forget_peer(old)
        agent = self.nixl.add_remote(h.agent_metadata)
        peer = Peer(h.engine_id, h.rank, h.tp, agent, h.pool_base, h.layout, h.device_id,
                    sink_addr=h.sink_addr, sink_bytes=h.sink_bytes, device_uuid=h.device_uuid)
        try:  # once per peer: every later transfer names these descriptors by index
            grid = grid_of(h.layout) if self.grid is not None else None
            if grid is not None:
                self.nixl.prepare_remote(agent, grid.strided(h.pool_base, h.device_id))
                peer.grid = grid
        except Exception as e:
            self.counters["prepare_remote_failed"] += 1
            log.warning("%s: cannot prepare %s's descriptors (ad-hoc posts instead): %s", self.name, agent, e)
        self.peers[(h.engine_id, h.rank)] = peer
        self.peers_by_agent[agent] = peer
        if h.post_agent:  # its WRITEs' notifications come from its poster
            peer.post_agent = h.post_agent
            self.peers_by_agent[h.post_agent] = peer
        log.info("%s: connected to %s rank %d (agent %s)", self.name, h.engine_id, h.rank, agent)
        return peer

    def on_Hello(self, msg: m.Hello, identity: Optional[bytes] = None) -> None:
        if identity is None:  # the answer on a link we opened
            self._link_answered(msg)
            return
        # a peer initiated the handshake: load its metadata, answer with ours
        try:
            peer = self._add_peer(msg)
            peer.identity = identity  # our way back to it over the ROUTER (wake hints)
        except Exception as e:  # refused (or its metadata would not load): the reason, not our NIXL metadata
            log.error("%s: refusing peer %s rank %d: %s", self.name, msg.engine_id, msg.rank, e)
            self.counters["peer_incompatible" if isinstance(e, ValueError) else "peer_metadata_failed"] += 1
            self.send(self.handshake, m.HelloRefused(self.inst.engine_id, self.rank, str(e)), identity)
            return
        self.send(self.handshake, self.hello(), identity)

    def on_HelloRefused(self, msg: m.HelloRefused, identity: Optional[bytes] = None) -> None:
        """The peer refused our Hello: fail the link now, with its reason, not at the deadline."""
        link = next((l for l in self.links.values() if l.channel is self.current), None)
        if link is None or link.connected:
            self.counters["unexpected_hello"] += 1
            return
        self.counters["peer_refused_us"] += 1
        self._fail_link(link, f"refused by {msg.engine_id} rank {msg.rank}: {msg.reason}")
        self._resolve_waits()

    # -- links we initiate: non-blocking, one per peer rank, resolved by the loop ----------
    def start_link(self, engine_id: str, rank: int, endpoint: str, now: float) -> None:
        """Send our Hello to a peer's handshake endpoint unless connected or under way; the
        answer arrives on the loop (``on_Hello``), a silent peer fails at its deadline."""
        key = (engine_id, rank)
        if key in self.peers or key in self.links:
            return
        sock = self.socket(zmq.DEALER, endpoint, bind=False, max_msg_bytes=limits.CONTROL_MSG_BYTES)
        ch = self.add_channel(sock, m.DEC_HANDSHAKE, f"handshake-{engine_id}-{rank}")
        self.links[key] = PeerLink(engine_id, rank, endpoint, ch, now + HANDSHAKE_TIMEOUT_S)
        self.send(ch, self.hello())
        self.counters["handshakes_started"] += 1

    def with_peers(self, wait_key, engine_id: str, ranks, endpoints, then: Callable[[list[Peer]], None],
                   failed: Callable[[str], None], now: float) -> None:
        """Run ``then(peers)`` once every rank's handshake is done (now, if it is), or
        ``failed(reason)`` when one fails. Never blocks: other transfers go on meanwhile."""
        keys = tuple((engine_id, r) for r in ranks)
        for r in ranks:
            self.start_link(engine_id, r, endpoints[r], now)
        wait = PeerWait(wait_key, keys, then, failed)
        if not self._resolve(wait):
            self.waits[wait_key] = wait

    def drop_wait(self, wait_key) -> bool:
        return self.waits.pop(wait_key, None) is not None

    def _resolve(self, wait: PeerWait) -> bool:
        """Run the wait's outcome if it has one; True when it ran."""
        bad = next((self._link_failed[k] for k in wait.keys if k in self._link_failed), None)
        lost = [k for k in wait.keys if k not in self.peers and k not in self.links]
        if bad is None and lost:  # connected, then forgotten (its instance died) before the rest answered
            bad = f"lost {lost[0][0]} rank {lost[0][1]} during the handshake"
        if bad is not None:
            wait.failed(bad)
            return True
        if all(k in self.peers for k in wait.keys):
            wait.then([self.peers[k] for k in wait.keys])
            return True
        return False

    def _resolve_waits(self) -> None:
        for wk, wait in list(self.waits.items()):
            if self.waits.get(wk) is wait and self._resolve(wait):
                self.waits.pop(wk, None)
        self._link_failed.clear()  # the next request tries the handshake again

    def _link_answered(self, msg: m.Hello) -> None:
        link = next((l for l in self.links.values() if l.channel is self.current), None)
        if link is None or link.connected:
            self.counters["unexpected_hello"] += 1
            return
        try:
            if msg.engine_id != link.engine_id or msg.rank != link.rank:
                raise ValueError(f"handshake at {link.endpoint} answered by {msg.engine_id} rank {msg.rank}")
            self._add_peer(msg)
            link.connected = True
        except ValueError as e:
            self.counters["peer_incompatible"] += 1
            self._fail_link(link, str(e))
        self._resolve_waits()

    def _fail_link(self, link: PeerLink, reason: str) -> None:
        log.error("%s: handshake with %s rank %d failed: %s", self.name, link.engine_id, link.rank, reason)
        self._link_failed[(link.engine_id, link.rank)] = reason
        self._close_link((link.engine_id, link.rank))

    def _close_link(self, key) -> None:
        link = self.links.pop(key, None)
        if link is not None:
            self.channels.pop(link.channel.sock, None)
            self.poller.unregister(link.channel.sock)
            link.channel.sock.close(0)

    def _expire_links(self, now: float) -> None:
        late = [l for l in self.links.values() if not l.connected and l.deadline <= now]
        for link in late:
            self.counters["handshake_timeout"] += 1
            self._fail_link(link, f"handshake with {link.engine_id} rank {link.rank} at {link.endpoint} "
                                  f"timed out after {HANDSHAKE_TIMEOUT_S:.0f}s")
        if late:
            self._resolve_waits()

    # -- wake hints over the handshake link ---------------------------------------------
    def wake_peer(self, peer: Peer, transfer_id: str, generation: int, nbytes: int) -> None:
        """Ask ``peer`` to drive NIXL progress: a transfer with it is about to be posted."""
        hint = m.TransferStarting(transfer_id, generation, self.rank, nbytes)
        link = self.links.get((peer.engine_id, peer.rank))
        if link is not None and link.connected:
            self.send(link.channel, hint)
        elif peer.identity is not None and self.handshake is not None:
            self.send(self.handshake, hint, peer.identity)

    def on_TransferStarting(self, msg: m.TransferStarting, identity: Optional[bytes] = None) -> None:
        faults.point(self.name, "transfer_starting")  # a peer posted a transfer with us (a streamed part: mid-stream)
        now = time.monotonic()
        self.counters["wake_hints"] += 1
        self._expected[(msg.transfer_id, msg.generation)] = now + spin_s(msg.nbytes)

    def transfer_arrived(self, transfer_id: str, generation: int) -> None:
        """The transfer a peer announced ended on our side: stop driving progress for it."""
        self._expected.pop((transfer_id, generation), None)

    def on_LifecycleEvent(self, ev) -> None:
        """A process of the other instance died: the supervisor restarts that whole
        instance, so its writers' NIXL agents and pools are gone."""
        role = ev.role
        if ev.event != "exit" or role == self.inst.role or role not in ("prefill", "decode"):
            return
        try:
            engine = self.cfg.instance(role, ev.instance).engine_id
        except IndexError:  # an instance this config does not plan
            return
        dead = [p for p in self.peers.values() if p.engine_id == engine]
        for p in dead:
            self.forget_peer(p)
        self.peer_instance_down(engine, f"{ev.name} died ({ev.detail})", time.monotonic())

    def on_PeerLost(self, msg: m.PeerLost) -> None:
        """The router saw a peer instance leave the registry (or come back as a new
        incarnation): across hosts, the news no supervisor of ours can give."""
        if msg.role == self.inst.role or msg.role not in ("prefill", "decode"):
            return
        self.counters["peer_lost"] += 1
        if self.inst.role == "decode":  # we open the handshakes: the next request with it opens a fresh one
            for p in [p for p in self.peers.values() if p.engine_id == msg.engine_id]:
                self.forget_peer(p)
        self.peer_instance_down(msg.engine_id, msg.reason, time.monotonic())

    def peer_instance_down(self, engine_id: str, reason: str, now: float) -> None:
        """Side-specific: end transfers with the dead instance."""

    @contextmanager
    def ending_for_loss(self, role: str, reason: str):
        """Inside: failing transfers with a dead ``role`` instance; the KVFailed sent meanwhile say
        so (``lost``), so the request's answer does not depend on who heard of the death first."""
        self._lost = f"{role} instance failed: {reason}"
        try:
            yield
        finally:
            self._lost = ""

    def forget_peer(self, peer: Peer) -> None:
        self._close_link((peer.engine_id, peer.rank))  # a restarted peer gets a fresh handshake
        self._beat_keys.pop(peer.agent, None)
        self._last_beat.pop(peer.agent, None)
        h = self._beats.pop(peer.agent, None)
        if h is not None:
            self.nixl.release(h)
        self.peers.pop((peer.engine_id, peer.rank), None)
        self.peers_by_agent.pop(peer.agent, None)
        if peer.post_agent:
            self.peers_by_agent.pop(peer.post_agent, None)
        self.nixl.remove_remote(peer.agent)
        if self.waits:
            self._resolve_waits()

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

    def _poll_notifs(self, now: float) -> None:
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

    # -- transfers ------------------------------------------------------------------
    def post(self, op: str, peer: Peer, regions, notif: bytes = b""):
        """Post ``op`` of ``(local_off, remote_off, nbytes)`` regions with ``peer``: by index
        into the prepared lists when every region is whole sub-blocks on both grids, else
        with descriptors built for this transfer."""
        if self._prepared_with(peer):
            idx = indices(self.grid, peer.grid, regions)
            if idx is not None:
                self.counters["posts_prepped"] += 1
                return self.nixl.post_prepped(op, idx[0], peer.agent, idx[1], notif)
        self.counters["posts_adhoc"] += 1
        return self.nixl.post(op, regions, self.pool.base_addr, peer.agent, peer.pool_base, notif, peer.dev_id)

    def _prepared_with(self, peer: Peer) -> bool:
        """Both pools' descriptor grids are prepared in NIXL: transfers with ``peer`` post by index."""
        return self.grid is not None and peer.grid is not None and self.nixl.has_prepared(peer.agent)

    def _index_plan(self, peer: Peer, heads: Optional[tuple[int, int]], we_send: bool) -> Optional[IndexPlan]:
        """The whole-region plan between our pool and ``peer``'s (source first: ours when
        ``we_send``), built once per peer, direction and heads; None when either grid is not
        prepared or the pair needs the general mapping."""
        if not self._prepared_with(peer):
            return None
        key = (heads, we_send)
        if key not in peer.plans:
            src, dst = (self.layout, peer.layout) if we_send else (peer.layout, self.layout)
            peer.plans[key] = index_plan(src, dst, heads)
        return peer.plans[key]

    def takes_marks(self) -> bool:
        """Whether our worker marks layer groups stored (P, layer-streamed push)."""
        return False

    def post_blocks(self, op: str, peer: Peer, heads: Optional[tuple[int, int]], src_blocks, dst_blocks,
                    num_tokens: int, notif: Callable[[int, int], bytes] = lambda n, r: b"",
                    before: Callable[[int], None] = lambda nbytes: None):
        """Post ``op`` moving ``num_tokens`` tokens of ``heads``: a WRITE from our ``src_blocks``
        into the peer's ``dst_blocks``, a READ from the peer's ``src_blocks`` into ours.
        A planned pair posts grid indices computed straight from the block ids (no byte
        regions); any other maps byte regions (``protocol/mapping.py``) and posts them.
        ``notif(nbytes, runs)`` makes the notification; ``before(nbytes)`` runs just before the
        post. Returns (handle, nbytes, descriptor runs)."""
        return self.post_spans(op, peer, heads, [(src_blocks, dst_blocks, num_tokens, None)], notif, before)

    def post_spans(self, op: str, peer: Peer, heads: Optional[tuple[int, int]], spans,
                   notif: Callable[[int, int], bytes] = lambda n, r: b"",
                   before: Callable[[int], None] = lambda nbytes: None):
        """``post_blocks`` of several ``(src_blocks, dst_blocks, num_tokens, layer groups or None)``
        spans as one transfer (one notification): a layer-streamed WRITE moves each layer
        group from its own first token."""
        we_send = op == "WRITE"
        plan = self._index_plan(peer, heads, we_send)
        if plan is not None:
            parts = [plan_indices(plan, s, d, n, g) for s, d, n, g in spans]
            si, di = parts[0][:2] if len(parts) == 1 else (
                np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
            nbytes, runs = sum(p[2] for p in parts), sum(p[3] for p in parts)
            before(nbytes)
            local, remote = (si, di) if we_send else (di, si)
            self.counters["posts_prepped"] += 1  # by index into the prepared lists, as post() does
            self.counters["posts_planned"] += 1  # ... with indices straight from block ids
            return self.nixl.post_prepped(op, local, peer.agent, remote, notif(nbytes, runs)), nbytes, runs
        src, dst = (self.layout, peer.layout) if we_send else (peer.layout, self.layout)
        regions = [r for s, d, n, g in spans for r in map_transfer(src, s, dst, d, n, heads, g)]
        nbytes, runs = sum(r[2] for r in regions), len(regions)
        before(nbytes)
        local = regions if we_send else [(d, s, n) for s, d, n in regions]  # (local, remote, bytes)
        return self.post(op, peer, local, notif(nbytes, runs)), nbytes, runs

    def _check_inflight(self, now: float) -> None:
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
        stuck_s = 2 * self.cfg.timeouts.transfer_s
        if now - fl.posted > stuck_s:  # a peer that vanished mid-transfer may never answer
            self.counters["transfer_stuck"] += 1
            fl.failed = fl.failed or f"transfer stuck for {stuck_s:.0f}s; abandoned"
            for h in fl.handles:
                self.nixl.release(h)
            fl.handles = []
        pending, failure = self.nixl.reap(fl.handles, "transfer failed in flight")
        fl.failed = fl.failed or failure
        fl.handles = pending
        if not pending:
            del self.inflight[key]
            self._last_activity = now
            self.transfer_finished(fl, now)

    def transfer_finished(self, fl: InFlight, now: float) -> None:
        raise NotImplementedError

    def tick(self, now: float) -> None:
        if self._beat_keys or self._beats:
            self._beat(time.perf_counter())
        self._poll_notifs(now)
        if self.inflight:
            self._check_inflight(now)
        if self.links:
            self._expire_links(now)
        self.expire(now)

    def expire(self, now: float) -> None:
        """Side-specific deadlines."""

    def has_pending(self) -> bool:
        return False

    # -- warm: a hot loop while a transfer with us is expected --------------------------
    def warm_for(self, key, until: float) -> None:
        """Spin (when warm is on) until ``key``'s transfer is done or ``until`` (the cap: a
        lost request cannot keep us spinning); the first cap of a key holds."""
        if self.warm:
            self._warm.setdefault(key, until)

    def cool(self, key) -> None:
        self._warm.pop(key, None)
        if self._beat_keys:
            for agent in [a for a, keys in self._beat_keys.items() if key in keys]:
                self._beat_keys[agent].discard(key)
                if not self._beat_keys[agent]:
                    del self._beat_keys[agent]

    # -- keep-warm WRITEs ---------------------------------------------------------------
    def beat_for(self, key, agent: str) -> None:
        """While ``key`` stays warm, keep our WRITE path to ``agent`` warm (``_beat``)."""
        peer = self.peers_by_agent.get(agent)
        if key in self._warm and peer is not None and peer.sink_addr and BEAT_MS > 0:
            if self.device_uuid and peer.device_uuid == self.device_uuid:
                # P and D share the GPU: the beats' copies ran beside P's prefill and slowed it
                # 15 % (8k prompt, qwen3-8b, H200: 299.7 against 260.9 ms), for a post that costs
                # little on one device anyway
                self.counters["warm_beats_same_gpu_skipped"] += 1
                return
            self._beat_keys.setdefault(agent, set()).add(key)

    def _beat(self, now: float) -> None:
        """Every BEAT_MS, a WRITE of BEAT_BYTES from the start of our pool into each expected
        peer's sink (memory no request owns, so the bytes matter to no one): what a post costs
        depends on how long ago the last one was, and a real WRITE is coming."""
        for agent, h in list(self._beats.items()):
            pending, failure = self.nixl.reap([h], "keep-warm WRITE failed")
            if not pending:
                del self._beats[agent]
                if failure:
                    self.counters["warm_beats_failed"] += 1
        for agent in list(self._beat_keys):
            peer = self.peers_by_agent.get(agent)
            if agent in self._beats or peer is None or now - self._last_beat.get(agent, 0.0) < BEAT_MS / 1e3:
                continue
            self._last_beat[agent] = now
            n = min(BEAT_BYTES, peer.sink_bytes, self.pool.nbytes)
            try:
                self._beats[agent] = self.nixl.post("WRITE", [(0, 0, n)], self.pool.base_addr, agent, peer.sink_addr,
                                                    remote_dev=peer.dev_id)
                self.counters["warm_beats"] += 1
            except Exception as e:  # a dead peer: its transfers fail on their own deadlines
                self.counters["warm_beats_failed"] += 1
                log.debug("%s: keep-warm WRITE to %s failed: %s", self.name, agent, e)

    def poll_timeout_ms(self) -> int:
        now = time.monotonic()
        for table in (self._expected, self._warm):  # overstayed (slow, lost): no more spinning for it
            if table:
                for k in [k for k, t in table.items() if t <= now]:
                    del table[k]
        p = poll_ms(now, expected_until=max(self._expected.values(), default=None),
                    inflight_until=max((fl.posted + spin_s(fl.nbytes) for fl in self.inflight.values()), default=None),
                    warm_until=max(self._warm.values(), default=None),
                    pending=self.has_pending(), last_activity=self._last_activity)
        if p.ms == 0:
            if p.why == "warm":
                self.counters["warm_spins"] += 1
            return self._spin()
        return p.ms

    @staticmethod
    def _spin() -> int:
        """Poll again at once, but let a runnable process on this core go first: on a
        crowded host the peer whose progress we wait for may be the one waiting for the core."""
        os.sched_yield()
        return 0

    def on_GetStats(self, msg: m.GetStats) -> None:
        # warm_expected: a gauge (transfers we keep the loop hot for now), next to the counters
        gauges = {"warm_expected": len(self._warm)}
        if self.nixl is not None and self.nixl.poster is not None:
            gauges["poster_posts"] = self.nixl.poster.posts  # transfers its thread posted
        self.send(self.sched, m.WriterStats(counters={**self.counters, **gauges}))
