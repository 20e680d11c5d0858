"""The scheduler core's answer to ``GetStats`` (the router's /metrics and placement): its counters and pool, with
each writer rank's counters asked afresh (``writer.<rank>.<name>``). The core's ``on_GetStats`` and ``on_WriterStats``
call ``asked`` and ``writer_said``; pure, as the core is."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pushkv import messages as m
from pushkv.scheduler.outbox import Peer
from pushkv.scheduler.requests import State

if TYPE_CHECKING:  # (the core calls these; its module imports this one)
    from pushkv.scheduler.core import SchedulerCore


def asked(core: "SchedulerCore", msg: m.GetStats, frm: Peer) -> None:
    """Answer with our counters and the writers' (``writer.<rank>.<name>``), asked afresh."""
    core._stats_waiting.append(frm)
    if len(core._stats_waiting) == 1:
        core._stats_asked, core._stats_fresh = core.now, set()
        core._to_writers(m.GetStats())
    if not core.writers:
        answer(core)


def writer_said(core: "SchedulerCore", msg: m.WriterStats, frm: Peer) -> None:
    core.writer_counters[frm.rank] = dict(msg.counters)
    core._stats_fresh.add(frm.rank)
    if core._stats_waiting and len(core._stats_fresh) >= len(core.writers):
        answer(core)


def answer(core: "SchedulerCore") -> None:
    running = sum(1 for r in core.reqs.values() if r.state == State.RUNNING)
    counters = dict(core.counters)
    counters["prefix_evictions"] = core.alloc.evictions
    for rank, wc in core.writer_counters.items():
        counters.update({f"writer.{rank}.{k}": v for k, v in wc.items()})
    queued = len(core.waiting) + sum(len(held) for held in core.compiling.values())
    stats = m.Stats(core.inst.engine_id, core.role, core.alloc.num_blocks, core.alloc.num_free,
                    running, queued, counters, core.alloc.num_cached)
    waiting, core._stats_waiting = core._stats_waiting, []
    for to in waiting:
        core._send(to, stats)
