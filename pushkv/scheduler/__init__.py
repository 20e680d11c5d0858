"""Schedulers: one class per role over a shared sans-I/O core (``core.SchedulerCore``), run
in its process by ``shell.SchedulerShell``, which owns the sockets."""
from __future__ import annotations


def scheduler_for(cfg, inst):
    """The scheduler core for ``inst.role``: prefill, decode or local (``SchedulerShell(core)``
    runs it)."""
    from pushkv.scheduler.decode import DecodeScheduler
    from pushkv.scheduler.local import LocalScheduler
    from pushkv.scheduler.prefill import PrefillScheduler

    classes = {c.role: c for c in (PrefillScheduler, DecodeScheduler, LocalScheduler)}
    if inst.role not in classes:
        raise ValueError(f"no scheduler for role {inst.role!r} (known: {sorted(classes)})")
    return classes[inst.role](cfg, inst)
