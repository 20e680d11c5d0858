"""P's writer keeps D's answers that come before its scheduler's hold only where holds are leases.

D's CancelTransfer travels on the handshake link and P's HoldKV on the scheduler's socket, so in pull
(D READs) the cancel may come first and is kept for the hold (tests/protocol/test_protocol_lease.py
has the lease's side). Where every transfer is a WRITE (push, pull's write variant) no lease will
come: the cancel is the rendezvous' alone, and the lease neither keeps nor counts it. Objects only:
no socket, pool or NIXL agent.
"""
from __future__ import annotations

import pytest

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, preset
from pushkv.supervisor.plan import plan_deployment


def writer(tmp_path, **kw):
    from pushkv.writer.prefill import PrefillWriter

    cfg = plan_deployment(DeploymentConfig(model=preset("tiny"), prefill=InstanceConfig(role="prefill"),
                                           decode=InstanceConfig(role="decode"), **kw), run_root=str(tmp_path))
    return PrefillWriter(cfg, cfg.prefill, 0)


@pytest.mark.parametrize("kw,kept", [
    (dict(mode="push"), False),
    (dict(mode="pull", pull_read="write"), False),
    (dict(mode="pull", pull_read="background"), True),
    (dict(mode="pull", pull_read="inline"), True),
], ids=["push", "pull-write", "pull-background", "pull-inline"])
def test_a_cancel_before_the_hold_is_kept_only_for_leases(tmp_path, kw, kept):
    w = writer(tmp_path, **kw)
    w.notif_CancelTransfer(m.CancelTransfer("t", 0, "client went away"), "agent-d", 1.0)
    assert w.counters.get("cancel_before_hold", 0) == int(kept)
    acts = w.leases.hold("t", 0, (5, 6), 2.0)  # what a HoldKV that came next would hold
    assert [type(a).__name__ for a in acts if type(a).__name__ in ("FreeBlocks", "Failed")] == (
        ["FreeBlocks", "Failed"] if kept else [])
