"""On a GPU: preemption by recompute on the batched engine (Triton paged attention, CUDA graphs). Requests running to
--max-model-len on a pool of 1.6 of them preempt one another, in local and push
mode; each completes at its full length, every block is free after, and its greedy tokens are compared with the
same request's on a pool that holds them all.

A readmitted request computes its prompt and output so far as one prefill, where the tokens it had decoded were
computed one decode step at a time. In float32 with the batch-invariant mode on, every request's tokens equal the
large pool's, all 472, 442, 412 and 382 of them (an H100, 2026-12-07: 5 preemptions in local mode and 5 in push),
which the test asserts; it prints how far each request agrees, so a failure says where they part."""
from __future__ import annotations

import pytest
import torch

from tests.support.deploy import in_threads
from tools.launch import launched

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(600)]

DEVICE = "cuda"
MAX_LEN = 512  # 32 blocks of 16 a request
SMALL, LARGE = 52, 2048  # blocks: a pool of 1.6 such requests; one of all of them at once
N = 4
GEOM = ("--model", "medium", "--dtype", "float32", "--device", DEVICE, "--batch-invariant", "on",
        "--max-model-len", str(MAX_LEN))
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(40 + 30 * i)] for i in range(N)]


def run_all(mode: str, num_blocks: int) -> tuple[list[list[int]], float]:
    """Every request at once, each to --max-model-len (blocks come as tokens need them), EOS ignored: their tokens,
    and the preemptions counted."""
    with launched("--mode", mode, "--num-blocks", str(num_blocks), *GEOM, start_timeout_s=240) as d:
        def one(p):
            status, body = d.post("/v1/completions", {"prompt": p, "max_tokens": MAX_LEN - len(p), "ignore_eos": True,
                                                      "return_token_ids": True})
            assert status == 200, body
            assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == MAX_LEN, body["usage"]
            return body["choices"][0]["token_ids"]

        got = in_threads(one, PROMPTS, 500)
        st = d.wait_pools_free()
        role = "local" if mode == "local" else "decode"
        return got, float(st[role].counters.get("preemptions", 0))


def test_gpu_preemption_completes_frees_and_agrees():
    want, none = run_all("local", LARGE)
    assert none == 0
    for mode in ("local", "push"):
        got, preempted = run_all(mode, SMALL)
        assert preempted > 0, mode
        agree = []
        for g, w in zip(got, want):
            assert len(g) == len(w)
            agree.append(next((k for k, (a, b) in enumerate(zip(g, w)) if a != b), len(w)))
        print(f"{mode}: {preempted:.0f} preemptions; tokens equal to the large pool's, per request: "
              f"{agree} of {[len(w) for w in want]}")
        assert got == want, (mode, agree)
