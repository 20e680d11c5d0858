"""A READ that NIXL failed because P's endpoint went away is answered as P's death is (503, retry).

P's writer killed mid-load: one request's READ failed to post with NIXL_ERR_REMOTE_DISCONNECT before the
supervisor's news of the death reached anyone, and its client got 502 "KV transfer failed", where the
requests that heard of the death first got 503 "prefill instance failed ...; retry" (docs/design/faults.md:
the answer does not depend on which heard first). Objects only: no socket, pool or NIXL agent.
"""
from __future__ import annotations

import pytest

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, preset
from pushkv.supervisor.plan import plan_deployment
from pushkv.writer.base import InFlight
from pushkv.writer.sides import peer_gone


@pytest.mark.parametrize("failure,lost", [
    ("READ failed to post: NIXL_ERR_REMOTE_DISCONNECT", "prefill instance unreachable "
                                                        "(READ failed to post: NIXL_ERR_REMOTE_DISCONNECT)"),
    ("transfer failed in flight: NIXL_ERR_REMOTE_DISCONNECT", "prefill instance unreachable "
                                                             "(transfer failed in flight: NIXL_ERR_REMOTE_DISCONNECT)"),
    ("transfer stuck for 30s; abandoned", ""),
    ("READ failed to post: NIXL_ERR_BACKEND", ""),
    ("cancelled: client went away", ""),
])
def test_peer_gone(failure, lost):
    assert peer_gone(failure, "prefill") == lost


def test_a_read_failed_by_a_gone_p_is_answered_as_its_death(tmp_path):
    from pushkv.writer.decode import DecodeWriter

    cfg = plan_deployment(DeploymentConfig(mode="pull", model=preset("tiny"), prefill=InstanceConfig(role="prefill"),
                                           decode=InstanceConfig(role="decode")), run_root=str(tmp_path))
    w = DecodeWriter(cfg, cfg.decode, 0)
    sent: list = []
    w.sched = "sched"  # its socket, in a running writer
    w.send = lambda ch, msg, identity=None: sent.append(msg)  # type: ignore[method-assign]
    pull = m.PullParams(m.PrefillSource("prefill-x", 1, ("tcp://127.0.0.1:1",)), (0, 1), 20, 7, 0.0)
    for tid, failure in (("gone", "READ failed to post: NIXL_ERR_REMOTE_DISCONNECT"), ("other", "READ failed")):
        w._reads[(tid, 0)] = m.ReadKV(tid, 0, (3, 4), pull, 30.0)
        w.transfer_finished(InFlight(tid, 0, failed=failure), 1.0)
    failed = {x.transfer_id: x for x in sent if isinstance(x, m.KVFailed)}
    assert failed["gone"].lost == "prefill instance unreachable (READ failed to post: NIXL_ERR_REMOTE_DISCONNECT)"
    assert failed["other"].lost == ""
