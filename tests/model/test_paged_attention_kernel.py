"""The paged-attention Triton kernel (pushkv/model/kernels/triton_paged.py) against the torch reference on the CPU,
under Triton's interpreter (TRITON_INTERPRET=1, set in a child process: it must be set before Triton is imported).

Covers what the GPU test (tests/model/test_batched.py) covers at sizes the interpreter runs in seconds, with the
prefill's heavy-tiles-first order and its mask-free loop over keys before a tile's queries each on and off: long
prefills, a chunk after cached keys, decode rows split over programs, a sliding window, and a head size that is
not a power of two (its loads keep their mask). And decode splits merged in the attention kernel by the last split
program (``FUSED_MERGE``) against the merge kernel, bit for bit, under the interpreter and on a GPU."""
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


FUSED_SCRIPT = r"""
import json, sys, torch
from pushkv.messages import SeqWork
from pushkv.model.kernels import paged, triton_paged
from pushkv.model.step import StepTensors, plan_step

args = json.loads(sys.argv[1])
dev = torch.device(args["device"])
merge_kernel = triton_paged._merge_kernel


class NoMerge:
    def __getitem__(self, grid):
        raise AssertionError("the merge kernel was launched with the fused merge on")


def attend(q, cache, meta, splits, window, scratch, fused, out=None):
    triton_paged.FUSED_MERGE = fused
    triton_paged._merge_kernel = NoMerge() if fused and len(scratch) > 2 else merge_kernel
    out = torch.full_like(q, float("nan")) if out is None else out
    return triton_paged.attention(q, cache, meta.block_table, meta.seq_lens, meta.q_starts, meta.q_lens,
                                  meta.decode_tiles, meta.decode_q0, 1, splits, window, out, scratch)


checked = 0
for dtype in args["dtypes"]:
    dtype = getattr(torch, dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else args["tol"]
    for G in sorted({c[0] for c in args["cases"]}):
        kvh, u, d = 2, 16, args["d"]
        torch.manual_seed(G)
        cache = torch.randn(80, 2, kvh, u, d, device=dev).to(dtype)
        # keys from one tile of BLOCK_N to ten; the last row is a graph's padding, no keys at all
        seqs, start = [], 0
        for i, ctx in enumerate((1, 20, 40, 300, 130, 1)):
            nb = -(-ctx // u)
            seqs.append(SeqWork(i, (1,), ctx - 1, tuple(range(start, start + nb))))
            start += nb
        meta = StepTensors.upload(plan_step(seqs, u, block_q=16), dev)
        meta.seq_lens[-1] = 0
        q = torch.randn(len(seqs), kvh * G, d, device=dev).to(dtype)
        for window in sorted({c[1] for c in args["cases"] if c[0] == G}):
            want = paged.attention_ref(q.float(), cache.float(), meta.block_table, meta.seq_lens, meta.q_starts,
                                       meta.q_lens, window)
            for splits in sorted({c[2] for c in args["cases"] if c[:2] == [G, window]}):
                scratch = paged.decode_scratch(splits, len(seqs), kvh * G, kvh, d, dev)
                two = attend(q, cache, meta, splits, window, scratch, False)
                err = float((two.float() - want).abs().max())
                assert err <= tol, ("two launches", dtype, G, window, splits, err)
                for call in range(2):  # the second finds the counters the first left: zero, or it merges nothing
                    fused = attend(q, cache, meta, splits, window, scratch, True)
                    assert torch.equal(fused, two), (dtype, G, window, splits, call)
                    assert not scratch[2].any(), scratch[2]
                if splits == 3:  # a (partials, (m, l)) scratch has no counters: merged in a second launch
                    assert torch.equal(attend(q, cache, meta, splits, window, scratch[:2], True), two)
                if splits == 16 and dev.type == "cuda":  # a CUDA graph replayed twice on one scratch
                    out = torch.empty_like(q)
                    side = torch.cuda.Stream(dev)
                    side.wait_stream(torch.cuda.current_stream(dev))
                    with torch.cuda.stream(side):
                        attend(q, cache, meta, splits, window, scratch, True, out)
                    torch.cuda.current_stream(dev).wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        attend(q, cache, meta, splits, window, scratch, True, out)
                    for _ in range(2):
                        out.fill_(float("nan"))
                        graph.replay()
                        torch.cuda.synchronize(dev)
                        assert torch.equal(out, two), (dtype, G, window, "graph")
                        assert not scratch[2].any(), scratch[2]
                checked += 1
try:
    attend(q, cache, meta, 2, 0, (scratch[0], scratch[1], scratch[2][:1]), True)
    raise AssertionError("a counter buffer too small for the tiles was taken")
except ValueError:
    pass
print("ok", checked)
"""


# (G, window, splits): GQA 8 and 1 query heads a KV head, a sliding window, and splits of which many hold no keys
FUSED_CASES = [(G, window, splits) for G in (8, 1) for window in (0, 37) for splits in (2, 3, 16)]


def _fused_merge(args: dict) -> None:
    env = {**os.environ}
    if args["device"] == "cpu":
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", FUSED_SCRIPT, json.dumps(args)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1].startswith("ok"), r.stderr[-3000:]


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernel itself (the test below)")
def test_fused_merge_gives_the_two_launch_bits_under_the_interpreter():
    """Decode splits merged by the last split program equal the merge kernel's bit for bit, leave the counters
    zero (a second call on the same scratch merges again), and keys in one tile leave most splits empty."""
    # the interpreter's seconds: a few (FUSED_MERGE is off by default; the GPU test below runs every case)
    cases = [(8, 37, 3), (8, 0, 16), (1, 37, 16)]
    _fused_merge({"device": "cpu", "dtypes": ["float32"], "d": 32, "tol": 2e-5, "cases": cases})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fused_merge_gives_the_two_launch_bits():
    """The same on the GPU, bf16 and float32, and in a CUDA graph replayed twice."""
    _fused_merge({"device": "cuda", "dtypes": ["bfloat16", "float32"], "d": 128, "tol": 2e-4, "cases": FUSED_CASES})


LATENT_SCRIPT = r"""
import sys, torch
from pushkv.model.kernels import triton_paged
dev = sys.argv[1]
torch.manual_seed(0)
D, U = 72, 8  # MLA's latent of r + rd (not a power of two)
cache = torch.full((6, 1, 1, U, D), float("nan"), device=dev)
lat = torch.randn(5, D, device=dev)
slots = torch.tensor([3, -1, 17, 40, -1], dtype=torch.int32, device=dev)  # -1: a graph's padding, not stored
triton_paged.store_latent(cache, lat, slots)
flat = cache.view(-1, D)
for t, s in enumerate(slots.tolist()):
    if s >= 0:
        assert torch.equal(flat[s], lat[t]), s
assert int((~flat.isnan().all(-1)).sum()) == 3  # nothing else written
print("ok")
"""


@pytest.mark.unit
def test_the_latent_store_writes_each_row_at_its_slot_and_skips_padding():
    """MLA's latent rows by the store kernel (one plane): each row at its flat slot, a slot < 0 not stored; under
    Triton's interpreter here, the kernel itself on a GPU."""
    env = {**os.environ}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", LATENT_SCRIPT, dev], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
