"""The MoE prefill's down launch order, A/B in one process: ``qwen3-30b-a3b``'s whole prefill of one sequence (as
``pushkv roofline`` times it) with ``triton_moe.DOWN_COLS_FIRST_SLOTS`` at 0 (row blocks first), 1 (column tiles
first at every launch), the shipped bound, and 0 again, in rounds, so a drift of the GPU's clocks shows as a
difference between the two 0 columns rather than as a gain.

    python3 -m experiments.down_order_ab [--tokens 1024 4096 16384] [--rounds 3]    (one GPU, ~40 s on an H100)

Prints one line a round and length: each setting's ms and share of the matmul rate one 8k bf16 matmul reaches.
"""
from __future__ import annotations

import argparse
import functools

import torch

from pushkv.messages import SeqWork
from pushkv.model.kernels import triton_moe
from tools import roofline


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    shipped = triton_moe.DOWN_COLS_FIRST_SLOTS
    _, model, views, _ = roofline.load("qwen3-30b-a3b", 1)
    counts, fwd = roofline.model_counts(model), model.batched
    rate = roofline.matmul_rate(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: bf16 matmul {rate / 1e12:.0f} TFLOP/s; shipped bound {shipped}", flush=True)
    for L in args.tokens:
        seqs = [SeqWork(0, tuple(range(L)), 0, tuple(range(-(-L // 16))))]
        run = functools.partial(fwd.logits, seqs, views)
        flops = roofline.prefill_flops(counts, L)
        for rnd in range(args.rounds):
            cells = []
            for slots in (0, 1, shipped, 0):
                triton_moe.DOWN_COLS_FIRST_SLOTS = slots
                t = roofline._time(run, 8 if L < 16384 else 3, warm=1)
                cells.append(f"slots {slots}: {t * 1e3:.2f} ms {flops / t / rate:.1%}")
            print(L, rnd, " | ".join(cells), flush=True)
    triton_moe.DOWN_COLS_FIRST_SLOTS = shipped


if __name__ == "__main__":
    main()
