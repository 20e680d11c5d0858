"""Every waiting state has a deadline, end to end: a half whose partner never
comes is failed with a reason and its blocks come back, on both sides. The
deployment runs with short timeouts from a config file; the test talks to the
schedulers directly (as the router would) so that one half can be withheld."""
import json
import time

import pytest
import zmq

from pushkv import messages as m
from tests.support.deploy import deployment, wait_pools_free

pytestmark = pytest.mark.timeout(300)

TIMEOUTS = {"registration_wait_s": 1.5, "write_wait_s": 1.5, "lease_s": 1.5, "transfer_s": 5.0}


def _deployment(tmp_path_factory, mode):
    d = tmp_path_factory.mktemp(f"deadline-{mode}")
    cfg_file = d / "short.json"
    cfg_file.write_text(json.dumps({"timeouts": TIMEOUTS}))
    return deployment(d, "--mode", mode, "--model", "tiny", "--num-blocks", "64", "--config", str(cfg_file))


@pytest.fixture(scope="module")
def push(tmp_path_factory):
    with _deployment(tmp_path_factory, "push") as dep:
        yield dep


@pytest.fixture(scope="module")
def pull(tmp_path_factory):
    with _deployment(tmp_path_factory, "pull") as dep:
        yield dep


def leg(dep, role: str, msg: m.Generate, timeout_s: float = 20.0) -> tuple[list, float]:
    """Send one leg straight to a scheduler; collect replies until a terminal one."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(dep.cfg.instance(role).sched_endpoint)
    t0 = time.monotonic()
    got = []
    try:
        s.send(m.encode(msg))
        while True:
            assert s.poll(int(timeout_s * 1000)), f"no terminal reply from {role}: {got}"
            r = m.DEC_SCHED_TO_ROUTER.decode(s.recv())
            got.append(r)
            if isinstance(r, (m.RequestFailed, m.PrefillFinished)) or getattr(r, "finished", False):
                return got, time.monotonic() - t0
    finally:
        s.close(0)


def source(dep):
    p = dep.cfg.prefill
    return m.PrefillSource(p.engine_id, p.tp, p.handshake_endpoints)


def test_decode_half_alone_expires(push):
    """D registered, P never prefills: D's wait for the WRITE expires; P's held
    registration expires too. Both pools return to free."""
    g = m.Generate("lonely-d", 0, "decode", tuple(range(40)), 4, source=source(push))
    got, took = leg(push, "decode", g)
    assert isinstance(got[-1], m.RequestFailed), got
    assert 1.0 < took < 1.5 + 3.0, took
    st = wait_pools_free(push)
    pc = st["prefill"].counters  # D told P to drop the held registration (or it expired there)
    assert pc.get("writer.0.cancelled", 0) + pc.get("writer.0.expired_registration", 0) >= 1, pc


def test_prefill_half_alone_expires(push):
    """P prefilled, no D ever registers: P's finished blocks wait, then are freed."""
    g = m.Generate("lonely-p", 0, "prefill", tuple(range(40)), 1)
    got, took = leg(push, "prefill", g)
    assert isinstance(got[-1], m.RequestFailed), got
    assert "regist" in got[-1].reason or "expired" in got[-1].reason, got[-1].reason
    assert took < 1.5 + 3.0
    wait_pools_free(push)


def test_pull_lease_expires(pull):
    """Pull: P holds its blocks under a lease; nobody reads; the lease expires."""
    g = m.Generate("lonely-lease", 0, "prefill", tuple(range(40)), 1)
    got, _ = leg(pull, "prefill", g)
    assert isinstance(got[-1], m.PrefillFinished) and got[-1].pull is not None
    t0 = time.monotonic()
    st = wait_pools_free(pull, timeout_s=10)
    assert time.monotonic() - t0 < 1.5 + 3.0
    assert any("lease_expired" in k and v for k, v in st["prefill"].counters.items()), st["prefill"].counters


def test_deployment_still_serves(push, pull):
    for dep in (push, pull):
        assert len(dep.tokens([5, 6, 7], 3)) == 3
        wait_pools_free(dep)
