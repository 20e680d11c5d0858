"""A switch of the MoE prefill's kernels, A/B in one process: ``qwen3-30b-a3b``'s whole prefill of one sequence (as
``pushkv roofline`` times it) with a module-level setting (of ``pushkv.model.kernels.triton_moe``, or any module of
``pushkv.model`` named before a dot: ``batched.SDPA_PROMPT_TOKENS``, ``kernels.paged.FRESH_BACKEND``) at each of a
list of values, in rounds, the first value again last, so a drift of the GPU's clocks shows as a difference between
the first and last columns rather than as a gain. Before each length's rounds, every value's logits are compared
with the first's: the same bits (what a switch of the kernels' order must keep), or the largest difference and
whether the greedy token agrees (a switch of the arithmetic, as another attention kernel).

    python3 -m experiments.prefill_ab [--switch DOWN_COLS_FIRST_SLOTS] [--values 0 1 shipped]
        [--tokens 1024 4096 16384] [--rounds 3] [--set SWITCH=VALUE ...]    (one GPU, ~40 s on an H100)

``shipped`` stands for the switch's value as shipped; a value that is not an integer is taken as a string. Prints
one line a round and length: each value's ms and share of the matmul rate one 8k bf16 matmul reaches.
"""
from __future__ import annotations

import argparse
import functools

import torch

from pushkv.messages import SeqWork
from tools import roofline


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--switch", default="DOWN_COLS_FIRST_SLOTS", help="a setting of triton_moe (an int)")
    ap.add_argument("--values", nargs="+", default=["0", "1", "shipped"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", nargs="*", default=[], metavar="SWITCH=VALUE",
                    help="settings held for the whole run, named as --switch names one")
    args = ap.parse_args()
    for held in args.set:
        key, value = held.split("=", 1)
        setattr(*roofline.model_setting(key), roofline.setting_value(value))
    owner, name = roofline.model_setting(args.switch)
    shipped = getattr(owner, name)
    values = [shipped if v == "shipped" else roofline.setting_value(v) for v in args.values]
    values.append(values[0])
    _, model, views, _ = roofline.load("qwen3-30b-a3b", 1)
    counts, fwd = roofline.model_counts(model), model.batched
    rate = roofline.matmul_rate(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: bf16 matmul {rate / 1e12:.0f} TFLOP/s; {args.switch} shipped {shipped}",
          flush=True)
    try:
        for L in args.tokens:
            seqs = [SeqWork(0, tuple(range(L)), 0, tuple(range(-(-L // 16))))]
            run = functools.partial(fwd.logits, seqs, views)
            flops = roofline.prefill_flops(counts, L)
            first = None
            for v in values[:-1]:
                setattr(owner, name, v)
                got = run()
                first = got if first is None else first
                same = "the same bits" if torch.equal(got, first) else \
                    f"max |diff| {float((got - first).abs().max()):.3g}, greedy token " + \
                    ("the same" if torch.equal(got.argmax(-1), first.argmax(-1)) else "DIFFERS")
                print(f"{L} tokens, {args.switch} {v}: logits {same} as {values[0]}", flush=True)
            for rnd in range(args.rounds):
                cells = []
                for v in values:
                    setattr(owner, name, v)
                    t = roofline._time(run, 8 if L < 16384 else 3, warm=1)
                    cells.append(f"{v}: {t * 1e3:.2f} ms {flops / t / rate:.1%}")
                print(L, rnd, " | ".join(cells), flush=True)
    finally:
        setattr(owner, name, shipped)


if __name__ == "__main__":
    main()
