"""pushkv plot: TTFT and TPOT (median) vs input length from a result dir.

One column per QPS, one line per mode; rows TTFT and TPOT. Also prints a
table of TTFT(pull)/TTFT(push) and TPOT(pull)/TPOT(push) for every cell and
every pull variant.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict
from typing import Callable, Optional

import numpy as np

from tools.bench import fmt_qps, parse_result_name

METRICS = (("median_ttft_ms", "TTFT median (ms)"), ("median_tpot_ms", "TPOT median (ms)"))
BASELINE = "push"


def load(result_dir: str) -> dict[tuple[str, float, int], dict[str, float]]:
    """(mode, qps, input_len) -> metric -> median over iterations."""
    acc: dict[tuple[str, float, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(glob.glob(os.path.join(result_dir, "*.json"))):
        key = parse_result_name(path)
        if key is None:
            continue
        with open(path) as f:
            data = json.load(f)
        cell = acc[(key["mode"], key["qps"], key["input_len"])]
        for metric, _ in METRICS:
            if data.get("completed", 0) and metric in data:
                cell[metric].append(float(data[metric]))
    return {k: {m: float(np.median(v)) for m, v in cells.items() if v} for k, cells in acc.items()}


def ratio_rows(cells: dict, baseline: str = BASELINE) -> list[dict]:
    rows = []
    for (mode, qps, inp), vals in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        if mode == baseline:
            continue
        base = cells.get((baseline, qps, inp))
        if not base:
            continue
        row = {"mode": mode, "qps": qps, "input_len": inp}
        for metric, _ in METRICS:
            b, v = base.get(metric), vals.get(metric)
            row[metric.split("_")[1] + "_ratio"] = (v / b) if b and v is not None else None
        rows.append(row)
    return rows


def format_table(rows: list[dict], baseline: str = BASELINE) -> str:
    head = f"{'mode':<18} {'qps':>5} {'input':>6} {'TTFT/' + baseline:>12} {'TPOT/' + baseline:>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        t = "-" if r["ttft_ratio"] is None else f"{r['ttft_ratio']:.3f}"
        p = "-" if r["tpot_ratio"] is None else f"{r['tpot_ratio']:.3f}"
        lines.append(f"{r['mode']:<18} {fmt_qps(r['qps']):>5} {r['input_len']:>6} {t:>12} {p:>12}")
    return "\n".join(lines)


def plot(cells: dict, out_path: str, title: str = "", column: Optional[Callable[[float], str]] = None) -> None:
    """``column(qps)`` names a panel (default ``QPS q``); ``title`` heads the figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    qps_values = sorted({k[1] for k in cells})
    modes = sorted({k[0] for k in cells}, key=lambda m: (m != BASELINE, m))
    fig, axes = plt.subplots(len(METRICS), len(qps_values), squeeze=False,
                             figsize=(4.2 * len(qps_values), 3.4 * len(METRICS)))
    for col, qps in enumerate(qps_values):
        for row, (metric, label) in enumerate(METRICS):
            ax = axes[row][col]
            for mode in modes:
                pts = sorted((k[2], v[metric]) for k, v in cells.items()
                             if k[0] == mode and k[1] == qps and metric in v)
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, marker="o", label=mode)
            ax.set_xscale("log", base=2)
            if "ttft" in metric:  # modes can differ by orders of magnitude
                ax.set_yscale("log")
            ax.set_xlabel("input length (tokens)")
            ax.set_ylabel(label)
            ax.set_title(column(qps) if column else f"QPS {fmt_qps(qps)}")
            ax.grid(True, alpha=0.3)
            if row == 0 and col == 0:
                ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pushkv plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("result_dir", nargs="?", default="results")
    ap.add_argument("--out", help="PNG path (default: <result_dir>/ttft_tpot.png)")
    ap.add_argument("--baseline", default=BASELINE, help="mode the ratios divide by")
    args = ap.parse_args(argv)
    cells = load(args.result_dir)
    if not cells:
        print(f"no result files in {args.result_dir}", file=sys.stderr)
        return 1
    out = args.out or os.path.join(args.result_dir, "ttft_tpot.png")
    plot(cells, out)
    print(f"wrote {out}")
    modes = sorted({k[0] for k in cells})
    if args.baseline not in modes:  # an empty table said nothing of why
        print(f"no ratios: no '{args.baseline}' runs in {args.result_dir} to divide by; --baseline one of "
              f"{', '.join(modes)}", file=sys.stderr)
        return 0
    print(format_table(ratio_rows(cells, args.baseline), args.baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
