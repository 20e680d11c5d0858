"""MLA's decode attention for a step's decode rows, side by side: the torch ops the batched engine runs
(``paged.mla_decode_ref``: every row's latent rows gathered, padded to the table's width) against the Triton kernel
that reads them in place (``triton_mla.mla_decode``, its keys split over 1, 4 or 8 programs a row), on one layer of
DeepSeek-V2-Lite's shape (16 heads, a latent of 512 + 64 RoPE dims) in bf16, at several batches and contexts.

    python3 -m experiments.mla_kernel_bench [--batches 1 8 32] [--contexts 512 4096 16384] [--out FILE]

prints each case's milliseconds, the kernel's speed-up, its read rate (the latent rows it reads, over its time)
and the largest difference from the torch output; --plot FILE.json draws the speed-ups (PNG beside --out).
"""
from __future__ import annotations

import argparse
import json
import random

import torch

from experiments.mla_decode_bench import timed
from pushkv.model.kernels import paged

RANK, ROPE, HEADS, U = 512, 64, 16, 16


def case(batch: int, ctx: int, dev: torch.device, reps: int, splits: tuple[int, ...]) -> dict:
    from pushkv.model.kernels import triton_mla

    width = -(-ctx // U)
    blocks = batch * width
    cache = (torch.randn(blocks, 1, 1, U, RANK + ROPE, device=dev) / 4).to(torch.bfloat16)
    order = list(range(blocks))
    random.Random(batch * 7919 + ctx).shuffle(order)
    table = torch.tensor([order[i * width:(i + 1) * width] for i in range(batch)], dtype=torch.int32, device=dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    tiles = torch.arange(batch, dtype=torch.int32, device=dev)
    q = (torch.randn(batch, HEADS, RANK + ROPE, device=dev) / 4).to(torch.bfloat16)
    scale = (128 + ROPE) ** -0.5
    want = paged.mla_decode_ref(q, cache, table, lens, tiles, RANK, scale)
    row = {"batch": batch, "context": ctx, "torch_ms": timed(lambda: paged.mla_decode_ref(
        q, cache, table, lens, tiles, RANK, scale), reps, True)}
    nbytes = batch * ctx * (RANK + ROPE) * 2
    for s in splits:
        part = triton_mla.scratch(s, batch, HEADS, RANK, dev)
        got = triton_mla.mla_decode(q, cache, table, lens, tiles, RANK, scale, s, part)
        ms = timed(lambda s=s, part=part: triton_mla.mla_decode(q, cache, table, lens, tiles, RANK, scale, s, part),
                   reps, True)
        row[f"kernel{s}_ms"] = ms
        row[f"kernel{s}_gbps"] = nbytes / ms / 1e6
        row[f"kernel{s}_max_diff"] = float((got.float() - want.float()).abs().max())
    best = min(splits, key=lambda s: row[f"kernel{s}_ms"])
    row["best_splits"], row["speedup"] = best, row["torch_ms"] / row[f"kernel{best}_ms"]
    return row


def plot(path: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        rows = json.load(f)["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for b in sorted({r["batch"] for r in rows}):
        mine = [r for r in rows if r["batch"] == b]
        ax.plot([r["context"] for r in mine], [r["speedup"] for r in mine], marker="o", label=f"batch {b}")
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("torch ms / kernel ms")
    ax.set_title("MLA decode attention, DeepSeek-V2-Lite layer, bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 16384])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--plot", default="", help="a JSON this wrote: draw it (PNG at --out)")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot, args.out or "mla_kernel.png")
        return
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(dev), "rows": []}
    for b in args.batches:
        for ctx in args.contexts:
            r = case(b, ctx, dev, args.reps, tuple(args.splits))
            out["rows"].append(r)
            ks = ", ".join(f"{s} splits {r[f'kernel{s}_ms']:.3f} ms ({r[f'kernel{s}_gbps']:.0f} GB/s)"
                           for s in args.splits)
            print(f"batch {b:3d} context {ctx:6d}: torch {r['torch_ms']:.3f} ms; kernel {ks}; best {r['speedup']:.1f}x;"
                  f" max diff {max(r[f'kernel{s}_max_diff'] for s in args.splits):.2e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
