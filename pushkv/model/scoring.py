"""A prompt's own log-probabilities, scored from the hidden rows of the step that prefilled it.

Only the chunks of requests that asked are scored (``SeqWork.score_prompt`` >= 0): a step with
none runs as before. Each position of such a chunk scores the prompt token after it: its rows
are the chunk's tokens but the last, and the last too when the prompt goes on past the chunk
(``SeqWork.next_prompt_token``); the prompt's last position gives the first output token
instead, which the sampler draws. So chunked prefill scores every position once, and the
first prompt token, which nothing before it predicts, never.

``score`` takes the step's final-normed hidden rows of those positions and the model's lm head,
and computes the logits, log_softmax over the whole vocabulary in float32, each scored
token's log-probability and rank (vLLM's: the ids at least as likely, itself included) and
the top N, a slice of rows at a time so that a long chunk never holds its [rows, vocab]
logits at once; one copy to the host, packed as ``messages.PromptLogprobs``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from pushkv.messages import PromptLogprobs, SeqWork

SLICE_ROWS = 512  # rows whose float32 logits are held at once (x vocab 151,936: 311 MB, and as much again)


@dataclass
class ScorePlan:
    """What a step scores: its packed rows, the token each scores, and per asking seq where its
    positions start in the prompt, how many there are and how many alternatives each gives."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    seqs: list[tuple[int, int, int]] = field(default_factory=list)  # (first scored token, count, top)


def targets_of(s: SeqWork) -> list[int]:
    """The prompt tokens a chunk's positions score, in order."""
    return list(s.token_ids[1:]) + ([s.next_prompt_token] if s.next_prompt_token >= 0 else [])


def plan(seqs: Sequence[SeqWork]) -> ScorePlan:
    """The scored rows of a step packed as its sequences are (token after token, in order)."""
    out = ScorePlan()
    row = 0
    for s in seqs:
        if s.score_prompt >= 0:
            t = targets_of(s)
            out.rows.extend(range(row, row + len(t)))
            out.targets.extend(t)
            out.seqs.append((s.start_pos + 1, len(t), s.score_prompt))
        row += len(s.token_ids)
    return out


def rows(seqs: Sequence[SeqWork]) -> list[int]:
    """The packed rows whose hidden states a step keeps for scoring (none: nothing asked)."""
    return plan(seqs).rows if any(s.score_prompt >= 0 for s in seqs) else []


Head = Callable[[torch.Tensor], torch.Tensor]  # final-normed hidden rows -> float32 logits


@torch.inference_mode()
def score(hidden: Optional[torch.Tensor], head: Head, p: ScorePlan) -> tuple[PromptLogprobs, ...]:
    """One ``PromptLogprobs`` per asking seq of ``p``, from ``hidden`` (the rows of ``p.rows``)."""
    n, kmax = len(p.targets), max((k for _, _, k in p.seqs), default=0)
    if not n:
        return tuple(PromptLogprobs(start, 0, k) for start, _, k in p.seqs)
    assert hidden is not None and hidden.shape[0] == n, "one hidden row per scored token"
    targets = torch.tensor(p.targets, dtype=torch.long, device=hidden.device)
    parts = []
    for a in range(0, n, SLICE_ROWS):
        lp = torch.log_softmax(head(hidden[a:a + SLICE_ROWS]).float(), dim=-1)
        chosen = lp.gather(1, targets[a:a + SLICE_ROWS, None])
        rank = (lp >= chosen).sum(-1, keepdim=True)
        cols = [chosen, rank.to(lp.dtype)]
        if kmax:
            top_v, top_i = lp.topk(kmax, dim=-1)
            cols += [top_v, top_i.to(lp.dtype)]  # ids < 2^24: exact in float32
        parts.append(torch.cat(cols, dim=1))
    host = torch.cat(parts).cpu().numpy()  # one copy: [chosen, rank, top values, top ids] per row
    out, r = [], 0
    for start, count, k in p.seqs:
        block = host[r:r + count]
        r += count
        out.append(PromptLogprobs(
            start, count, k, block[:, 0].astype("<f4").tobytes(), block[:, 1].astype("<i4").tobytes(),
            block[:, 2 + kmax:2 + kmax + k].astype("<i4").tobytes(), block[:, 2:2 + k].astype("<f4").tobytes()))
    return tuple(out)
