"""Per-run figures of the slow-link results (docs/results/2026-12-02-slow-link): from a tools.sweep
result JSON, TTFT/TPOT, D's registration latency at P (decode.registration_sent to
prefill.registration_received, both writers' wall clocks on one host), and P's WRITE rate per
transfer (write_post_start to write_done) and in all.

    python experiments/slow_link_summary.py out/tcp_load_1k_window_1/*.json
"""
from __future__ import annotations

import json
import sys


def q(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def summary(path: str) -> str:
    d = json.load(open(path))
    tl = d["timelines"]
    ttft = sorted(x * 1e3 for x in d["ttfts"])
    reg = sorted((t["prefill.registration_received"] - t["decode.registration_sent"]) * 1e3
                 for t in tl if "prefill.registration_received" in t and "decode.registration_sent" in t)
    writes = [(t["prefill.write_post_start"], t["prefill.write_done"], k["prefill"]["bytes"])
              for t, k in zip(tl, d["kv"]) if "prefill.write_done" in t and "prefill.write_post_start" in t]
    out = [f"{d['mode']:<12} TTFT p50 {d['median_ttft_ms']:7.0f} p90 {q(ttft, .9):7.0f} ms  TPOT p50 "
           f"{d['median_tpot_ms']:5.1f} ms  failed {d['failed']}/{d['completed'] + d['failed']}"]
    if reg:
        out.append(f"{'':12} registration at P: p50 {q(reg, .5):6.1f} p99 {q(reg, .99):6.1f} ms")
    if writes:
        rates = sorted(b / (e - s) / 1e9 for s, e, b in writes if e > s)
        span = max(e for _, e, _ in writes) - min(s for s, _, _ in writes)
        total = sum(b for *_, b in writes) / 1e9
        out.append(f"{'':12} WRITE rate per transfer p50 {q(rates, .5):.2f} max {rates[-1]:.2f} GB/s; "
                   f"{total:.2f} GB in {span:.1f} s = {total / span:.2f} GB/s")
    return "\n".join(out)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(p.split("/")[-2], summary(p), sep="\n")
