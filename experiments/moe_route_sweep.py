"""The MoE routing kernel's launch (``triton_moe.RouteLaunch``: tokens a pass, slots a pass, warps) at
decode batches, Qwen3-30B-A3B's router (128 experts, 8 a token, hidden 2048, bf16), on a GPU.

Each launch routes LAYERS layers' logits in one CUDA graph (as the decode step replays it), so the
figure is the kernel and its place in a graph, not a launch from Python; the router's matmul is not
in it (the logits are made once). Every launch's experts, weights and slot table equal the default
launch's (checked per launch).

    python3 experiments/moe_route_sweep.py --out DIR   (from the checkout's root; writes DIR/route_sweep.json)
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from moe_bench import graphed, timed  # noqa: E402  (run as experiments/moe_route_sweep.py: its folder is on the path)

from pushkv.model.kernels import triton_moe
from pushkv.model.kernels.triton_moe import RouteLaunch, route_launch_for

E, K, D = 128, 8, 2048
LAYERS = 48
BM = 16


def _route(logits: torch.Tensor, launch: RouteLaunch):
    """``route_group``'s kernel on ready logits (its router matmul left out)."""
    return triton_moe.group_logits(logits, K, True, BM, launch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--tokens", default="1,2,8,32,64")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        logits = [torch.randn(T, E, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        base = route_launch_for(T, E)
        want = [_route(x, base) for x in logits[:2]]
        launches = sorted({base, *(RouteLaunch(tt, sc, w) for tt in (1, 4, 16) if tt <= max(1, T) * 2
                                   for sc in (16, 64) for w in (1, 2, 4, 8))})
        for launch in launches:
            got = [_route(x, launch) for x in logits[:2]]
            same = all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
            ms = timed(graphed(lambda launch=launch, logits=logits: [_route(x, launch) for x in logits]).replay, 30)
            row = {"tokens": T, "tt": launch.tt, "sc": launch.sc, "warps": launch.warps,
                   "us_per_layer": round(ms * 1e3 / LAYERS, 2), "same": same, "default": launch == base}
            rows.append(row)
            print(json.dumps(row), flush=True)
        best = min((r for r in rows if r["tokens"] == T and r["same"]), key=lambda r: r["us_per_layer"])
        dflt = next(r for r in rows if r["tokens"] == T and r["default"])
        print(f"T={T}: default {dflt['us_per_layer']} us, best {best['us_per_layer']} us "
              f"(tt {best['tt']}, sc {best['sc']}, warps {best['warps']})", flush=True)
    with open(os.path.join(args.out, "route_sweep.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
