"""Pull, end to end: D's ReadDone reaches P's writer before P's scheduler's HoldKV.

P's scheduler sends the hold to its writers and P's block ids to the router at once; D READs as soon
as the router relays them, so its ReadDone (a NIXL notification) can be read before the hold (a ZeroMQ
message on another socket), as it was in 10 of 70 requests of a loaded pull run on the CPU. Here the
writer handles the hold a second late (``faults.delay``, "hold"), so the ReadDone always comes first:
the request completes and P's blocks come back at once, not when the 30 s lease runs out.
"""
import os

import pytest

from pushkv import faults
from tests.support.deploy import deployment, local_references, wait_pools_free

pytestmark = pytest.mark.timeout(240)

COMMON = ("--model", "tiny", "--num-blocks", "64")
PROMPT = [(i * 37) % 256 for i in range(40)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return local_references(tmp_path_factory, {"one": PROMPT}, MAX_TOKENS, 64)("tiny", 1)["one"]


@pytest.fixture(scope="module")
def pull(tmp_path_factory):
    d = tmp_path_factory.mktemp("pull")
    fdir = d / "armed"
    fdir.mkdir()
    os.environ["PUSHKV_FAULTS_DIR"] = str(fdir)
    try:
        # D rank 1 and 0 both read from P's one rank: the lease waits for two ReadDones
        with deployment(d, "--mode", "pull", "--decode-tp", "2", *COMMON) as dep:
            dep.faults_dir = str(fdir)
            yield dep
    finally:
        os.environ.pop("PUSHKV_FAULTS_DIR", None)


def test_read_done_before_the_hold_frees_p_blocks_at_once(pull, reference):
    faults.arm_delay(pull.faults_dir, "prefill-writer-0", "hold", 1.0)
    assert pull.tokens(PROMPT, MAX_TOKENS) == reference
    st = wait_pools_free(pull, timeout_s=10.0)  # the lease is 30 s: held until then, this fails
    p = dict(st["prefill"].counters)
    assert p.get("writer.0.read_done_before_hold", 0) >= 1, p  # the fault held the hold back
    assert p.get("writer.0.lease_read_before_hold") == 1, p
    assert p.get("writer.0.lease_expired", 0) == 0 and p.get("writer.0.transfers_failed", 0) == 0, p
    assert p.get("kv_transfers") == 1, p
