"""A decode step's small kernels reading what no kernel of the step writes before they wait for the kernel before
them, each against the same kernel reading it after, bit for bit: under Triton's interpreter on the CPU
(TRITON_INTERPRET=1, set in a child process before Triton is imported) and on a GPU.

- ``triton_fused.ROUTER_EARLY``: ``add_rms_router``'s router rows;
- ``triton_fused.CONSTS_EARLY``: ``qk_norm_rope_store``'s norm weights, positions, cos/sin rows and slots (q and
  the whole cache compared, with and without the q/k norm, one token and a prefill's many);
- ``triton_paged.CONSTS_EARLY``: the split decode attention's merge, its tile's row from the step's tables.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = r"""
import json, sys, torch
from pushkv.messages import SeqWork
from pushkv.model.kernels import paged, triton_fused, triton_paged
from pushkv.model.step import StepTensors, plan_step

args = json.loads(sys.argv[1])
dev = torch.device(args["device"])
checked = {}


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# 1. the router's rows
for d, E, dtype in args["router"]:
    dt = getattr(torch, dtype)
    torch.manual_seed(d + E)
    x, delta = torch.randn(1, d, device=dev).to(dt), torch.randn(1, d, device=dev).to(dt)
    nw, router = torch.randn(d, device=dev).to(dt), torch.randn(E, d, device=dev).to(dt)
    got = []
    for on in (False, True):
        triton_fused.ROUTER_EARLY = on
        got.append(triton_fused.add_rms_router(x, delta, nw, 1e-6, router))
    for a, b in zip(*got):
        assert same(a, b), (d, E, dtype)
    checked["router"] = checked.get("router", 0) + 1

# 2. the q/k norm, RoPE and store
for T, hq, hk, D, norm, dtype in args["rope"]:
    dt = getattr(torch, dtype)
    torch.manual_seed(T + hq * D)
    qkv = torch.randn(T, (hq + 2 * hk) * D, device=dev).to(dt)
    qn, kn = (torch.randn(D, device=dev).to(dt), torch.randn(D, device=dev).to(dt)) if norm else (None, None)
    cos, sin = torch.randn(64, D, device=dev).to(dt), torch.randn(64, D, device=dev).to(dt)
    pos = torch.randint(0, 64, (T,), device=dev)
    slots = torch.randperm(64, device=dev)[:T]
    if T > 1:
        slots[0] = -1  # a padding row: nothing stored
    base = torch.randn(4, 2, hk, 16, D, device=dev).to(dt)
    got = []
    for on in (False, True):
        triton_fused.CONSTS_EARLY = on
        cache = base.clone()
        q = triton_fused.qk_norm_rope_store(qkv, hq, hk, D, qn, kn, 1e-6, cos, sin, pos, slots, cache)
        got.append((q, cache))
    assert not torch.equal(got[0][1], base), "nothing stored"
    assert same(got[1][0], got[0][0]) and same(got[1][1], got[0][1]), (T, hq, hk, D, norm, dtype)
    checked["rope"] = checked.get("rope", 0) + 1
triton_fused.CONSTS_EARLY = False

# 3. the decode merge
for G, splits, dtype in args["attn"]:
    dt = getattr(torch, dtype)
    kvh, u, d = 2, 16, args["d"]
    torch.manual_seed(G + splits)
    cache = torch.randn(80, 2, kvh, u, d, device=dev).to(dt)
    seqs, start = [], 0
    for i, ctx in enumerate((1, 20, 40, 300, 130)):
        nb = -(-ctx // u)
        seqs.append(SeqWork(i, (1,), ctx - 1, tuple(range(start, start + nb))))
        start += nb
    meta = StepTensors.upload(plan_step(seqs, u, block_q=16), dev)
    q = torch.randn(len(seqs), kvh * G, d, device=dev).to(dt)
    got = []
    for on in (False, True):
        triton_paged.CONSTS_EARLY = on
        scratch = paged.decode_scratch(splits, len(seqs), kvh * G, kvh, d, dev)[:2]
        got.append(triton_paged.attention(q, cache, meta.block_table, meta.seq_lens, meta.q_starts, meta.q_lens,
                                          meta.decode_tiles, meta.decode_q0, 1, splits, 0, None, scratch))
    want = paged.attention_ref(q.float(), cache.float(), meta.block_table, meta.seq_lens, meta.q_starts, meta.q_lens, 0)
    assert float((got[0].float() - want).abs().max()) <= (2e-2 if dt == torch.bfloat16 else 2e-4)
    assert same(got[1], got[0]), (G, splits, dtype)
    checked["attn"] = checked.get("attn", 0) + 1
triton_paged.CONSTS_EARLY = False
print("ok", json.dumps(checked))
"""


def _run(args: dict) -> dict:
    env = {**os.environ}
    if args["device"] == "cpu":
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(args)], capture_output=True, text=True, env=env,
                       timeout=900)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0 and last.startswith("ok"), r.stderr[-3000:]
    return json.loads(last[3:])


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernels themselves (the test below)")
def test_early_reads_give_the_same_bits_under_the_interpreter():
    checked = _run({"device": "cpu", "d": 32, "router": [[64, 8, "float32"]],
                    "rope": [[1, 4, 2, 32, True, "float32"], [3, 2, 1, 64, False, "bfloat16"]],
                    "attn": [[4, 3, "float32"], [1, 16, "float32"]]})
    assert checked == {"router": 1, "rope": 2, "attn": 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_early_reads_give_the_same_bits():
    """The same at Qwen3-30B-A3B's shapes (128 experts over 2048; 32 q and 4 kv heads of 128) and smaller ones,
    bf16 and float32, one token and a prefill's 100."""
    rope = [[T, 32, 4, 128, norm, dt] for T in (1, 100) for norm in (True, False) for dt in ("bfloat16", "float32")]
    attn = [[G, s, dt] for G in (8, 1) for s in (2, 16) for dt in ("bfloat16", "float32")]
    checked = _run({"device": "cuda", "d": 128, "router": [[2048, 128, "bfloat16"], [1024, 60, "float32"]],
                    "rope": rope, "attn": attn})
    assert checked == {"router": 2, "rope": len(rope), "attn": len(attn)}
