"""One row's projection on a GPU: ``triton_gemv.gemv`` at a sweep of tiles against ``F.linear`` (cuBLAS),
at Qwen3-30B-A3B's attention projections (qkv 5120 x 2048, o 2048 x 4096), bf16.

Each figure is LAYERS projections, each with its own weight (none still in L2), in one CUDA graph, per
projection; the bound is the weight's bytes at the rate a plain device copy reaches in the same run. Each
tile's output is checked against F.linear's (bf16: within 2 % of the output's scale).

    python3 experiments/gemv_sweep.py --out DIR   (from the checkout's root; writes DIR/gemv_sweep.json)
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from moe_bench import device_rates, graphed, timed

from pushkv.model.kernels.triton_gemv import DEFAULT_TILE, GemvTile, gemv

LAYERS = 48
SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096)}
TILES = sorted({DEFAULT_TILE, GemvTile(16, 1024, 8, 3), GemvTile(32, 1024, 8, 3),
                *(GemvTile(bn, bk, 4, st) for bn in (8, 16, 32) for bk in (256, 512, 1024) for st in (2, 3))})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    hbm, _ = device_rates()
    rows = []
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(LAYERS)]
        bound_us = n * k * 2 / hbm * 1e6
        want = F.linear(x, ws[0])
        base = timed(graphed(lambda x=x, ws=ws: [F.linear(x, w) for w in ws]).replay, 30) * 1e3 / LAYERS
        rows.append({"shape": name, "tile": "cuBLAS", "us": round(base, 2), "x_bound": round(base / bound_us, 2)})
        print(json.dumps(rows[-1]), flush=True)
        for t in TILES:
            err = ((gemv(x, ws[0], None, t).float() - want.float()).abs().max() / want.float().abs().max()).item()
            us = timed(graphed(lambda t=t, x=x, ws=ws: [gemv(x, w, None, t) for w in ws]).replay, 30) * 1e3 / LAYERS
            rows.append({"shape": name, "tile": list(t), "us": round(us, 2), "x_bound": round(us / bound_us, 2),
                         "rel_err": round(err, 5), "default": t == DEFAULT_TILE})
            print(json.dumps(rows[-1]), flush=True)
        ok = [r for r in rows if r["shape"] == name and r["tile"] != "cuBLAS" and r["rel_err"] <= 0.02]
        best = min(ok, key=lambda r: r["us"])
        dflt = next(r for r in ok if r["default"])
        print(f"{name}: cuBLAS {base:.2f} us, default {dflt['us']} us, best {best['us']} us {best['tile']}, "
              f"bound {bound_us:.2f} us", flush=True)
    with open(os.path.join(args.out, "gemv_sweep.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "hbm_GBps": round(hbm / 1e9), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
