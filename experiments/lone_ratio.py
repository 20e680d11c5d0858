"""Lone push-layer TTFT against max(prefill, transfer), from link-bench JSON files (issue 27's lone goal).

The transfer is the span the link was busy with the request: from its first part's post to the KV
landed on D (prefill start + prefill + prefill end -> KV landed), i.e. the whole KV at the rate the link
moved it in that run (a capped TCP path runs below its cap, and at a rate that differs between sittings,
so the nominal rate is not the bound). Every figure is a lone median of the run.

    python3 experiments/lone_ratio.py RUN/link_bench.json [...]
"""
from __future__ import annotations

import json
import sys


def rows(path: str):
    d = json.load(open(path))
    for rate, modes in d["regimes"].items():
        for mode, lens in modes.items():
            for n, r in sorted(lens.items(), key=lambda kv: int(kv[0])):
                lo = r.get("lone") or {}
                if lo.get("prefill_ms") is None or lo.get("chunk1_ms") is None:
                    continue
                first_post = lo["chunk1_ms"] + lo["part_lag_ms"]
                landed = lo["prefill_ms"] + lo["pend_to_kv_ms"]
                busy = landed - first_post
                nbytes = (lo.get("part_bytes") or 0) + lo["kv_bytes"]
                yield dict(rate=rate, mode=mode, tokens=int(n), ttft=lo["ttft_ms"], prefill=lo["prefill_ms"],
                           first_post=first_post, landed=landed, busy=busy, gbit_s=nbytes * 8 / busy / 1e6,
                           ratio=lo["ttft_ms"] / max(lo["prefill_ms"], busy))


def main(argv=None) -> None:
    print("| file | link | tokens | TTFT | prefill | first part posted | KV landed | link busy (rate) | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in argv or sys.argv[1:]:
        for r in rows(path):
            print(f"| {path} | {r['rate']} | {r['tokens']} | {r['ttft']:.1f} | {r['prefill']:.1f} | "
                  f"{r['first_post']:.1f} | {r['landed']:.1f} | {r['busy']:.1f} ({r['gbit_s']:.2f} Gbit/s) | "
                  f"**{r['ratio']:.3f}** |")


if __name__ == "__main__":
    main()
