"""pushkv blocksec: push's cost in D memory, push against pull, under one load.

For each variant it starts a deployment (``pushkv up``, CPU and the small model
by default), sends the same Poisson load (``pushkv bench``'s requests), and prints
side by side, per request, the D **block-seconds** reserved before the KV arrived
(blocks x time from D's reservation until the KV was in: push holds them while P
computes, pull only while it READs), with the late allocations (push falling back
per request when D is short of blocks), the requests that waited at the router for
D room, and TTFT:

    python -m tools.blocksec                      # push, push with fallback, pull
    python -m tools.blocksec --qps 8 --input-len 2048 --json results/blocksec.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile

import numpy as np

from tools import bench
from tools.launch import launched

# label -> `pushkv up` arguments
VARIANTS: dict[str, list[str]] = {
    "push": ["--mode", "push", "--push-pin-fraction", "1"],
    "push-fallback": ["--mode", "push", "--push-pin-fraction", "0.25"],
    "pull": ["--mode", "pull", "--pull-read", "background"],
    "pull-write": ["--mode", "pull", "--pull-read", "write"],
}
DEFAULT = ("push", "push-fallback", "pull")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pushkv blocksec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(DEFAULT))
    ap.add_argument("--qps", type=float, default=6.0, help="Poisson arrival rate (a P backlog builds past ~3)")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=512, help="KV blocks per instance")
    ap.add_argument("--up-args", default="--model small", help="extra `pushkv up` arguments, one shell string")
    ap.add_argument("--json", help="also write the table here")
    return ap.parse_args(argv)


def run_variant(args, name: str) -> dict:
    flags = [*VARIANTS[name], "--num-blocks", str(args.num_blocks), *shlex.split(args.up_args)]
    log = os.path.join(tempfile.gettempdir(), f"pushkv-blocksec-{name}.log")
    prompts = bench.make_prompts(args.num_prompts, args.input_len, bench.DEFAULT_VOCAB, args.seed)
    warmup = bench.make_prompts(2, args.input_len, bench.DEFAULT_VOCAB, args.seed + 1000)
    gaps = bench.arrival_gaps(args.num_prompts, args.qps, args.seed)
    with launched(*flags, log_path=log) as dep:
        results, duration = asyncio.run(bench.run_load(dep.url, prompts, gaps, args.output_len, warmup,
                                                       progress=False))
    ok = [r for r in results if r.success]
    bs = np.asarray([r.reserved_block_s for r in ok if r.reserved_block_s is not None], dtype=float)
    ttft = np.asarray([r.ttft for r in ok], dtype=float) * 1e3
    return {
        "variant": name, "flags": flags, "completed": len(ok), "failed": len(results) - len(ok),
        "late": sum(1 for r in ok if r.allocation == "late"),
        "queued": sum(1 for r in ok if "router.queued" in r.timeline),  # waited at the router for D room
        "mean_block_s": float(bs.mean()) if bs.size else 0.0,
        "median_block_s": float(np.median(bs)) if bs.size else 0.0,
        "p99_block_s": float(np.percentile(bs, 99)) if bs.size else 0.0,
        "total_block_s": float(bs.sum()),
        "median_ttft_ms": float(np.median(ttft)) if ttft.size else 0.0,
        "duration_s": duration,
    }


def table(rows: list[dict], args) -> str:
    head = (f"load: {args.num_prompts} requests at {args.qps:g} QPS, input {args.input_len}, output "
            f"{args.output_len}, {args.num_blocks} blocks per instance\n"
            f"{'variant':<15} {'ok':>4} {'fail':>4} {'late':>4} {'queued':>6} {'blk-s mean':>10} {'median':>8} "
            f"{'p99':>8} "
            f"{'total':>9} {'TTFT med ms':>11}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['variant']:<15} {r['completed']:>4} {r['failed']:>4} {r['late']:>4} {r['queued']:>6} "
                     f"{r['mean_block_s']:>10.3f} {r['median_block_s']:>8.3f} {r['p99_block_s']:>8.3f} "
                     f"{r['total_block_s']:>9.2f} {r['median_ttft_ms']:>11.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    for name in args.variants:
        print(f"{name}: running ...", file=sys.stderr, flush=True)
        rows.append(run_variant(args, name))
    print(table(rows, args))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0 if all(r["completed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
