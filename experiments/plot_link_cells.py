"""TTFT p50 of every mode at one rate and one prompt length, lone and at load, from one or more
``pushkv link-bench --out`` folders (their ``link_bench.json``): the modes of several runs side by
side, on a log scale (pull at load is an order of magnitude above push).

    python experiments/plot_link_cells.py --rate 25gbit --tokens 16384 --out ttft.png DIR [DIR ...]
"""
from __future__ import annotations

import argparse
import json
import os


def cells(dirs: list[str], rate: str, tokens: int) -> dict[str, dict]:
    """mode -> its cell ({"lone": {...}, "load": {...}}) at ``rate`` and ``tokens``, first folder first."""
    out: dict[str, dict] = {}
    for d in dirs:
        with open(os.path.join(d, "link_bench.json")) as f:
            regime = json.load(f)["regimes"].get(rate, {})
        for mode, by_len in regime.items():
            if str(tokens) in by_len:
                out.setdefault(mode, by_len[str(tokens)])
    if not out:
        raise SystemExit(f"no cell at {rate} and {tokens} tokens in {', '.join(dirs)}")
    return out


def plot(found: dict[str, dict], rate: str, tokens: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(found)
    fig, ax = plt.subplots(figsize=(1.6 * len(modes) + 2, 4))
    width = 0.38
    for k, (kind, color) in enumerate((("lone", "#9ecae1"), ("load", "#3182bd"))):
        xs = [i + (k - 0.5) * width for i in range(len(modes))]
        ys = [(found[m].get(kind) or {}).get("ttft_ms") or 0.0 for m in modes]
        bars = ax.bar(xs, ys, width, color=color, label=kind)
        for b, y in zip(bars, ys):
            if y:
                ax.annotate(f"{y:,.0f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
    qps = next((c["load"].get("qps") for c in found.values() if c.get("load")), None)
    ax.set_xticks(range(len(modes)), modes)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT p50 (ms, log)")
    ax.set_title(f"{tokens} tokens over {rate}" + (f", load {qps:g} QPS" if qps else ""))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--rate", required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    plot(cells(args.dirs, args.rate, args.tokens), args.rate, args.tokens, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
