"""Writer process base: owns the KV pool and the NIXL agent.

Both sides share: pool allocation and registration, the scheduler channel, the
peer handshake (ZMQ REQ/REP, once per peer rank, exchanging NIXL metadata,
pool base address and layout), NIXL notification polling, and tracking of
posted transfers. Side-specific protocol lives in prefill.py / decode.py.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import msgspec
import zmq

from pushkv import messages as m
from pushkv.actor import Actor
from pushkv.config import DeploymentConfig, InstanceConfig, rank_device
from pushkv.kv import layout as L
from pushkv.kv.pool import Pool, create_pool, shm_name
from pushkv.transport.nixl_agent import NixlAgent, TransferError

log = logging.getLogger(__name__)

# something is waiting on a notification (or a peer's one-sided READ may need our progress)
PENDING_POLL_MS = int(os.environ.get("PUSHKV_PENDING_POLL_MS", "1"))
HANDSHAKE_TIMEOUT_MS = 5000
# idle: NIXL notifications have no fd to wait on, so look every 10 ms (a few µs of CPU each:
# ~0.1 % of a core) rather than spin; a SendKV/HoldKV from the scheduler wakes us at once anyway
WRITER_IDLE_POLL_MS = 10


@dataclass
class Peer:
    engine_id: str
    rank: int
    tp: int
    agent: str
    pool_base: int
    layout: m.KVLayoutDesc
    dev_id: int = 0


@dataclass
class InFlight:
    """One posted NIXL transfer (possibly several handles, one per peer rank)."""

    transfer_id: str
    generation: int
    handles: list = field(default_factory=list)
    posted: float = 0.0
    nbytes: int = 0
    num_descs: int = 0
    failed: str = ""


class WriterBase(Actor):
    def __init__(self, cfg: DeploymentConfig, inst: InstanceConfig, rank: int):
        super().__init__(f"{inst.role}-writer-{rank}", cfg.control_endpoint, cfg.trace_endpoint)
        self.cfg = cfg
        self.inst = inst
        self.rank = rank
        self.layout = L.instance_layout(cfg, inst, rank)  # cut to match the peer instance
        self.pool: Optional[Pool] = None
        self.nixl: Optional[NixlAgent] = None
        self.peers: dict[tuple[str, int], Peer] = {}  # (engine_id, rank) -> peer
        self.peers_by_agent: dict[str, Peer] = {}
        self.inflight: dict[tuple[str, int], InFlight] = {}
        self._last_activity = 0.0

    @property
    def agent_name(self) -> str:
        return f"{self.inst.engine_id}-w{self.rank}"

    # -- lifecycle --------------------------------------------------------------
    def setup(self) -> None:
        name = shm_name(self.cfg.deployment_id, self.inst.role, self.rank, os.getpid())
        device = rank_device(self.inst, self.rank)
        self.pool = create_pool(name, self.layout, self.cfg.model.dtype, device)
        self.nixl = NixlAgent(self.agent_name, device=device)
        self.nixl.register(self.pool.base_addr, self.pool.nbytes)
        sched = self.socket(zmq.DEALER, self.inst.writer_endpoints[self.rank], bind=True)
        self.sched = self.add_channel(sched, m.DEC_SCHED_TO_WRITER, f"{self.inst.role}-scheduler")
        if self.inst.handshake_endpoints:
            hs = self.socket(zmq.ROUTER, self.inst.handshake_endpoints[self.rank], bind=True)
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
        for fl in self.inflight.values():
            for h in fl.handles:
                self.nixl.release(h)
        self.inflight.clear()
        if self.nixl is not None:
            self.nixl.deregister()
        if self.pool is not None:
            self.pool.close()

    def hello(self) -> m.Hello:
        return m.Hello(
            engine_id=self.inst.engine_id, rank=self.rank, tp=self.inst.tp,
            agent_name=self.agent_name, agent_metadata=self.nixl.metadata(),
            pool_base=self.pool.base_addr, layout=self.layout, device_id=self.nixl.dev_id,
        )

    # -- handshake ----------------------------------------------------------------
    def _add_peer(self, h: m.Hello) -> Peer:
        from pushkv.protocol.mapping import check_compatible

        check_compatible(self.layout, h.layout)
        old = self.peers.get((h.engine_id, h.rank))
        if old is not None:  # the peer restarted: drop its old NIXL metadata first
            self.forget_peer(old)
        agent = self.nixl.add_remote(h.agent_metadata)
        peer = Peer(h.engine_id, h.rank, h.tp, agent, h.pool_base, h.layout, h.device_id)
        self.peers[(h.engine_id, h.rank)] = peer
        self.peers_by_agent[agent] = peer
        log.info("%s: connected to %s rank %d (agent %s)", self.name, h.engine_id, h.rank, agent)
        return peer

    def on_Hello(self, msg: m.Hello, identity: bytes) -> None:
        """A peer initiated the handshake: load its metadata, answer with ours."""
        try:
            self._add_peer(msg)
        except ValueError as e:
            log.error("%s: refusing peer %s rank %d: %s", self.name, msg.engine_id, msg.rank, e)
            self.counters["peer_incompatible"] += 1
        self.send(self.handshake, self.hello(), identity)

    def connect_peer(self, engine_id: str, rank: int, endpoint: str) -> Peer:
        """Initiate the handshake (blocking, bounded). Raises on timeout/incompatibility."""
        key = (engine_id, rank)
        if key in self.peers:
            return self.peers[key]
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, HANDSHAKE_TIMEOUT_MS)
        try:
            sock.connect(endpoint)
            sock.send(m.encode(self.hello()))
            try:
                reply = m.DEC_HANDSHAKE.decode(sock.recv())
            except zmq.Again:
                raise TransferError(f"handshake with {engine_id} rank {rank} at {endpoint} timed out")
            if reply.engine_id != engine_id or reply.rank != rank:
                raise TransferError(f"handshake at {endpoint} answered by {reply.engine_id} rank {reply.rank}")
            return self._add_peer(reply)
        finally:
            sock.close(0)

    def on_LifecycleEvent(self, ev) -> None:
        """A process of the other instance died: the supervisor restarts that whole
        instance, so its writers' NIXL agents and pools are gone."""
        role = ev.role
        if ev.event != "exit" or role == self.inst.role or role not in ("prefill", "decode"):
            return
        engine = self.cfg.instance(role).engine_id
        dead = [p for p in self.peers.values() if p.engine_id == engine]
        for p in dead:
            self.forget_peer(p)
        self.peer_instance_down(engine, f"{ev.name} died ({ev.detail})", time.monotonic())

    def peer_instance_down(self, engine_id: str, reason: str, now: float) -> None:
        """Side-specific: end transfers with the dead instance."""

    def forget_peer(self, peer: Peer) -> None:
        self.peers.pop((peer.engine_id, peer.rank), None)
        self.peers_by_agent.pop(peer.agent, None)
        self.nixl.remove_remote(peer.agent)

    # -- notifications --------------------------------------------------------------
    def notify(self, peer: Peer, msg: m.Msg) -> None:
        data = m.encode(msg)
        try:
            self.nixl.send_notif(peer.agent, data)
        except Exception as e:  # dead or unknown peer: the deadline covers it
            self.counters["notif_send_failed"] += 1
            log.error("%s: notification %s to %s failed: %s transfer_id=%s", self.name,
                      type(msg).__name__, peer.agent, e, getattr(msg, "transfer_id", ""))
            return
        self.trace_msg("send", peer.agent, msg, data)

    def _poll_notifs(self, now: float) -> None:
        for agent, payloads in self.nixl.poll_notifs().items():
            agent = agent.decode() if isinstance(agent, bytes) else agent
            for payload in payloads:
                self._last_activity = now
                try:
                    msg = m.DEC_PEER.decode(payload)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    self.counters["bad_notif"] += 1
                    log.error("%s: undecodable notification from %s: %s", self.name, agent, e)
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
    def _check_inflight(self, now: float) -> None:
        stuck_s = 2 * self.cfg.timeouts.transfer_s
        for key, fl in list(self.inflight.items()):
            if now - fl.posted > stuck_s:  # a peer that vanished mid-transfer may never answer
                self.counters["transfer_stuck"] += 1
                fl.failed = fl.failed or f"transfer stuck for {stuck_s:.0f}s; abandoned"
                for h in fl.handles:
                    self.nixl.release(h)
                fl.handles = []
            pending = []
            for h in fl.handles:
                try:
                    st = self.nixl.state(h)
                except Exception as e:
                    st = "ERR"
                    fl.failed = fl.failed or str(e)
                if st == "DONE":
                    self.nixl.release(h)
                elif st == "ERR":
                    fl.failed = fl.failed or "transfer failed in flight"
                    self.nixl.release(h)
                else:
                    pending.append(h)
            fl.handles = pending
            if not pending:
                del self.inflight[key]
                self._last_activity = now
                self.transfer_finished(fl, now)

    def transfer_finished(self, fl: InFlight, now: float) -> None:
        raise NotImplementedError

    def tick(self, now: float) -> None:
        self._poll_notifs(now)
        if self.inflight:
            self._check_inflight(now)
        self.expire(now)

    def expire(self, now: float) -> None:
        """Side-specific deadlines."""

    def has_pending(self) -> bool:
        return False

    def poll_timeout_ms(self) -> int:
        if self.inflight:
            return 0  # we drive UCX progress: keep polling while data moves
        if self.has_pending() or time.monotonic() - self._last_activity < 0.05:
            return PENDING_POLL_MS
        return WRITER_IDLE_POLL_MS

    def on_GetStats(self, msg: m.GetStats) -> None:
        self.send(self.sched, m.WriterStats(counters=dict(self.counters)))
