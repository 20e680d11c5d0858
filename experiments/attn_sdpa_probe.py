"""A fresh prefill's attention on a GPU: pushkv's paged Triton kernel against torch's fused attention backends on the
same new keys, at Qwen3-30B-A3B's shape (32 query heads on 4 KV heads, head 128, blocks of 16 through a shuffled
table). Each backend alone (``torch.nn.attention.sdpa_kernel``), with the query heads' groups given to it
(``enable_gqa``) and with the keys repeated per query head (the repeat timed with it); the keys and queries laid
out as the engine holds them (token-major: ``[T, heads, D]`` seen through a transpose). Every output is checked
against the Triton kernel's (max |difference|); a backend that refuses the shapes says why. Then each backend's
first call at lengths it has not seen, against its second (a plan built per shape shows there).

    python3 -m experiments.attn_sdpa_probe [--tokens 1024 4096 16384] [--out FILE.json]   (one GPU, ~30 s)
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pushkv.messages import SeqWork
from pushkv.model.kernels import paged, triton_paged
from pushkv.model.step import StepTensors, plan_step
from tools.roofline import _time, matmul_rate

KVH, G, HD, U = 4, 8, 128, 16
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa(q, k, v, backend, repeat: bool):
    """q [T, Hq, D], k/v [T, Hk, D] (token-major) -> [T, Hq, D] through one backend."""
    if repeat:
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    with sdpa_kernel([backend]):
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, enable_gqa=not repeat, scale=HD ** -0.5)
    return o[0].transpose(0, 1)


def one_length(L: int, peak: float) -> list[dict]:
    nb = -(-L // U)
    table = list(range(nb))
    random.Random(0).shuffle(table)
    k = torch.randn(L, KVH, HD, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(L, KVH, HD, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(L, KVH * G, HD, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(nb, 2, KVH, U, HD, dtype=torch.bfloat16, device="cuda")
    plan = plan_step([SeqWork(0, tuple(range(L)), 0, tuple(table))], U, 256 // G)
    meta = StepTensors.upload(plan, torch.device("cuda"))
    triton_paged.store_kv(cache, k, v, meta.slots)
    flops = 2 * L * L * KVH * G * HD
    shipped = functools.partial(triton_paged.attention, q, cache, meta.block_table, meta.seq_lens, meta.q_starts,
                                meta.q_lens, meta.prefill_tiles, meta.prefill_q0, meta.block_q)
    want = shipped().float()
    rows = []
    fresh = functools.partial(paged.fresh_attention, *padded(L, q, k, v), ((0, L),), torch.empty_like(q))
    cases = [("triton (shipped)", shipped),
             (f"fresh_attention ({paged.FRESH_BACKEND}, {paged.fresh_rows(((0, L),))} rows)", fresh)] + [
        (f"{name}{' repeated' if rep else ' gqa'}", functools.partial(sdpa, q, k, v, b, rep))
        for name, b in BACKENDS.items() for rep in (False, True)]
    for name, run in cases:
        try:
            err = float((run().float() - want).abs().max())
            t = _time(run, 10 if L < 16384 else 4, warm=2)
        except Exception as e:  # a backend refusing these shapes: said, not hidden
            row = {"tokens": L, "case": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        else:
            row = {"tokens": L, "case": name, "ms": round(t * 1e3, 3), "tflops": round(flops / t / 1e12, 1),
                   "of_matmul": round(flops / t / peak, 3), "max_diff": err}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def padded(n: int, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Each [n, ...] tensor with zero rows to ``paged.fresh_rows`` of one n-token prompt, as the RoPE launch lays
    them out for ``paged.fresh_attention``."""
    R = paged.fresh_rows(((0, n),))
    return [torch.cat([x, x.new_zeros(R - n, *x.shape[1:])]) for x in xs]


def two_calls(fn) -> tuple[float, float]:
    """Wall ms of a first and a second call of ``fn``, the GPU idle before each and waited for after."""
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times[0], times[1]


def first_calls(L: int) -> list[dict]:
    """Wall ms of each backend's first call at lengths it has not seen (L + 1 .. L + 3; a backend that builds a
    plan per shape, as cuDNN's, pays it here, and a server sees a new length with most prompts), against a second
    call at the same length; then ``fresh_attention``'s, which pads those lengths to the same multiple (one plan)."""
    rows = []
    cases = [(f"{name} gqa first call", lambda n, b=b: functools.partial(sdpa, *qkk(n), b, False))
             for name, b in BACKENDS.items()]
    cases.append(("fresh_attention first call", lambda n: functools.partial(
        paged.fresh_attention, *padded(n, *qkk(n)), ((0, n),), qkk(n)[0])))
    for case, make in cases:
        for n in (L + 1, L + 2, L + 3):
            try:
                first, second = two_calls(make(n))
            except Exception as e:
                rows.append({"tokens": n, "case": case, "error": type(e).__name__})
                break
            rows.append({"tokens": n, "case": case, "first_ms": round(first, 2), "second_ms": round(second, 3)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def qkk(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random queries, and keys that serve as the values too, of an n-token prompt."""
    q = torch.randn(n, KVH * G, HD, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(n, KVH, HD, dtype=torch.bfloat16, device="cuda")
    return q, k, k


def main() -> None:
    warnings.filterwarnings("ignore", message="For dense input")  # the memory-efficient backend refusing groups
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--out")
    args = ap.parse_args()
    peak = matmul_rate(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}: "
          f"bf16 matmul {peak / 1e12:.0f} TFLOP/s", flush=True)
    rows = [r for L in args.tokens for r in one_length(L, peak)]
    rows += first_calls(4096) + first_calls(8192)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cudnn": torch.backends.cudnn.version(), "matmul_tflops": round(peak / 1e12, 1),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
