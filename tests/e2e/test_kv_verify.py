"""Verified handoff end to end (--kv-verify), real processes and real NIXL over UCX: a writer
damages the KV it moves (pushkv.faults.fire: a flipped byte at the source before the
transfer or at the destination after it, a transfer a block short, two destination blocks
swapped), and D's workers catch each one before the first decode step. The request fails
with the reason (502, never a 200), D counts it, and every block of both pools comes back;
the next request is served. Push checks a sample of blocks of a hybrid model (a sliding-window
layer group) from one P rank to two D ranks, in one WRITE; push-layer the same with the KV
layer-streamed (parts leave as P's worker marks each layer group stored, so the faults must
damage what the last WRITE carries: the flipped byte is the last group's, and the prompt a
whole number of units whose first groups' ends left in parts); pull checks every block, D's
blocks twice P's. On a GPU, push-layer and pull run again with the pools in GPU memory."""
import json
import os
import random
import urllib.request

import pytest
import torch

from pushkv import faults
from tests.support.deploy import deployment, wait_pools_free

pytestmark = pytest.mark.timeout(300)

# 40 prompt tokens per line: several blocks of 16 on P, so a block can be dropped or swapped
PROMPT = "verified handoff: the KV that lands is P's " * 3
MAX_TOKENS = 4

# (process that damages the KV, fire point) per mode
PUSH_CASES = [("prefill-writer-0", "kv_flip_source"), ("decode-writer-0", "kv_flip_dest"),
              ("prefill-writer-0", "kv_truncate"), ("prefill-writer-0", "kv_swap_dest")]
CASES = {
    "push": PUSH_CASES,
    "push-layer": PUSH_CASES,
    # pull: D may READ before P's writer has even seen the hold (the READ is one-sided), so the
    # source is damaged by P's worker, right after it summed the KV
    "pull": [("prefill-worker-0", "kv_flip_source"), ("decode-writer-0", "kv_flip_dest"),
             ("decode-writer-0", "kv_truncate"), ("decode-writer-0", "kv_swap_dest")],
}
FLAGS = {  # layouts besides P's: TP 1 -> 2 with a sliding-window layer group, and D blocks twice P's
    "push": ("--mode", "push", "--push-stream", "off", "--kv-verify", "sample", "--model", "hybrid",
             "--decode-tp", "2"),
    # three layer groups of the small model's four layers; chunks of 32, so a prompt of 256 tokens is
    # 8 steps of layer marks, and D's registration is in long before the last one (parts leave);
    # --push-pin-fraction 1: no request goes late (a late one streams nothing)
    "push-layer": ("--mode", "push", "--push-stream", "layer", "--push-stream-groups", "3", "--prefill-chunk", "32",
                   "--push-pin-fraction", "1", "--kv-verify", "sample", "--model", "small",
                   "--decode-block-size", "32"),
    "pull": ("--mode", "pull", "--kv-verify", "full", "--model", "small", "--decode-block-size", "32"),
}
LAYER_PROMPT_TOKENS = 256  # a whole number of units (32 tokens: the lcm of P's and D's blocks)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# on a GPU the same cases run with the pools in GPU memory: P's sums by the Triton kernel, D's
# check on the device (checksum.verify), the faults' bytes flipped in GPU memory
@pytest.fixture(scope="module", params=["push", "push-layer", "pull", pytest.param("push-layer cuda", marks=GPU),
                                        pytest.param("pull cuda", marks=GPU)])
def dep(request, tmp_path_factory):
    mode, _, device = request.param.partition(" ")  # no device named: the CPU (a GPU host's default is CUDA)
    d = tmp_path_factory.mktemp(f"kv-verify-{mode}")
    fdir = d / "armed"
    fdir.mkdir()
    os.environ["PUSHKV_FAULTS_DIR"] = str(fdir)
    try:
        with deployment(d, "--num-blocks", "64", *FLAGS[mode], "--device", device or "cpu") as dp:
            dp.faults_dir = str(fdir)
            dp.mode = mode
            yield dp
    finally:
        os.environ.pop("PUSHKV_FAULTS_DIR", None)


def _counters(dp) -> dict:
    return dp.stats("decode").counters


def _prompt(dp, case: str):
    """A prompt of its own per case: blocks a short transfer leaves stale must not hold this KV
    already (nor D's prefix cache). Layer-streamed: token ids, a whole number of units."""
    if dp.mode != "push-layer":
        return f"{case}: {PROMPT}"
    rng = random.Random(case)
    return [rng.randrange(256) for _ in range(LAYER_PROMPT_TOKENS)]


def _parts(dp) -> int:
    return dp.stats("prefill").counters.get("writer.0.parts", 0)


def test_damaged_kv_is_caught_and_clean_kv_is_served(dep):
    c0 = _counters(dep)
    parts0 = _parts(dep)
    clean = dep.tokens(_prompt(dep, "clean"), MAX_TOKENS)
    assert len(clean) == MAX_TOKENS
    c1 = _counters(dep)
    assert c1.get("kv_verified", 0) == c0.get("kv_verified", 0) + 1
    assert c1.get("kv_verify_sums", 0) > c0.get("kv_verify_sums", 0)
    if dep.mode == "push-layer":
        assert _parts(dep) > parts0, "no part left before the last WRITE: nothing was layer-streamed"
    for writer, point in CASES[dep.mode]:
        before = _counters(dep).get("kv_verify_failed", 0)
        parts = _parts(dep)
        armed = faults.arm_fire(dep.faults_dir, writer, point)
        status, body = dep.post("/v1/completions", {"prompt": _prompt(dep, point), "max_tokens": MAX_TOKENS})
        assert not os.path.exists(armed), f"{point} never fired"
        assert status == 502, (point, status, body)
        assert "KV verification failed" in str(body) and "KV checksum mismatch" in str(body), (point, body)
        assert _counters(dep).get("kv_verify_failed", 0) == before + 1, point
        if dep.mode == "push-layer":  # the damage was to the last WRITE, after parts had left
            assert _parts(dep) > parts, point
        print(f"\n{dep.mode} {point}: {status} {body.get('error', body)}")
        wait_pools_free(dep, 20)
    assert dep.tokens(_prompt(dep, "clean"), MAX_TOKENS) == clean  # undamaged again: the same tokens
    wait_pools_free(dep, 20)


def _stream(dp, prompt) -> tuple[int, str]:
    """A streamed completion: (tokens before the end, the error's message or '')."""
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}).encode()
    req = urllib.request.Request(dp.url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    tokens = 0
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return tokens, ev["error"].get("message", "")
            tokens += sum(len(c.get("token_ids") or ()) for c in ev.get("choices", ()))
    return tokens, ""


def test_streamed_damage_sends_ps_token_then_the_failure(dep):
    """P's first token does not depend on the KV that moved: D sends it on as the KV lands, while its
    workers check; the mismatch then ends the stream with the reason, and no token decoded from the
    damaged KV is sent (in every mode: D's writer flips a byte of what lands)."""
    armed = faults.arm_fire(dep.faults_dir, "decode-writer-0", "kv_flip_dest")
    tokens, error = _stream(dep, _prompt(dep, "streamed"))
    assert not os.path.exists(armed), "kv_flip_dest never fired"
    assert "KV verification failed" in error, error
    assert tokens == 1, tokens  # P's token, and nothing decoded after it
    wait_pools_free(dep, 20)
    tokens, error = _stream(dep, _prompt(dep, "streamed clean"))
    assert (tokens, error) == (MAX_TOKENS, "")
    wait_pools_free(dep, 20)
