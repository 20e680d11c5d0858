"""One MLA decode row's attention, side by side: every cached latent row expanded into each head's keys and values
(``MLAModel._expand``, then SDPA: what the per-sequence engine does for every row) against the batched engine's
absorbed form (``mla.absorbed_attention``: the query into the latent's space, the rows as they are), on one
layer of DeepSeek-V2-Lite's shape (16 heads of 128 + 64 RoPE dims, a latent of 512) at several contexts.

    python3 -m experiments.mla_decode_bench [--device cuda] [--contexts 512 4096 16384] [--out FILE]

prints each context's milliseconds and the ratio, and the largest difference between the two outputs.
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from pushkv.config import ModelConfig
from pushkv.model.mla import MLAModel, absorbed_attention

V2_LITE = ModelConfig(name="deepseek-v2-lite-layer", num_heads=16, num_kv_heads=1, head_dim=128, kv_lora_rank=512,
                      qk_rope_dim=64, qk_norm=False)


def timed(fn, reps: int, cuda: bool) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 16384])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cfg, dev = V2_LITE, torch.device(args.device)
    qh, hd, rd, r = cfg.num_heads, cfg.head_dim, cfg.qk_rope_dim, cfg.kv_lora_rank
    g = torch.Generator(device="cpu").manual_seed(0)
    lw = SimpleNamespace(k_up=(torch.randn(qh * hd, r, generator=g) / r ** 0.5).to(dev),
                         v_up=(torch.randn(qh * hd, r, generator=g) / r ** 0.5).to(dev))
    model = SimpleNamespace(cfg=cfg, plan=SimpleNamespace(q_heads=qh), attn_scale=None)
    q = torch.randn(qh, hd + rd, generator=g).to(dev)
    rows_all = torch.randn(max(args.contexts), r + rd, generator=g).to(dev)
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "threads": torch.get_num_threads(), "rows": []}
    for ctx in args.contexts:
        rows = rows_all[:ctx]

        def expanded(rows=rows):
            keys, vals = MLAModel._expand(model, lw, rows)
            return F.scaled_dot_product_attention(q[None, :, None], keys[None], vals[None])[0, :, 0].reshape(-1)

        def absorbed(rows=rows):
            return absorbed_attention(lw, q, rows, cfg, qh)

        e, a = timed(expanded, args.reps, dev.type == "cuda"), timed(absorbed, args.reps, dev.type == "cuda")
        diff = float((expanded() - absorbed()).abs().max())
        out["rows"].append({"context": ctx, "expanded_ms": round(e, 3), "absorbed_ms": round(a, 3),
                            "ratio": round(e / a, 1), "max_abs_diff": diff})
        print(f"context {ctx:6d}: expanded {e:9.3f} ms, absorbed {a:8.3f} ms, {e / a:6.1f}x; max diff {diff:.2e}",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
