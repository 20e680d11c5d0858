"""The fused attention's plans at start-up, on a GPU (``BatchedForward.warm_fresh``): cuDNN builds one plan per
prompt length it meets, and pushkv pads a prompt's rows so that lengths share plans. This probe, at
Qwen3-30B-A3B's attention shape (32 query heads on 4 KV heads, head 128, bf16):

1. makes the plan of every padded length from ``batched.SDPA_PROMPT_TOKENS`` up to ``--max-tokens`` under a
   padding rule, timing the whole and printing progress (run each rule in its own process: every geometric
   length is a multiple of 128, so after ``fixed`` its plans are all made);
2. calls again at lengths spread over that range: a call that builds its plan again (tens of ms, not a few)
   shows that torch's plan cache did not keep it;
3. times the attention at prompt lengths padded each way (``--pads``), so that what a coarser padding costs in
   rows is seen beside the plans it saves.

    python3 -m experiments.fresh_plans_probe [--max-tokens 65536] [--pads fixed geometric] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import torch

from pushkv.model import batched
from pushkv.model.kernels import paged
from tools.roofline import _time

QH, KVH, HD = 32, 4, 128


def fixed(n: int) -> int:
    """The padding before ``paged.fresh_padded``: a multiple of 128 rows."""
    return -(-n // 128) * 128


PADS = {"fixed": fixed, "geometric": paged.fresh_padded}  # geometric: the shipped padding


def call(rows: int) -> float:
    """One fused attention over ``rows`` fresh rows; ms, synchronised."""
    q = torch.zeros(rows, QH, HD, device="cuda", dtype=torch.bfloat16)
    kv = torch.zeros(rows, KVH, HD, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    paged.fresh_attention(q, kv, kv, ((0, rows),), q)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=65536)
    ap.add_argument("--pads", nargs="+", choices=sorted(PADS), default=["fixed", "geometric"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lo, out = batched.SDPA_PROMPT_TOKENS, {"device": torch.cuda.get_device_name(), "max_tokens": a.max_tokens}
    for name in a.pads:
        pad = PADS[name]
        lengths = sorted({pad(n) for n in range(lo, a.max_tokens + 1)})
        t0, first = time.perf_counter(), []
        for i, rows in enumerate(lengths):
            first.append(call(rows))
            if i % 50 == 49 or i == len(lengths) - 1:
                print(f"  {name}: {i + 1}/{len(lengths)} plans, {time.perf_counter() - t0:.1f} s", flush=True)
        total = time.perf_counter() - t0
        again = {rows: round(call(rows), 3) for rows in lengths[:: max(1, len(lengths) // 8)] + [lengths[-1]]}
        print(f"{name}: {len(lengths)} plans up to {a.max_tokens} in {total:.1f} s "
              f"(first calls median {sorted(first)[len(first) // 2]:.1f} ms); again (ms): {again}", flush=True)
        out[name] = {"plans": len(lengths), "seconds": round(total, 2), "again_ms": again,
                     "mem_gib": round(torch.cuda.memory_reserved() / 2 ** 30, 2)}
    timed = {}
    for n in (2100, 4200, 6100, 9000, 12500, 17000, 25000, 33000, 47000, 60000):
        if n > a.max_tokens:
            continue
        row = {}
        for name in a.pads:
            rows = PADS[name](n)
            q = torch.randn(rows, QH, HD, device="cuda", dtype=torch.bfloat16)
            kv = torch.randn(rows, KVH, HD, device="cuda", dtype=torch.bfloat16)
            ms = _time(functools.partial(paged.fresh_attention, q, kv, kv, ((0, n),), q), 10) * 1e3
            row[name] = {"rows": rows, "ms": round(ms, 3)}
        timed[n] = row
        print(f"  {n} tokens: " + ", ".join(f"{k} {v['rows']} rows {v['ms']} ms" for k, v in row.items()), flush=True)
    out["timed"] = timed
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
