"""Time the paged-attention kernel alone on a GPU: one prefill of L tokens (causal,
keys read through a shuffled block table) and decode batches, per kernel config."""
from __future__ import annotations

import argparse
import random
import sys

import torch

from pushkv.messages import SeqWork
from pushkv.model.kernels import triton_paged
from pushkv.model.step import StepTensors, plan_step
from tools.roofline import _time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)
    dev, L, u, G, kvh, D = torch.device("cuda"), args.tokens, args.block_size, args.group, args.kv_heads, 128
    nb = -(-L // u)
    table = list(range(nb))
    random.Random(0).shuffle(table)
    cache = torch.randn(nb, 36, 2, kvh, u, D, dtype=torch.bfloat16, device=dev)[:, 5]
    flops = 2 * L * L * kvh * G * D  # causal: half of 4 L^2 H D
    for bq in (128 // G, 64 // G, 256 // G):
        plan = plan_step([SeqWork(0, tuple(range(L)), 0, tuple(table))], u, bq)
        meta = StepTensors.upload(plan, dev)
        q = torch.randn(L, kvh * G, D, dtype=torch.bfloat16, device=dev)
        for cfg in ((64, 8, 2), (64, 4, 2), (64, 8, 3), (128, 8, 2), (128, 8, 3), (32, 4, 3), (64, 4, 3)):
            try:
                t = _time(lambda: triton_paged.attention(q, cache, meta.block_table, meta.seq_lens, meta.q_starts,
                                                         meta.q_lens, meta.prefill_tiles, meta.prefill_q0, bq,
                                                         config=cfg), 5, warm=2)
            except Exception as e:  # out of shared memory etc.
                print(f"prefill block_q {bq:>3} config {cfg}: {type(e).__name__}")
                continue
            print(f"prefill block_q {bq:>3} (rows {bq * G}) config {cfg}: {t * 1e3:7.2f} ms "
                  f"{flops / t / 1e12:6.0f} TFLOP/s", flush=True)
    for B, ctx in ((16, 8192), (64, 4096)):
        nb = -(-(ctx + 1) // u)
        cache2 = torch.randn(B * nb, 2, kvh, u, D, dtype=torch.bfloat16, device=dev)
        plan = plan_step([SeqWork(i, (1,), ctx, tuple(range(i * nb, i * nb + nb))) for i in range(B)], u, 1)
        meta = StepTensors.upload(plan, dev)
        q = torch.randn(B, kvh * G, D, dtype=torch.bfloat16, device=dev)
        nbytes = B * (ctx + 1) * kvh * D * 2 * 2
        for splits in (1, 2, 4, 8):
            for cfg in ((64, 4, 2), (32, 4, 3), (128, 4, 2), (64, 4, 3), (64, 2, 3)):
                t = _time(lambda: triton_paged.attention(q, cache2, meta.block_table, meta.seq_lens, meta.q_starts,
                                                         meta.q_lens, meta.decode_tiles, meta.decode_q0, 1, splits,
                                                         config=cfg), 10)
                print(f"decode B {B} ctx {ctx} splits {splits} config {cfg}: {t * 1e6:7.1f} us "
                      f"{nbytes / t / 1e9:6.0f} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
