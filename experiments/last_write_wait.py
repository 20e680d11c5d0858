"""Per loaded link-bench run: TTFT (p50, mean, p99), TPOT p50, prefill end -> KV landed p50, and how
long each request's last WRITE waited in P's link queue (``write_queued`` -> ``write_posted``), from
the runs' timelines. One row per run folder (``OUT/<rate>/<mode>_qps*.json``, lone runs left out).

    python3 experiments/last_write_wait.py docs/results/2026-12-03-link-probe-cpu/last_write_first/*
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def _ms(tl: dict, a: str, b: str):
    return (tl[b] - tl[a]) * 1e3 if a in tl and b in tl else None


def row(path: str) -> str:
    with open(path) as f:
        r = json.load(f)
    tls = r["timelines"]
    waits = [w for tl in tls if (w := _ms(tl, "prefill.write_queued", "prefill.write_posted")) is not None]
    tails = [t for tl in tls if (t := _ms(tl, "prefill.prefill_end", "decode.kv_received")) is not None]
    med = lambda xs: f"{statistics.median(xs):.1f}" if xs else "-"  # noqa: E731
    return (f"| {r['median_ttft_ms']:.1f} | {r['mean_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | "
            f"{r['median_tpot_ms']:.1f} | {med(tails)} | {med(waits)} | {max(waits) if waits else 0:.1f} | "
            f"{r['completed']} | {r['failed']} |")


def main(argv: list[str]) -> int:
    print("| run | mode | TTFT p50 | mean | p99 | TPOT p50 | prefill end → KV landed p50 "
          "| last WRITE queued p50 | max | completed | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for folder in argv:
        for path in sorted(glob.glob(os.path.join(folder, "*", "*_qps*.json"))):
            if "_qps0_" in os.path.basename(path):
                continue
            mode = os.path.basename(path).split("_qps")[0]
            print(f"| {os.path.basename(folder.rstrip('/'))} | {mode} {row(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
