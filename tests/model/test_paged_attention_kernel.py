"""The paged-attention Triton kernel (pushkv/model/kernels/triton_paged.py) against the torch reference on the CPU,
under Triton's interpreter (TRITON_INTERPRET=1, set in a child process: it must be set before Triton is imported).

Covers what the GPU test (tests/model/test_batched.py) covers at sizes the interpreter runs in seconds, with the
prefill's heavy-tiles-first order and its mask-free loop over keys before a tile's queries each on and off: long
prefills, a chunk after cached keys, decode rows split over programs, a sliding window, and a head size that is
not a power of two (its loads keep their mask)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = r"""
import json, random, sys, torch
from pushkv.messages import SeqWork
from pushkv.kv.layout import blocks_for
from pushkv.model.kernels import paged, triton_paged
from pushkv.model.step import StepTensors, plan_step
out = []
for d, window, heavy, free in json.loads(sys.argv[1]):
    triton_paged.HEAVY_FIRST, triton_paged.FREE_LOOP = heavy, free
    torch.manual_seed(d + window)
    kvh, G, u = 2, 4, 16
    cache = torch.randn(80, 2, kvh, u, d)
    rng = random.Random(1)
    used = list(range(80))
    rng.shuffle(used)
    seqs = []
    for i, (ctx, n) in enumerate([(300, 300), (200, 50), (90, 1), (1, 1), (130, 2)]):
        nb = blocks_for(ctx, u)
        table, used = tuple(used[:nb]), used[nb:]
        seqs.append(SeqWork(i, tuple(range(n)), ctx - n, table))
    plan = plan_step(seqs, u, block_q=16)
    meta = StepTensors.upload(plan, torch.device("cpu"))
    q = torch.randn(plan.num_tokens, kvh * G, d)
    want = paged.attention_ref(q, cache, meta.block_table, meta.seq_lens, meta.q_starts, meta.q_lens, window)
    got = torch.zeros_like(q)
    for splits in (1, 3):
        if meta.decode_tiles.shape[0]:
            triton_paged.attention(q, cache, meta.block_table, meta.seq_lens, meta.q_starts, meta.q_lens,
                                   meta.decode_tiles, meta.decode_q0, 1, splits, window, got)
        triton_paged.attention(q, cache, meta.block_table, meta.seq_lens, meta.q_starts, meta.q_lens,
                               meta.prefill_tiles, meta.prefill_q0, meta.block_q, 1, window, got)
        out.append({"case": [d, window, heavy, free, splits], "err": float((got - want).abs().max())})
print(json.dumps(out))
"""


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernel itself (tests/model/test_batched.py)")
def test_attention_kernel_equals_the_reference_under_the_interpreter():
    cases = [(32, 0, True, True), (32, 0, False, False), (24, 0, True, True), (32, 37, True, True)]
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(results) == 2 * len(cases)
    for res in results:
        assert res["err"] <= 2e-5, res
