"""``python -m tools.vllm_timing LOG...``: where the pushkv connector's time goes, from the stamps
its processes print with PUSHKV_VLLM_TIMING=1 (``pushkv.trace.stamp``): the median offset of each
event after each transfer's first one."""
from __future__ import annotations

import statistics
import sys
from collections import defaultdict

from pushkv.trace import STAMP_PREFIX


def offsets_ms(lines) -> dict[str, list[float]]:
    """event -> its offsets (ms) after the first event of the same transfer, one per transfer."""
    per: dict[str, dict[str, float]] = defaultdict(dict)
    for line in lines:
        i = line.find(STAMP_PREFIX)
        if i >= 0:
            _, ev, tid, t = line[i:].split()[:4]
            per[tid].setdefault(ev, float(t))
    offs: dict[str, list[float]] = defaultdict(list)
    for evs in per.values():
        t0 = min(evs.values())
        for ev, t in evs.items():
            offs[ev].append((t - t0) * 1e3)
    return offs


def main(paths: list[str]) -> None:
    lines = []
    for p in paths:
        with open(p, errors="replace") as f:
            lines.extend(f)
    offs = offsets_ms(lines)
    for ev, xs in sorted(offs.items(), key=lambda kv: statistics.median(kv[1])):
        print(f"{ev:28s} median {statistics.median(xs):8.1f} ms  (n={len(xs)})")


if __name__ == "__main__":
    main(sys.argv[1:])
