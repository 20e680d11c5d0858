"""The one-token decode step's small kernels made shorter, each against the path it replaces, bit for bit: under
Triton's interpreter on the CPU (TRITON_INTERPRET=1, set in a child process before Triton is imported) and on a
GPU.

- ``triton_moe.RANK_ROUTE_ONE_TOKEN``: ``_route_one_kernel`` (the choices by rank, the tables from registers)
  against ``_route_group_kernel``: weights, experts, slot table and block experts, ties included;
- ``triton_gemv.ROPE_EPILOGUE``: ``qkv_rope`` (the qkv GEMV whose last program of each head norms, rotates and
  stores it) against the GEMV and ``qk_norm_rope_store``: q and the whole cache, the counters left zero, twice
  (and on a GPU in a CUDA graph replayed twice);
- ``triton_paged.MERGE_UNROLLED`` and ``EARLY_V``: the split decode attention against the shipped launches;
- ``triton_fused.ROUTER_EARLY``: ``add_rms_router`` with its router rows loaded before the wait;
- ``triton_moe.ROUTE_IN_NORM``: ``add_rms_router``'s last program routing the token, against its logits routed by
  ``_route_group_kernel``, twice.
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
from pushkv.model.kernels import paged, triton_fused, triton_gemv, triton_moe, triton_paged
from pushkv.model.step import StepTensors, plan_step

args = json.loads(sys.argv[1])
dev = torch.device(args["device"])
checked = {}


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# 1. the routing by rank
for E, k, renorm, dtype in args["route"]:
    for trial in range(3):
        torch.manual_seed(E + k + trial)
        logits = torch.randn(1, E, device=dev).to(getattr(torch, dtype))
        if trial == 1:
            logits[0, ::3] = 0.25  # ties: the lower expert first
        if trial == 2:
            logits.fill_(1.0)  # every probability equal
        got = []
        for on in (False, True):
            triton_moe.RANK_ROUTE_ONE_TOKEN = on
            got.append(triton_moe.group_logits(logits, k, renorm, 16))
        for name, a, b in zip(("weights", "experts", "slot ids", "block experts"), *got):
            assert same(a, b), (E, k, renorm, dtype, trial, name, a, b)
        checked["route"] = checked.get("route", 0) + 1
triton_moe.RANK_ROUTE_ONE_TOKEN = False

# 2. the qkv GEMV with each head's norm, RoPE and store
for hq, hk, D, K, norm, bias, dtype in args["rope"]:
    dt = getattr(torch, dtype)
    torch.manual_seed(hq * D + K)
    N = (hq + 2 * hk) * D
    x = torch.randn(1, K, device=dev).to(dt)
    w = (torch.randn(N, K, device=dev) / K ** 0.5).to(dt)
    b = torch.randn(N, device=dev).to(dt) if bias else None
    qn, kn = (torch.randn(D, device=dev).to(dt), torch.randn(D, device=dev).to(dt)) if norm else (None, None)
    cos, sin = torch.randn(64, D, device=dev).to(dt), torch.randn(64, D, device=dev).to(dt)
    pos, slots = torch.tensor([37], device=dev), torch.tensor([21], device=dev)
    base = torch.randn(4, 2, hk, 16, D, device=dev).to(dt)
    got = []
    for on in (False, True, True):  # the second call finds the counters the first left
        triton_gemv.ROPE_EPILOGUE = on
        cache = base.clone()
        q = triton_gemv.qkv_rope(x, w, b, hq, hk, D, qn, kn, 1e-6, cos, sin, pos, slots, cache)
        got.append((q, cache))
        assert not triton_gemv._COUNTERS.get(dev, torch.zeros(1)).any()
    assert not torch.equal(got[0][1], base), "nothing stored"
    for q, cache in got[1:]:
        assert same(q, got[0][0]) and same(cache, got[0][1]), (hq, hk, D, K, norm, bias, dtype)
    if dev.type == "cuda":  # replayed from a CUDA graph, twice
        triton_gemv.ROPE_EPILOGUE = True
        cache = base.clone()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            triton_gemv.qkv_rope(x, w, b, hq, hk, D, qn, kn, 1e-6, cos, sin, pos, slots, cache)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            q = triton_gemv.qkv_rope(x, w, b, hq, hk, D, qn, kn, 1e-6, cos, sin, pos, slots, cache)
        for _ in range(2):
            cache.copy_(base)
            q.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize(dev)
            assert same(q, got[0][0]) and same(cache, got[0][1]), "graph"
            assert not triton_gemv._COUNTERS[dev].any()
    checked["rope"] = checked.get("rope", 0) + 1
triton_gemv.ROPE_EPILOGUE = False

# 3. the decode attention: the merge's loads unrolled, the values asked with the keys
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
    for unrolled, early in ((False, False), (True, False), (False, True), (True, True)):
        triton_paged.MERGE_UNROLLED, triton_paged.EARLY_V = unrolled, early
        scratch = paged.decode_scratch(splits, len(seqs), kvh * G, kvh, d, dev)[:2]
        got.append(triton_paged.attention(q, cache, meta.block_table, meta.seq_lens, meta.q_starts, meta.q_lens,
                                          meta.decode_tiles, meta.decode_q0, 1, splits, 0, None, scratch))
    want = paged.attention_ref(q.float(), cache.float(), meta.block_table, meta.seq_lens, meta.q_starts, meta.q_lens, 0)
    assert float((got[0].float() - want).abs().max()) <= (2e-2 if dt == torch.bfloat16 else 2e-4)
    for g in got[1:]:
        assert same(g, got[0]), (G, splits, dtype)
    checked["attn"] = checked.get("attn", 0) + 1
triton_paged.MERGE_UNROLLED = triton_paged.EARLY_V = False

# 4. the router's rows loaded before the wait
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
triton_fused.ROUTER_EARLY = False

# 5. the routing made by add_rms_router's last program, twice (the counter left zero)
for d, E, k, renorm, dtype in args["norm_route"]:
    dt = getattr(torch, dtype)
    torch.manual_seed(d + E + k)
    x, delta = torch.randn(1, d, device=dev).to(dt), torch.randn(1, d, device=dev).to(dt)
    nw, router = torch.randn(d, device=dev).to(dt), torch.randn(E, d, device=dev).to(dt)
    xo, h, logits = triton_fused.add_rms_router(x, delta, nw, 1e-6, router)
    want = triton_moe.group_logits(logits, k, renorm, 16)
    for _ in range(2):
        got = triton_fused.add_rms_router(x, delta, nw, 1e-6, router, route=triton_moe.NormRoute(k, renorm, 16))
        assert all(same(a, b) for a, b in zip(got[:3], (xo, h, logits))), (d, E, k, renorm, dtype)
        for name, a, b in zip(("weights", "experts", "slot ids", "block experts"), got[3], want):
            assert same(a, b), (d, E, k, renorm, dtype, name, a, b)
        assert not triton_fused._COUNTERS[dev].any()
    checked["norm_route"] = checked.get("norm_route", 0) + 1
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
def test_shorter_decode_kernels_give_the_shipped_bits_under_the_interpreter():
    checked = _run({"device": "cpu", "d": 32,
                    "route": [[128, 8, True, "float32"], [60, 4, False, "bfloat16"], [8, 2, True, "float32"]],
                    "rope": [[4, 2, 32, 64, True, False, "float32"], [2, 1, 64, 32, False, True, "bfloat16"]],
                    "attn": [[4, 3, "float32"], [1, 16, "float32"]],
                    "router": [[64, 8, "float32"]],
                    "norm_route": [[64, 16, 4, True, "float32"], [32, 8, 2, False, "bfloat16"]]})
    assert checked == {"route": 9, "rope": 2, "attn": 2, "router": 1, "norm_route": 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_shorter_decode_kernels_give_the_shipped_bits():
    """The same at Qwen3-30B-A3B's shapes (128 experts, 8 chosen; 32 q and 4 kv heads of 128 over 2048) and smaller
    ones, bf16 and float32, and the GEMV with its heads' epilogue replayed from a CUDA graph."""
    route = [[E, k, renorm, dt] for E, k in ((128, 8), (60, 4), (8, 2)) for renorm in (True, False)
             for dt in ("bfloat16", "float32")]
    rope = [[32, 4, 128, 2048, True, False, dt] for dt in ("bfloat16", "float32")] + [
        [28, 4, 128, 1024, False, True, "bfloat16"], [8, 2, 64, 512, True, True, "float32"]]
    attn = [[G, s, dt] for G in (8, 1) for s in (2, 16) for dt in ("bfloat16", "float32")]
    norm_route = [[2048, 128, 8, True, "bfloat16"], [2048, 128, 8, False, "float32"], [1024, 60, 4, True, "bfloat16"],
                  [512, 8, 2, True, "float32"]]
    checked = _run({"device": "cuda", "d": 128, "route": route, "rope": rope, "attn": attn,
                    "router": [[2048, 128, "bfloat16"], [1024, 60, "float32"]], "norm_route": norm_route})
    assert checked == {"route": 3 * len(route), "rope": len(rope), "attn": len(attn), "router": 2,
                       "norm_route": len(norm_route)}
