"""Per-transfer timestamps for finding where time goes: with PUSHKV_VLLM_TIMING=1 each
process prints ``pushkv-timing <event> <transfer id> <wall time>`` to stderr (the vLLM
server's log); ``python -m pushkv.vllm.timing LOG...`` prints median offsets per event."""
from __future__ import annotations

import sys
import time

from pushkv import envs

ON = envs.get("PUSHKV_VLLM_TIMING")


def mark(event: str, transfer_id: str) -> None:
    if ON:
        print(f"pushkv-timing {event} {transfer_id} {time.time():.6f}", file=sys.stderr, flush=True)


def main(paths: list[str]) -> None:
    import statistics
    from collections import defaultdict

    per: dict[str, dict[str, float]] = defaultdict(dict)
    for p in paths:
        for line in open(p, errors="replace"):
            i = line.find("pushkv-timing ")
            if i >= 0:
                _, ev, tid, t = line[i:].split()[:4]
                per[tid].setdefault(ev, float(t))
    offs: dict[str, list[float]] = defaultdict(list)
    for evs in per.values():
        t0 = min(evs.values())
        for ev, t in evs.items():
            offs[ev].append((t - t0) * 1e3)
    for ev, xs in sorted(offs.items(), key=lambda kv: statistics.median(kv[1])):
        print(f"{ev:28s} median {statistics.median(xs):8.1f} ms  (n={len(xs)})")


if __name__ == "__main__":
    main(sys.argv[1:])
