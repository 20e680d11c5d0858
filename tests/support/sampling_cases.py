"""Shared by the sampler-kernel tests (and runnable alone, in a process with TRITON_INTERPRET=1):
a batch of rows in every mode the kernel has, drawn by the torch path and by the kernel."""
from __future__ import annotations

import json
import sys

import torch

from pushkv.messages import SamplingParams, SeqWork
from pushkv.model import sampling as S

MIXES = [
    None,  # greedy
    SamplingParams(temperature=0.8),  # plain: the whole row in id order
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.8),  # window (no top_k)
    SamplingParams(temperature=1.3, min_p=0.05),
    SamplingParams(temperature=2.0, top_p=0.99),  # a nucleus wider than the window: the whole row sorted
    SamplingParams(temperature=0.9, top_k=5, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.3,
                   logit_bias=((7, 2.0),), logprobs=2),
    SamplingParams(temperature=0.6, top_k=1500),  # top_k above the kernel's candidates: whole row
    SamplingParams(temperature=0.5, top_k=1),
    SamplingParams(temperature=0.7, top_k=100),  # its top 100 crowded into one segment: the whole row sorted
    SamplingParams(temperature=0.0, logprobs=20),  # greedy with the most top logprobs the API allows
    SamplingParams(temperature=1.0, allowed_token_ids=(3, 50, 100, 4000)),  # the rest of the row -inf
]


def batch(rows: int, vocab: int, device: str = "cpu", seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 3).to(device)
    x[:, 100] += 5  # one peaked token, as models have
    seqs = []
    for i in range(rows):
        p = MIXES[i % len(MIXES)]
        if p is not None and p.top_k == 100:
            x[i, :300] += 8
        if p is not None:
            p = SamplingParams(**{**{f: getattr(p, f) for f in p.__struct_fields__}, "seed": 1000 + i})
        seqs.append(SeqWork(i, (1,), 100, (0,), sampling=p, output_index=3 + i,
                            history=(7, 7, 9) if p is not None and p.presence_penalty else ()))
    return x, seqs


def both(x: torch.Tensor, seqs) -> tuple:
    """(torch path's sample, kernel's sample) of the same rows."""
    saved = S.SAMPLER
    try:
        S.SAMPLER = "torch"
        a = S.sample(x, seqs)
        S.SAMPLER = "triton"
        b = S.sample(x, seqs)
    finally:
        S.SAMPLER = saved
    return a, b


if __name__ == "__main__":  # the interpreter check: prints the two token lists and a batch-invariance check
    rows, vocab = int(sys.argv[1]), int(sys.argv[2])
    if len(sys.argv) > 3:  # the kernel's segment length: several segments of a small vocabulary
        from pushkv.model.kernels import triton_sample

        triton_sample.BLOCK = int(sys.argv[3])
    x, seqs = batch(rows, vocab)
    a, b = both(x, seqs)
    print("torch", json.dumps(a.tokens))
    print("kernel", json.dumps(b.tokens))
    print("rows", json.dumps(S.KERNEL_ROWS))
    S.SAMPLER = "triton"
    alone = [S.sample(x[i:i + 1], [seqs[i]]).tokens[0] for i in (1, 2, 3)]
    print("alone", json.dumps(alone))
    lp = lambda t: [t.logprob, list(t.top_ids), list(t.top_logprobs)]  # noqa: E731
    print("logprobs", json.dumps([(lp(a.logprobs[i]), lp(b.logprobs[i]))
                                  for i in range(rows) if a.logprobs and a.logprobs[i] is not None]))
