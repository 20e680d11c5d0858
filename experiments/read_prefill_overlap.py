"""Each pull READ's time against the prefills it overlapped, from link-bench run JSON files.

Where UCX stages a READ through the GPU that P and D share (its ``cuda_copy`` lane), the READ waits
while a prefill computes there: its time grows by about the overlap. For each READ: its time
(``decode.read_posted`` -> ``decode.read_done``), the time a prefill of the run computed meanwhile
(the union of every request's ``prefill.prefill_start`` -> ``prefill.prefill_end``), and the READ's
time less that overlap; then the least-squares slope of READ time over overlap per file (1: the READ
stops for the whole prefill; 0: the prefill does not slow it).

    python3 experiments/read_prefill_overlap.py RUN/RATE/pull-*_qps*.json [...]
"""
from __future__ import annotations

import json
import sys


def merged(spans):
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def reads(run: dict):
    tls = [t for t in run["timelines"] if "decode.read_posted" in t and "decode.read_done" in t]
    pf = merged([(t["prefill.prefill_start"], t["prefill.prefill_end"]) for t in run["timelines"]
                 if "prefill.prefill_start" in t and "prefill.prefill_end" in t])
    for t in sorted(tls, key=lambda t: t["decode.read_posted"]):
        a, b = t["decode.read_posted"], t["decode.read_done"]
        yield b - a, sum(max(0.0, min(b, y) - max(a, x)) for x, y in pf)


def slope(pts) -> float:
    if len({o for _, o in pts}) < 2:
        return float("nan")
    mo, mr = sum(o for _, o in pts) / len(pts), sum(r for r, _ in pts) / len(pts)
    return sum((o - mo) * (r - mr) for r, o in pts) / sum((o - mo) ** 2 for _, o in pts)


def main(paths) -> int:
    for path in paths:
        with open(path) as f:
            pts = list(reads(json.load(f)))
        if not pts:
            continue
        print(f"{path}: {len(pts)} READs, slope of READ time over prefill overlap {slope(pts):.2f}")
        for r, o in pts:
            print(f"  READ {r * 1e3:8.1f} ms  prefill meanwhile {o * 1e3:7.1f} ms  less it {(r - o) * 1e3:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
