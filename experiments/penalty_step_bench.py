"""What a repetition penalty adds to a decode step, host side: the scheduler building the step's SeqWorks (each
sequence's distinct prompt and output ids, packed) and encoding the step, and the sampler's edits on the CPU,
against the same step without the penalty, at a batch of long prompts (Qwen3's vocabulary).

    python3 -m experiments.penalty_step_bench [--batch 64] [--prompt 16000] [--distinct 0.25] [--steps 5]

``--distinct``: the share of a prompt's tokens that are distinct ids (natural text repeats most; 1: random ids).
Prints milliseconds per step, the step message's size, and the ratio with the penalty on and off.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from pushkv import messages as m
from pushkv.model.sampling import sample
from pushkv.scheduler.requests import Request

VOCAB = 151936


def run(batch: int, prompt: int, distinct: float, steps: int, penalty: float) -> tuple[float, float, int]:
    rng = random.Random(0)
    pool = [rng.randrange(VOCAB) for _ in range(max(1, int(prompt * distinct)))]
    reqs = [Request(f"t{i}", 0, "decode", tuple(rng.choice(pool) for _ in range(prompt)), 512, b"r",
                    sampling=m.SamplingParams(repetition_penalty=penalty)) for i in range(batch)]
    for r in reqs:
        r.output = [rng.randrange(VOCAB) for _ in range(64)]
    build, draw, size = [], [], 0
    for step in range(steps + 1):
        t0 = time.perf_counter()
        seqs = tuple(m.SeqWork(i, (r.output[-1],), prompt + len(r.output), tuple(range(prompt // 16 + 40)),
                               **r.sample_fields()) for i, r in enumerate(reqs))
        size = len(m.encode(m.ExecuteStep(step, seqs)))
        t1 = time.perf_counter()
        logits = torch.randn(batch, VOCAB)
        t2 = time.perf_counter()
        for r, tok in zip(reqs, sample(logits, list(seqs)).tokens):
            r.output.append(tok)
        t3 = time.perf_counter()
        if step:  # the first builds each prompt's distinct ids once
            build.append(t1 - t0)
            draw.append(t3 - t2)
    return sum(build) / steps * 1e3, sum(draw) / steps * 1e3, size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16000)
    ap.add_argument("--distinct", type=float, default=0.25)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    off = run(a.batch, a.prompt, a.distinct, a.steps, 1.0)
    on = run(a.batch, a.prompt, a.distinct, a.steps, 1.05)
    print(f"batch {a.batch}, prompts of {a.prompt} tokens ({a.distinct:.0%} distinct), {torch.get_num_threads()} "
          f"torch threads")
    for name, (b, d, size) in (("no penalty", off), ("repetition_penalty 1.05", on)):
        print(f"  {name:24s}: the step built and encoded {b:7.2f} ms ({size / 1e6:.2f} MB), sampled (CPU) {d:7.2f} ms")
    print(f"  the penalty adds {on[0] - off[0]:.2f} ms to the step's building and {on[1] - off[1]:.2f} ms to the "
          f"CPU sampler")


if __name__ == "__main__":
    main()
