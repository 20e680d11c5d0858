"""One MoE MLP layer of Qwen3-30B-A3B's shape (128 experts, 8 a token, hidden 2048, intermediate
768, bf16) on a GPU: the grouped Triton kernels (pushkv/model/kernels/triton_moe.py) against the
torch reference (pushkv/model/moe.py), side by side in one run, and each against its bounds.

- decode (1-64 tokens): bound by the bytes of the experts the batch actually chose (each read
  once), at the device's HBM rate measured here by a plain copy;
- prefill (4,096 tokens): bound by the FLOPs of the routed tokens (2 x 3 x d x i per slot), at
  the matmul rate measured here by one large torch bf16 matmul.

    python3 experiments/moe_bench.py --out DIR    (from the checkout's root)
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from pushkv.model.kernels import triton_moe
from pushkv.model.moe import moe_mlp, route

E, K, D, INTER = 128, 8, 2048, 768


def timed(fn, reps: int = 20) -> float:
    """Median ms of ``fn`` over ``reps`` runs after a warm-up, by CUDA events."""
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def device_rates() -> tuple[float, float]:
    """(HBM bytes/s by a 2 GiB device copy, bf16 FLOP/s by an 8k matmul), measured now."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), 10)
    hbm = 2 * src.numel() * 2 / (ms / 1e3)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = timed(lambda: a @ a, 10)
    return hbm, 2 * 8192 ** 3 / (ms / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,4096")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    hbm, flops = device_rates()
    router = torch.randn(E, D, dtype=torch.bfloat16, device="cuda") / D ** 0.5
    gate_up = torch.randn(E, 2 * INTER, D, dtype=torch.bfloat16, device="cuda") / D ** 0.5
    down = torch.randn(E, D, INTER, dtype=torch.bfloat16, device="cuda") / INTER ** 0.5
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * 2
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        h = torch.randn(T, D, dtype=torch.bfloat16, device="cuda")
        _, experts = route(h, router, K, True)
        chosen = int(experts.unique().numel())
        ref = moe_mlp(h, router, gate_up, down, K, True)
        got = triton_moe.moe_mlp(h, router, gate_up, down, K, True)
        err = float((ref.float() - got.float()).abs().max() / ref.float().abs().max())
        ms_k = timed(lambda h=h: triton_moe.moe_mlp(h, router, gate_up, down, K, True))
        ms_t = timed(lambda h=h: moe_mlp(h, router, gate_up, down, K, True), 5 if T > 64 else 20)
        bytes_bound_ms = chosen * expert_bytes / hbm * 1e3
        flop_bound_ms = 2 * 3 * D * INTER * T * K / flops * 1e3
        bound = max(bytes_bound_ms, flop_bound_ms)
        row = {"tokens": T, "experts_chosen": chosen, "kernel_ms": round(ms_k, 4), "torch_ms": round(ms_t, 4),
               "speedup": round(ms_t / ms_k, 2), "bound_ms": round(bound, 4),
               "bound": "bytes" if bytes_bound_ms >= flop_bound_ms else "flops",
               "x_bound": round(ms_k / bound, 2), "max_rel_err": round(err, 5)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"device": torch.cuda.get_device_name(), "hbm_GBps": round(hbm / 1e9), "bf16_TFLOPs": round(flops / 1e12),
              "shape": {"experts": E, "k": K, "hidden": D, "intermediate": INTER}, "rows": rows}
    with open(os.path.join(args.out, "moe_bench.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"device {report['device']}: copy {report['hbm_GBps']} GB/s, matmul {report['bf16_TFLOPs']} TFLOP/s")
    print("| tokens | experts read | kernel ms | torch ms | speedup | bound ms (kind) | x bound | max rel err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['tokens']} | {r['experts_chosen']} | {r['kernel_ms']} | {r['torch_ms']} | {r['speedup']}x | "
              f"{r['bound_ms']} ({r['bound']}) | {r['x_bound']} | {r['max_rel_err']} |")


if __name__ == "__main__":
    main()
