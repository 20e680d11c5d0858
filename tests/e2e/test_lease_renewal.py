"""Pull under a slow D, end to end: P's lease lives while D still means to read.

A real pull deployment with a short lease (1 s) and a cap (``lease_max_s``, 5 s).
D's scheduler is stalled by an injected fault (``faults.delay``: it admits
nothing and steps nothing, as a long READ ahead of it in the queue would), so
the request waits in D's queue well past the lease. While it waits, D renews
P's lease every lease_s / 3: the request completes with local mode's tokens.
A stall past the cap fails the request with the cap as its reason, and every
block comes back on both sides."""
import json
import os
import time

import pytest

from pushkv import faults
from tests.support.deploy import deployment, wait_pools_free

pytestmark = pytest.mark.timeout(300)

LEASE_S, LEASE_MAX_S = 1.0, 5.0
TIMEOUTS = {"lease_s": LEASE_S, "lease_max_s": LEASE_MAX_S, "transfer_s": 5.0}
COMMON = ("--model", "tiny", "--num-blocks", "64")
PROMPT = [(i * 37) % 256 for i in range(40)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with deployment(tmp_path_factory.mktemp("local"), "--mode", "local", *COMMON) as dep:
        return dep.tokens(PROMPT, MAX_TOKENS)


@pytest.fixture(scope="module")
def pull(tmp_path_factory):
    """Background READ (the default; inline waits in D's queue the same way under the stall,
    and its queue behind a READ is renewed alike: test_scheduler_roles)."""
    d = tmp_path_factory.mktemp("lease")
    cfg_file = d / "short.json"
    cfg_file.write_text(json.dumps({"timeouts": TIMEOUTS}))
    fdir = d / "armed"
    fdir.mkdir()
    os.environ["PUSHKV_FAULTS_DIR"] = str(fdir)
    try:
        with deployment(d, "--mode", "pull", *COMMON, "--config", str(cfg_file)) as dep:
            dep.faults_dir = str(fdir)
            yield dep
    finally:
        os.environ.pop("PUSHKV_FAULTS_DIR", None)


def counters(dep, role: str) -> dict:
    return dict(dep.stats(role).counters)


def stall_decode(dep, seconds: float) -> None:
    """D's scheduler admits nothing and runs no step for ``seconds`` from the next request."""
    faults.arm_delay(dep.faults_dir, "decode-scheduler", "admit", seconds)


def test_lease_renewed_while_d_is_stalled(pull, reference):
    """Stalled 3 lease_s: without renewal P's lease would lapse; with it the request completes."""
    p0, d0 = counters(pull, "prefill"), counters(pull, "decode")
    stall_s = 3 * LEASE_S
    stall_decode(pull, stall_s)
    t0 = time.monotonic()
    assert pull.tokens(PROMPT, MAX_TOKENS) == reference
    took = time.monotonic() - t0
    assert took >= stall_s, f"the stall did not hold D ({took:.2f}s)"
    st = wait_pools_free(pull)
    p, d = dict(st["prefill"].counters), dict(st["decode"].counters)
    grew = lambda c, c0, k: c.get(k, 0) - c0.get(k, 0)  # noqa: E731
    assert grew(p, p0, "writer.0.lease_renewed") >= 2, p  # the lease outlived its first 1 s by renewals
    assert grew(p, p0, "writer.0.lease_expired") == 0 and grew(p, p0, "writer.0.lease_cap_reached") == 0, p
    assert grew(d, d0, "lease_renewals_sent") >= 2 and grew(d, d0, "writer.0.lease_renewals_sent") >= 2, d
    print(f"{pull.cfg.pull_read}: stalled {stall_s:.1f}s with a {LEASE_S:g}s lease: done in {took:.2f}s, "
          f"P renewed {grew(p, p0, 'writer.0.lease_renewed')}x")


def test_lease_cap_fails_the_request_and_frees_every_block(pull):
    """Stalled past the cap: P ends the lease at lease_max_s whatever D says; the client gets
    the cap as the reason, and both pools come back whole."""
    p0 = counters(pull, "prefill")
    stall_decode(pull, LEASE_MAX_S + 4.0)
    t0 = time.monotonic()
    status, body = pull.post("/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS})
    took = time.monotonic() - t0
    assert status == 502, (status, body)
    reason = body["error"]["message"]
    assert "lease reached its cap" in reason and "lease_max_s" in reason, reason
    assert LEASE_MAX_S - 0.5 < took < LEASE_MAX_S + 3.0, took
    st = wait_pools_free(pull)  # P: the lease freed them; D: the router's abort released its queued leg
    p = dict(st["prefill"].counters)
    assert p.get("writer.0.lease_cap_reached", 0) - p0.get("writer.0.lease_cap_reached", 0) == 1, p
    assert p.get("writer.0.lease_renew_capped", 0) > p0.get("writer.0.lease_renew_capped", 0), p
    print(f"{pull.cfg.pull_read}: cap of {LEASE_MAX_S:g}s: failed after {took:.2f}s: {reason}")
