"""Single-host discovery: the instances this host's supervisor planned, and their
deaths and restarts from its lifecycle events.

``LocalWatcher`` is the router's ``Watcher`` for a deployment one supervisor runs:
the records come from the planned config, an instance goes down at the first exit
of one of its processes (the supervisor then restarts the whole instance) and comes
back up when the supervisor reports it ready again (``<role>.instance.ready``, or
every process that exited is ready again after a single-process restart).
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import AsyncIterator, Optional

import msgspec
import zmq
import zmq.asyncio

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, Role
from pushkv.discovery.records import DiscoveryEvent, InstanceDown, InstanceHealth, InstanceRecord, InstanceUp
from pushkv.framing import Drops, Shape, arecv_bounded
from pushkv.security import secure_connect

ENGINE_ROLES: tuple[Role, ...] = ("prefill", "decode")


def record_of(cfg: DeploymentConfig, inst: InstanceConfig, supervisor_pid: int = 0) -> InstanceRecord:
    return InstanceRecord(
        engine_id=inst.engine_id, role=inst.role, sched_endpoint=inst.sched_endpoint,
        handshake_endpoints=tuple(inst.handshake_endpoints), tp=inst.tp, block_size=inst.block_size,
        num_blocks=inst.num_blocks, max_num_seqs=inst.max_num_seqs, host=cfg.advertise or cfg.host,
        supervisor_pid=supervisor_pid or os.getppid(), started_unix=time.time(),
    )


def planned_records(cfg: DeploymentConfig, local: bool = False) -> list[InstanceRecord]:
    """P's and D's records; in local mode none, or with ``local`` its one instance's."""
    if cfg.mode == "local":
        return [record_of(cfg, cfg.local)] if local else []
    return [record_of(cfg, i) for role in ENGINE_ROLES for i in cfg.role_instances(role)]


class InstanceTracker:
    """Pure: lifecycle events in, discovery events out (tested with plain calls)."""

    def __init__(self, cfg: DeploymentConfig, local: bool = False):
        self.cfg = cfg
        self.local = local  # local mode: track its one instance too (the router's LoRA catch-up after a restart)
        self.records = {r.engine_id: r for r in planned_records(cfg, local)}
        self.dead: dict[str, set[str]] = {}  # engine id -> its processes that exited, while down
        self.sick: dict[str, set[str]] = {}  # engine id -> its processes that stopped answering pings (hung)

    def engine_of(self, ev: m.LifecycleEvent) -> Optional[str]:
        if self.cfg.mode == "local":  # its one instance, where tracked
            return self.cfg.local.engine_id if self.local and ev.role == "local" and ev.instance == 0 else None
        if ev.role not in ENGINE_ROLES:
            return None
        insts = self.cfg.role_instances(ev.role)
        return insts[ev.instance].engine_id if ev.instance < len(insts) else None

    def on_event(self, ev: m.LifecycleEvent) -> Optional[DiscoveryEvent]:
        engine = self.engine_of(ev)
        if engine is None:
            return None
        if ev.kind == "instance":
            if ev.event == "ready" and engine in self.dead:
                del self.dead[engine]
                self.sick.pop(engine, None)  # a new incarnation: whatever hung went with the old one
                return InstanceUp(self.records[engine])
            return None
        if ev.event in ("unhealthy", "healthy", "exit"):
            health = self._health(engine, ev)
            if health is not None:
                return health
        if ev.event == "exit":
            first = engine not in self.dead
            self.dead.setdefault(engine, set()).add(ev.name)
            if first:
                return InstanceDown(engine, ev.role, f"{ev.name} died ({ev.detail})")
            return None
        if ev.event == "ready" and engine in self.dead:
            self.dead[engine].discard(ev.name)
            if not self.dead[engine]:  # every process that exited is back (a single-process restart)
                del self.dead[engine]
                return InstanceUp(self.records[engine])
        return None

    def _health(self, engine: str, ev: m.LifecycleEvent) -> Optional[InstanceHealth]:
        """An instance turns unhealthy with its first process that stops answering pings, and healthy again once
        every such process answers (or exits: its death is news of its own)."""
        sick = self.sick.setdefault(engine, set())
        was = bool(sick)
        if ev.event == "unhealthy":
            sick.add(ev.name)
        else:
            sick.discard(ev.name)
        if not sick:
            del self.sick[engine]
        if ev.event == "unhealthy" and not was:
            return InstanceHealth(engine, ev.role, False, f"{ev.name} has not answered its supervisor's pings")
        if ev.event == "healthy" and was and not sick:
            return InstanceHealth(engine, ev.role, True, f"{ev.name} answers again")
        return None


class LocalWatcher:
    """``Watcher`` over the planned config and the supervisor's event stream."""

    def __init__(self, cfg: DeploymentConfig, ctx: Optional[zmq.asyncio.Context] = None, security=None,
                 local: bool = False):
        self.cfg = cfg
        self.security = security  # pushkv.security.Security, or None: CURVE if the events endpoint is tcp://
        self.tracker = InstanceTracker(cfg, local)
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self._sub: Optional[zmq.asyncio.Socket] = None

    def snapshot(self) -> list[InstanceRecord]:
        return list(self.tracker.records.values())

    async def events(self) -> AsyncIterator[DiscoveryEvent]:
        for rec in self.snapshot():
            yield InstanceUp(rec)
        if not self.cfg.events_endpoint:
            await asyncio.Event().wait()  # nothing will change
        self._sub = sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"pushkv.")
        secure_connect(sub, self.cfg.events_endpoint, self.security)
        shape, drops = Shape.of(sub), Drops("router's watcher")
        try:
            while True:
                frames, why, n, nbytes = await arecv_bounded(sub, shape)
                if frames is None:
                    drops.drop("supervisor events", why, n, nbytes, shape)
                    continue
                try:
                    ev = m.DEC_EVENT.decode(frames[-1])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                out = self.tracker.on_event(ev)
                if out is not None:
                    yield out
        finally:
            sub.close(0)
            self._sub = None

    async def close(self) -> None:
        if self._sub is not None:
            self._sub.close(0)
            self._sub = None
