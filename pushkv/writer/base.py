"""pushkv's writer process: owns the KV pool and the NIXL agent of one instance rank.

A role writer (``prefill.py`` / ``decode.py`` / ``local.py``) over this base, itself over
the shell every writer shares, the vLLM connector's included (``shell.py``), which holds
the parts:

- ``peers.py``: the peer table and the handshake (Hello / HelloRefused, wire version and
  model check), driven by the loop, never blocking it; forgetting a dead peer;
- ``posting.py``: posting WRITE/READ by index into prepared descriptor lists (or with
  descriptors built per transfer, off the grids), polling notifications, reaping transfers;
- ``warm.py``: wake hints, warm spinning, keep-warm beats, the poll timeout (``poll.py``);
- ``memory.py``: what is registered (base address, size, layout, grid).

Here: the pool and its registration, the scheduler channel, what pushkv's Hello carries and
what a peer must match (its pool layout), and the news of a dead peer instance.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Optional

import zmq

from pushkv import limits
from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, marks_endpoint, model_fingerprint, rank_device
from pushkv.kv import layer_events
from pushkv.kv import layout as L
from pushkv.kv.pool import Pool, create_pool, shm_name
from pushkv.protocol.mapping import check_compatible
from pushkv.transport import poster, staging_plan
from pushkv.transport.grid import grid_of
from pushkv.transport.nixl_agent import NixlAgent
from pushkv.writer import memory as mem
from pushkv.writer.peers import HANDSHAKE_TIMEOUT_S, Peer, PeerLink, PeerWait
from pushkv.writer.poll import warm_enabled
from pushkv.writer.posting import SETTLE_S, InFlight
from pushkv.writer.shell import WriterShell
from pushkv.writer.staging import StagingArea
from pushkv.writer.warm import BEAT_BYTES, BEAT_MS

log = logging.getLogger(__name__)

__all__ = ["BEAT_BYTES", "BEAT_MS", "HANDSHAKE_TIMEOUT_S", "SETTLE_S", "InFlight", "Peer", "PeerLink", "PeerWait",
           "WriterBase"]


class WriterBase(WriterShell):
    def __init__(self, cfg: DeploymentConfig, inst: InstanceConfig, rank: int):
        # keep the loop hot while a transfer with us is expected (config writer_warm)
        super().__init__(f"{inst.name}-writer-{rank}", cfg.control_endpoint, cfg.trace_endpoint, cfg.secret_file,
                         limits.msg_cap_bytes(cfg), warm=warm_enabled(cfg.writer_warm, rank_device(inst, rank)),
                         stuck_s=2 * cfg.timeouts.transfer_s)
        self.cfg = cfg
        self.inst = inst
        self.engine_id = inst.engine_id
        self.rank = rank
        self.layout = L.instance_layout(cfg, inst, rank)  # cut to match the peer instance
        self.model_id = model_fingerprint(cfg.model)  # peers must agree on what the KV means
        self.pool: Optional[Pool] = None
        self.area: Optional[StagingArea] = None  # --staging pushkv: what NIXL moves, pinned host memory
        self.copy_hold_s = 0.0  # tests (faults.py's hold): each copy out reported running this long
        self.memory = mem.Memory(0, 0, self.layout)  # the pool's, once registered (setup)
        self._lost = ""  # while ending transfers with a dead peer instance: KVFailed.lost for them
        self.mark_waiter: Optional[layer_events.MarkWaiter] = None  # P, layer-streamed: waits for marks' events

    def damaged_by(self, kv: Any) -> None:
        """Fault tests of --kv-verify: a role writer that moves KV damages it through ``kv``
        (``kv_damage.KVDamage``), wired in once at its start; this one moves none."""

    @property
    def agent_name(self) -> str:
        return f"{self.inst.engine_id}-w{self.rank}"

    # -- lifecycle --------------------------------------------------------------
    def setup(self) -> None:
        name = shm_name(self.cfg.deployment_id, self.inst.name, self.rank, os.getpid())
        device = rank_device(self.inst, self.rank)
        self.pool = create_pool(name, self.layout, self.cfg.model.dtype, device)
        ucx_tls = os.environ.get("UCX_TLS", "")
        post_thread = self.inst.role == "prefill" and poster.wanted(self.cfg.writer_post_thread, ucx_tls)
        if staging_plan.wanted(self.cfg.staging, self.cfg.mode, device, ucx_tls):
            # NIXL sees only a pinned host staging area: every transfer moves host to host (writer/staging.py)
            blocks = staging_plan.area_blocks(self.layout.num_blocks, L.block_bytes(self.layout), self.cfg.staging_mib,
                                              staging_plan.host_memory_bytes())
            # P's cut per layer group (a WRITE takes cells of the groups it carries); D's whole (its
            # Register names one slot list for every group)
            self.area = StagingArea(self.pool.tensor, device, self.layout, blocks, cut=self.inst.role == "prefill")
            log.info("%s: staging through a pinned host area of %d of the pool's %d blocks (%.1f MiB)", self.name,
                     blocks, self.layout.num_blocks, self.area.nbytes / 2**20)
            self.area.hold_s = self.copy_hold_s
        self.nixl = NixlAgent(self.agent_name, device="cpu" if self.area is not None else device,
                              post_thread=post_thread)
        if post_thread:
            log.info("%s: WRITEs posted by agent %s on its own thread", self.name, self.nixl.post_agent)
        if device != "cpu":
            import torch

            self.device_uuid = str(torch.cuda.get_device_properties(torch.device(device)).uuid)
        if self.area is not None:  # transfers name the area's blocks (slots): a pool of that many blocks
            self.memory = mem.Memory(self.area.base_addr, self.area.nbytes, self.area.layout, 0)
        else:
            self.memory = mem.Memory(self.pool.base_addr, self.pool.nbytes, self.layout, self.nixl.dev_id)
        if self.warmup.wants_sink():
            import torch

            self.warmup.sink = torch.empty(BEAT_BYTES, dtype=torch.uint8,
                                    device="cpu" if self.area is not None else device)  # NIXL's memory kind
            self.memory.extra.append((self.warmup.sink.data_ptr(), BEAT_BYTES))
        try:
            grid = grid_of(self.memory.layout)
        except Exception as e:  # every transfer then builds its own descriptors
            log.warning("%s: no descriptor grid for the pool (ad-hoc posts instead): %s", self.name, e)
            grid = None
        mem.register(self.nixl, self.memory, grid, self.name)
        self._channels()
        log.info("%s: pool %d blocks x %d B = %.1f MiB at %s", self.name, self.layout.num_blocks,
                 L.block_bytes(self.layout), self.pool.nbytes / 2**20, self.pool.handle.name or self.pool.handle.kind)

    def _channels(self) -> None:
        sched = self.socket(zmq.DEALER, self.inst.writer_endpoints[self.rank], bind=True)
        self.sched = self.add_channel(sched, m.DEC_SCHED_TO_WRITER, f"{self.inst.name}-scheduler")
        if self.takes_marks():
            marks = self.socket(zmq.PULL, marks_endpoint(self.inst.writer_endpoints[self.rank]), bind=True)
            self.add_channel(marks, m.DEC_WORKER_TO_WRITER, f"{self.inst.name}-worker-{self.rank}")
            # a mark's event is our worker's, on its device
            dev_id = layer_events.device_index(rank_device(self.inst, self.rank))
            self.mark_waiter = layer_events.MarkWaiter(layer_events.event_opener(dev_id))
            self.add_fd(self.mark_waiter.fd, self._marks_ready)
        if self.inst.handshake_endpoints:
            # Hello, TransferStarting: no request's size
            self.bind_handshake(self.inst.handshake_endpoints[self.rank], limits.CONTROL_MSG_BYTES)
        if self.cfg.events_endpoint:
            sub = self.socket(zmq.SUB, self.cfg.events_endpoint, bind=False)
            sub.setsockopt(zmq.SUBSCRIBE, b"pushkv.")
            self.add_channel(sub, m.DEC_EVENT, "supervisor-events")

    def takes_marks(self) -> bool:
        """Whether our worker marks layer groups stored (P, layer-streamed push)."""
        return False

    def ready_msg(self) -> m.Ready:
        return m.Ready(self.name, os.getpid(), pool=self.pool.handle if self.pool else None, agent=self.agent_name)

    def _marks_ready(self) -> None:
        """The mark waiter's fd turned readable (the role that takes marks handles them)."""

    def teardown(self) -> None:
        super().teardown()
        if self.mark_waiter is not None:
            self.mark_waiter.close()
        if self.area is not None:
            self.area.close()
        if self.pool is not None:
            self.pool.close()

    # -- what our Hello carries, and what a peer's must match ----------------------------
    def hello(self) -> m.Hello:
        sink = self.warmup.sink
        return m.Hello(
            engine_id=self.inst.engine_id, rank=self.rank, tp=self.inst.tp,
            agent_name=self.agent_name, agent_metadata=self.nixl.metadata(),
            pool_base=self.memory.base_addr, layout=self.memory.layout, device_id=self.nixl.dev_id,
            sink_addr=sink.data_ptr() if sink is not None else 0,
            sink_bytes=BEAT_BYTES if sink is not None else 0, device_uuid=self.device_uuid,
            wire_version=m.WIRE_VERSION, model_id=self.model_id, post_agent=self.nixl.post_agent,
            mem_kind=self.nixl.mem_type,
        )

    def check_peer(self, h: m.Hello) -> None:
        check_compatible(self.layout, h.layout)
        if h.mem_kind and h.mem_kind != self.nixl.mem_type:  # descriptors name one kind for both sides
            raise ValueError(f"peer's transfers use {h.mem_kind} memory, ours {self.nixl.mem_type} (both sides "
                             "must run the same --staging)")

    def peer_of(self, h: m.Hello, agent: str) -> Peer:
        return Peer(h.engine_id, h.rank, h.tp, agent, h.pool_base, h.layout, h.device_id,
                    sink_addr=h.sink_addr, sink_bytes=h.sink_bytes, device_uuid=h.device_uuid,
                    post_agent=h.post_agent)

    def grid_of_peer(self, h: m.Hello) -> Any:
        return grid_of(h.layout)

    # -- a peer instance died ------------------------------------------------------------
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
            self.peers.forget(p)
        self.peer_instance_down(engine, f"{ev.name} died ({ev.detail})", time.monotonic())

    def on_PeerLost(self, msg: m.PeerLost) -> None:
        """The router saw a peer instance leave the registry (or come back as a new
        incarnation): across hosts, the news no supervisor of ours can give."""
        if msg.role == self.inst.role or msg.role not in ("prefill", "decode"):
            return
        self.counters["peer_lost"] += 1
        # both sides forget it: D (which opens the handshakes) handshakes afresh on its next request
        # with that P; P tells a D that may still live that it was dropped, so D does the same
        # (and a D restarted elsewhere is not refused as a displacement of the old one)
        for p in [p for p in self.peers.values() if p.engine_id == msg.engine_id]:
            self.peers.forget(p, tell=msg.reason)
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

    def on_GetStats(self, msg: m.GetStats) -> None:
        # warm_expected: a gauge (transfers we keep the loop hot for now), next to the counters
        gauges = {"warm_expected": len(self.warmup.warm)}
        if getattr(self, "nixl", None) is not None and self.nixl.poster is not None:
            gauges["poster_posts"] = self.nixl.poster.posts  # transfers its thread posted
        if self.area is not None:  # --staging pushkv: the area's room (all free when nothing moves)
            slots = self.area.slots
            gauges["staging_blocks"] = self.area.blocks
            gauges["staging_free_blocks"] = slots.num_free  # free in every layer group
            gauges["staging_cells"] = slots.num_cells  # a layer group of a slot
            gauges["staging_free_cells"] = slots.free_cells
            gauges["staging_peak_cells"] = slots.peak_cells  # the most in use at once
            gauges["staging_room_waits"] = self.area.queue.waits  # transfers that waited for room
        link_posts = getattr(self, "link_posts", None)
        if link_posts is not None:  # the link queues: P's WRITEs, D's READs, waiting and on the wire
            gauges.update(link_posts.gauges())
        self.send(self.sched, m.WriterStats(counters={**self.counters, **gauges}))
