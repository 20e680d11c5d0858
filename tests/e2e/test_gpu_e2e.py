"""On a GPU: real deployments on the batched engine (Triton paged attention, CUDA graphs).

Push and pull through P/D equal one local instance token for token with the
batch-invariant mode on (each sequence runs alone, so its bytes never depend on the
batch); with it off, concurrent requests still complete and the first tokens agree
(bf16 matmuls of different batch shapes differ in the last bits, which can flip a
later greedy choice where the top two logits are within that noise).
"""
from __future__ import annotations

import concurrent.futures as cf
import random
import time

import pytest
import torch

from tools.launch import launched

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GEOM = ("--model", "medium", "--dtype", "bfloat16", "--device", "cuda", "--num-blocks", "2048")


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [1, 15, 16, 17, 300, 1000, 2500][:n]
    return [[rng.randrange(256) for _ in range(k)] for k in lens]


def run(flags, ps, max_tokens=24, concurrent=False):
    with launched(*flags, start_timeout_s=240) as d:
        if concurrent:
            with cf.ThreadPoolExecutor(len(ps)) as ex:
                return list(ex.map(lambda p: d.tokens(p, max_tokens), ps))
        return [d.tokens(p, max_tokens) for p in ps]


@pytest.mark.timeout(600)
def test_gpu_push_and_pull_equal_local_batch_invariant():
    flags = GEOM + ("--batch-invariant", "on")
    ps = prompts(7)
    want = run(("--mode", "local") + flags, ps, concurrent=True)
    assert len({tuple(w) for w in want}) > 1
    for mode in (("--mode", "push"), ("--mode", "pull", "--pull-read", "inline")):
        assert run(mode + flags, ps, concurrent=True) == want, mode


@pytest.mark.timeout(600)
def test_gpu_batched_concurrent_requests_complete():
    flags = GEOM + ("--batch-invariant", "off")
    ps = prompts(7, seed=1) * 3
    want = run(("--mode", "local") + flags, ps[:7])
    got = run(("--mode", "push") + flags, ps, concurrent=True)
    assert all(len(g) == 24 for g in got)
    # first token: from P's prefill of that prompt alone in both (no decode batching yet)
    assert [g[0] for g in got[:7]] == [w[0] for w in want]


@pytest.mark.timeout(300)
def test_gpu_qwen3_8b_serves_within_60s():
    t0 = time.monotonic()
    with launched("--mode", "push", "--model", "qwen3-8b", "--device", "cuda", "--num-blocks", "4096",
                  start_timeout_s=240) as d:
        ready = time.monotonic() - t0
        out = d.tokens(list(range(100, 1100)), 8)
    assert len(out) == 8
    assert ready < 60, f"READY after {ready:.0f}s"


@pytest.mark.timeout(600)
def test_gpu_layer_streamed_push_equals_local():
    """--push-stream layer on the GPU: the worker's CUDA events gate each layer group's WRITE
    (fused Triton path), and the tokens equal local mode's with the batch-invariant mode on."""
    flags = GEOM + ("--batch-invariant", "on")
    ps = prompts(7)
    want = run(("--mode", "local") + flags, ps)
    layer = ("--mode", "push", "--push-stream", "layer", "--push-stream-groups", "4")
    with launched(*layer, *flags, start_timeout_s=240) as d:
        got = []
        for p in ps:
            status, body = d.post("/v1/completions", {"prompt": p, "max_tokens": 24})
            assert status == 200, body
            got.append(body["choices"][0]["token_ids"])
            kv, tl = body["pushkv"]["kv"]["prefill"], body["pushkv"]["timeline"]
            assert kv["stream"] == "layer", kv
            if len(p) >= 16 and tl["prefill.registration_received"] < tl["prefill.layers_stored_0"]:
                assert kv["parts"] > 0, (len(p), kv, tl)  # D was ready: group 0 left while later layers computed
        marks = sum(v for k, v in d.stats("prefill").counters.items() if k.endswith("layer_marks_received"))
    assert got == want
    assert marks == 4 * len(ps)  # every group of every prompt's one prefill step


@pytest.mark.timeout(600)
def test_gpu_pushkv_staging_equals_local():
    """--staging pushkv on the GPU: NIXL moves the writers' pinned host mirrors, P copies each
    WRITE's bytes out of the GPU pool on its copy stream, D copies each part's blocks in as it
    lands (its PartWritten) and the rest before reporting them; the tokens equal local mode's
    (batch-invariant), streamed per layer group."""
    flags = GEOM + ("--batch-invariant", "on")
    ps = prompts(7)
    want = run(("--mode", "local") + flags, ps)
    staged = ("--mode", "push", "--push-stream", "layer", "--push-stream-groups", "4", "--staging", "pushkv")
    with launched(*staged, *flags, start_timeout_s=240) as d:
        got = [d.tokens(p, 24) for p in ps]
        p_counters, d_counters = d.stats("prefill").counters, d.stats("decode").counters
    assert got == want
    total = lambda cs, k: sum(v for n, v in cs.items() if n.endswith("." + k))  # noqa: E731
    assert total(p_counters, "stage_out_copies") >= len(ps)
    # P's loop never waited on a copy: a post whose copy still ran waited in staging.Copying instead
    assert total(p_counters, "stage_out_waits") == 0, p_counters
    assert total(d_counters, "stage_in_copies") == total(d_counters, "kv_received") == len(ps)
    assert total(d_counters, "stage_in_part_cells") > 0 or total(p_counters, "parts") == 0, d_counters


@pytest.mark.timeout(600)
@pytest.mark.parametrize("staging", ["transport", "pushkv"])
def test_gpu_chunk_streamed_push_equals_local(staging):
    """--push-stream chunk on the GPU: each prefill chunk's part leaves once the scheduler hears the
    chunk's step done. A step that samples nothing (a non-final chunk) must still have stored its
    K/V by then: a part posted (or staged out on the copy stream) earlier reads unstored blocks,
    which D's KV check fails (502), as it did at 8k over a capped link before the worker waited."""
    flags = GEOM + ("--batch-invariant", "on", "--prefill-chunk", "256")
    ps = prompts(7)
    want = run(("--mode", "local") + flags, ps)
    chunk = ("--mode", "push", "--push-stream", "chunk", "--push-pin-fraction", "1", "--staging", staging)
    with launched(*chunk, *flags, start_timeout_s=240) as d:
        got = []
        for p in ps:
            status, body = d.post("/v1/completions", {"prompt": p, "max_tokens": 24})
            assert status == 200, body
            got.append(body["choices"][0]["token_ids"])
        counters = d.stats("prefill").counters
    assert got == want
    assert sum(v for k, v in counters.items() if k.endswith(".parts")) > 0, counters  # 1000 and 2500 streamed
