"""TTFT against prompt length, one line per mode, one plot per regime, from the tables that
tools/stream_bench.py prints (``mode tokens TTFT ms prefill tail ...``).

    python experiments/plot_regimes.py docs/results/stream_regimes/device_lone.txt "device path" out.png
"""
from __future__ import annotations

import sys
from collections import defaultdict


def read_table(path: str) -> dict[str, list[tuple[int, float, float]]]:
    """mode -> [(tokens, TTFT ms, tail ms)] from the summary table after its header line."""
    rows: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    seen_header = False
    for line in open(path):
        cols = line.split()
        if cols[:3] == ["mode", "tokens", "TTFT"]:
            seen_header = True
            continue
        if seen_header and len(cols) >= 5 and cols[1].isdigit():
            rows[cols[0]].append((int(cols[1]), float(cols[2]), float(cols[4])))
    if not rows:
        raise SystemExit(f"{path}: no summary table")
    return rows


def plot(rows, title: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (mode, pts) in enumerate(sorted(rows.items())):
        color = f"C{i}"  # the same mode the same color in both panels
        pts.sort()
        xs = [p[0] for p in pts]
        ax.plot(xs, [p[1] for p in pts], marker="o", label=mode, color=color)
        tails = [(x, p[2]) for x, p in zip(xs, pts) if p[2] == p[2]]  # NaN: no transfer (local)
        if tails:
            ax2.plot([t[0] for t in tails], [t[1] for t in tails], marker="o", label=mode, color=color)
    for a, what in ((ax, "TTFT (ms)"), (ax2, "prefill end -> KV at D (ms)")):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("prompt tokens")
        a.set_ylabel(what)
        a.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    plot(read_table(sys.argv[1]), sys.argv[2], sys.argv[3])
