"""One MoE MLP layer of a prefill (Qwen3-30B-A3B's shape) by torch's grouped GEMM against pushkv's Triton kernels.

The Triton grouped kernels (``pushkv/model/kernels/triton_moe.py``) run a 4k-token prefill's MoE layer at about
0.98 ms on an H200, 42 % of the matmul rate. ``torch._grouped_mm`` (one grouped GEMM per projection over tokens
sorted by expert, CUTLASS on SM90) is a candidate for long prefills. This times, in one run and on the same
routing: the Triton layer (``triton_moe.moe_mlp``, routing included), and the grouped-GEMM layer (routing,
a sort by expert, a gather, gate/up, SiLU and product, down, the weighted scatter-add), each against the
layer's FLOPs at the rate one 8k bf16 matmul reaches in the same run, and checks both equal the torch
reference's output within bf16's error.

    python3 experiments/moe_grouped_mm_probe.py --out DIR [--tokens 1024,4096,16384]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from pushkv.model.kernels import triton_moe
from pushkv.model.moe import route
from tools.roofline import _time, matmul_rate

E, K, D, INTER = 128, 8, 2048, 768


def timed(fn, reps=20) -> float:
    """Milliseconds a call (tools.roofline's timer)."""
    return _time(fn, reps) * 1e3


def grouped_layer(h, router, gate_up_t, down_t, k, renorm):
    """gate_up_t [E, d, 2i] and down_t [E, i, d] (B of each grouped GEMM, K-major views)."""
    w, experts = route(h, router, k, renorm)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    tok = order // k
    a = h.index_select(0, tok)
    gu = torch._grouped_mm(a, gate_up_t, offs=offs)
    inter = gu.shape[1] // 2
    act = F.silu(gu[:, :inter]) * gu[:, inter:]
    y = torch._grouped_mm(act, down_t, offs=offs)
    y = y * w.flatten().index_select(0, order).to(y.dtype)[:, None]
    out = torch.zeros_like(h)
    out.index_add_(0, tok, y)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--tokens", default="1024,4096,16384")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    peak = matmul_rate(dev)
    router = torch.randn(E, D, device=dev, dtype=dt) * D ** -0.5
    gate_up = torch.randn(E, 2 * INTER, D, device=dev, dtype=dt) * D ** -0.5
    down = torch.randn(E, D, INTER, device=dev, dtype=dt) * INTER ** -0.5
    variants = {"transposed views": (gate_up.transpose(1, 2), down.transpose(1, 2)),
                "contiguous [E, K, N]": (gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous())}
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        h = torch.randn(T, D, device=dev, dtype=dt)
        flops = 2 * T * K * (D * 2 * INTER + INTER * D)
        ref = triton_moe.moe_mlp(h, router, gate_up, down, K, True)
        row = {"tokens": T, "bound_ms": round(flops / peak * 1e3, 4),
               "triton_ms": round(timed(lambda h=h: triton_moe.moe_mlp(h, router, gate_up, down, K, True)), 4)}
        for name, (gu_t, dn_t) in variants.items():
            try:
                got = grouped_layer(h, router, gu_t, dn_t, K, True)
                err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
                ms = timed(lambda h=h, g=gu_t, dn=dn_t: grouped_layer(h, router, g, dn, K, True))
                row[name] = {"ms": round(ms, 4),
                             "max_rel_err_vs_triton": round(err, 5)}
            except Exception as e:  # an unsupported layout says so
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "matmul_8k_TFLOPs": round(peak / 1e12), "rows": rows}
    with open(os.path.join(args.out, "moe_grouped_mm.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
