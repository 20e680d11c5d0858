"""Verified handoff end to end (--kv-verify), real processes and real NIXL over UCX: a writer
damages the KV it moves (pushkv.faults.fire: a flipped byte at the source before the
transfer or at the destination after it, a transfer a block short, two destination blocks
swapped), and D's workers catch each one before the first decode step. The request fails
with the reason (502, never a 200), D counts it, and every block of both pools comes back;
the next request is served. Push checks a sample of blocks of a hybrid model (a sliding-window
layer group) from one P rank to two D ranks; pull checks every block, D's blocks twice P's."""
import os

import pytest

from pushkv import faults
from tests.support.deploy import deployment, wait_pools_free

pytestmark = pytest.mark.timeout(300)

# 40 prompt tokens per line: several blocks of 16 on P, so a block can be dropped or swapped
PROMPT = "verified handoff: the KV that lands is P's " * 3
MAX_TOKENS = 4

# (process that damages the KV, fire point) per mode
CASES = {
    "push": [("prefill-writer-0", "kv_flip_source"), ("decode-writer-0", "kv_flip_dest"),
             ("prefill-writer-0", "kv_truncate"), ("prefill-writer-0", "kv_swap_dest")],
    # pull: D may READ before P's writer has even seen the hold (the READ is one-sided), so the
    # source is damaged by P's worker, right after it summed the KV
    "pull": [("prefill-worker-0", "kv_flip_source"), ("decode-writer-0", "kv_flip_dest"),
             ("decode-writer-0", "kv_truncate"), ("decode-writer-0", "kv_swap_dest")],
}
FLAGS = {  # two layouts besides P's: TP 1 -> 2 with a sliding-window layer group, and D blocks twice P's
    "push": ("--kv-verify", "sample", "--model", "hybrid", "--decode-tp", "2"),
    "pull": ("--kv-verify", "full", "--model", "small", "--decode-block-size", "32"),
}


@pytest.fixture(scope="module", params=["push", "pull"])
def dep(request, tmp_path_factory):
    mode = request.param
    d = tmp_path_factory.mktemp(f"kv-verify-{mode}")
    fdir = d / "armed"
    fdir.mkdir()
    os.environ["PUSHKV_FAULTS_DIR"] = str(fdir)
    try:
        with deployment(d, "--mode", mode, "--num-blocks", "64", *FLAGS[mode]) as dp:
            dp.faults_dir = str(fdir)
            dp.mode = mode
            yield dp
    finally:
        os.environ.pop("PUSHKV_FAULTS_DIR", None)


def _counters(dp) -> dict:
    return dp.stats("decode").counters


def test_damaged_kv_is_caught_and_clean_kv_is_served(dep):
    c0 = _counters(dep)
    clean = dep.tokens(PROMPT, MAX_TOKENS)
    assert len(clean) == MAX_TOKENS
    c1 = _counters(dep)
    assert c1.get("kv_verified", 0) == c0.get("kv_verified", 0) + 1
    assert c1.get("kv_verify_sums", 0) > c0.get("kv_verify_sums", 0)
    for writer, point in CASES[dep.mode]:
        before = _counters(dep).get("kv_verify_failed", 0)
        armed = faults.arm_fire(dep.faults_dir, writer, point)
        # a prompt of its own: blocks a short transfer leaves stale must not hold this KV already
        status, body = dep.post("/v1/completions", {"prompt": f"{point}: {PROMPT}", "max_tokens": MAX_TOKENS})
        assert not os.path.exists(armed), f"{point} never fired"
        assert status == 502, (point, status, body)
        assert "KV verification failed" in str(body) and "KV checksum mismatch" in str(body), (point, body)
        assert _counters(dep).get("kv_verify_failed", 0) == before + 1, point
        print(f"\n{dep.mode} {point}: {status} {body.get('error', body)}")
        wait_pools_free(dep, 20)
    assert dep.tokens(PROMPT, MAX_TOKENS) == clean  # undamaged again: the same tokens
    wait_pools_free(dep, 20)
