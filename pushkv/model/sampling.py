"""Batched sampling on a step's logits, defined by the request alone.

``sample(logits, seqs)`` takes the float32 ``[num sampled seqs, vocab]``
logits a forward step produced (on the model's device) and the ``SeqWork`` of
every seq with ``sample=True``, in the same order, and returns their tokens
(and log-probabilities where a seq asked for them).

Why the result depends only on the request: P samples a request's first token
and D the rest, in other processes and in other batches. The one random number
a seq needs per token is a counter-based hash of ``(seed, output_index)``
computed in Python integers, so it is the same in any process, on any device,
in any batch. It drives inverse-CDF sampling over the filtered distribution
(one uniform per row, no per-vocab random stream). Everything else is row-wise
tensor math, batched over the seqs that need it:

logits -> + logit_bias, - presence/frequency penalty (over the output so far,
``SeqWork.history``), suppressed ids (``min_tokens``) to -inf -> temperature 0:
argmax; else / temperature -> top_k -> min_p -> top_p -> inverse CDF.

Log-probabilities are those of the model's raw distribution (before bias,
penalties and temperature), as vLLM reports them by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pushkv.messages import SamplingParams, SeqWork, TokenLogprob

GREEDY = SamplingParams()
_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints with good avalanche."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, index: int) -> float:
    """The uniform in (0, 1) that draws output token ``index`` of a request seeded ``seed``.

    24 bits, so it is exact in float32 on every device.
    """
    h = _mix64(_mix64(seed & _MASK64) ^ (index * 0x9E3779B97F4A7C15))
    return ((h >> 40) + 0.5) / float(1 << 24)


def derive_seed(seed: int, n: int) -> int:
    """Choice ``n`` of a request with ``n`` > 1 samples from its own stream."""
    return seed if n == 0 else _mix64(seed ^ _mix64(n))


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: tuple[Optional[TokenLogprob], ...] = ()  # aligned with tokens when any seq asked


def _params(s: SeqWork) -> SamplingParams:
    return s.sampling if s.sampling is not None else GREEDY


def _needs_processing(p: SamplingParams, s: SeqWork) -> bool:
    return bool(p.logit_bias or s.suppress or (s.history and (p.presence_penalty or p.frequency_penalty)))


def sample(logits: torch.Tensor, seqs: Sequence[SeqWork]) -> Sampled:
    """Tokens for ``seqs`` (those with sample=True, in order) from their logits rows."""
    if logits.shape[0] != len(seqs):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(seqs)} sampled seqs")
    params = [_params(s) for s in seqs]
    if all(p.temperature == 0 and p.logprobs < 0 and not _needs_processing(p, s) for p, s in zip(params, seqs)):
        return Sampled(logits.argmax(-1).tolist())  # the all-greedy step: nothing else to do
    raw = logits
    x = _process(logits, seqs, params)
    tokens = x.argmax(-1)
    hot = [i for i, p in enumerate(params) if p.temperature > 0]
    if hot:
        idx = torch.tensor(hot, device=x.device)
        tokens[idx] = _draw(x[idx], [params[i] for i in hot], [seqs[i] for i in hot])
    tokens_list = tokens.tolist()
    if all(p.logprobs < 0 for p in params):
        return Sampled(tokens_list)
    return Sampled(tokens_list, _logprobs(raw, tokens, params))


def _process(logits: torch.Tensor, seqs: Sequence[SeqWork], params: list[SamplingParams]) -> torch.Tensor:
    """Bias, penalties and suppression, scattered in one go each (a copy: raw logits stay)."""
    rows = [i for i, (p, s) in enumerate(zip(params, seqs)) if _needs_processing(p, s)]
    if not rows:
        return logits
    x = logits.clone()
    dev, vocab = x.device, x.shape[1]
    b_idx, b_val, s_idx, h_idx, h_row = [], [], [], [], []
    pres = torch.zeros(x.shape[0])
    freq = torch.zeros(x.shape[0])
    for i in rows:
        p, s = params[i], seqs[i]
        for tok, bias in p.logit_bias:
            b_idx.append(i * vocab + tok)
            b_val.append(bias)
        s_idx.extend(i * vocab + t for t in s.suppress)
        if s.history and (p.presence_penalty or p.frequency_penalty):
            h_idx.extend(s.history)
            h_row.extend([i] * len(s.history))
            pres[i], freq[i] = p.presence_penalty, p.frequency_penalty
    flat = x.view(-1)
    if b_idx:
        flat.index_add_(0, torch.tensor(b_idx, device=dev), torch.tensor(b_val, device=dev, dtype=x.dtype))
    if h_idx:
        counts = torch.zeros_like(x)
        ones = torch.ones(len(h_idx), device=dev, dtype=x.dtype)
        counts.view(-1).index_add_(0, torch.tensor(h_row, device=dev) * vocab + torch.tensor(h_idx, device=dev), ones)
        x -= freq.to(dev)[:, None] * counts + pres.to(dev)[:, None] * (counts > 0).to(x.dtype)
    if s_idx:
        flat[torch.tensor(s_idx, device=dev)] = float("-inf")
    return x


def _draw(x: torch.Tensor, params: list[SamplingParams], seqs: list[SeqWork]) -> torch.Tensor:
    """Inverse-CDF draw per row from the temperature-scaled, filtered distribution."""
    dev = x.device
    n, vocab = x.shape
    temp = torch.tensor([p.temperature for p in params], device=dev, dtype=x.dtype)
    x = x / temp[:, None]
    neg_inf = torch.tensor(float("-inf"), device=dev, dtype=x.dtype)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values  # sorted, descending
        k = torch.tensor(ks, device=dev)
        kth = top.gather(1, (k.clamp(min=1) - 1)[:, None])
        kth = torch.where((k > 0)[:, None], kth, neg_inf)  # rows without top_k keep everything
        x = torch.where(x < kth, neg_inf, x)
    probs = torch.softmax(x, dim=-1)
    min_p = [p.min_p for p in params]
    if any(mp > 0 for mp in min_p):
        floor = torch.tensor(min_p, device=dev, dtype=x.dtype)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < floor, torch.zeros((), device=dev, dtype=x.dtype), probs)
    top_p = [p.top_p for p in params]
    nucleus = [i for i, tp in enumerate(top_p) if tp < 1.0]
    if nucleus:
        idx = torch.tensor(nucleus, device=dev)
        sub = probs[idx]
        ordered = sub.sort(dim=-1, descending=True).values
        before = ordered.cumsum(-1) - ordered  # mass strictly ahead of each entry
        total = ordered.sum(-1, keepdim=True)
        want = torch.tensor([top_p[i] for i in nucleus], device=dev, dtype=x.dtype)[:, None] * total
        keep = (before < want).sum(-1, keepdim=True).clamp(min=1)  # always keep the most likely
        least = ordered.gather(1, keep - 1)
        probs[idx] = torch.where(sub < least, torch.zeros((), device=dev, dtype=x.dtype), sub)
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    u = torch.tensor([uniform(p.seed, s.output_index) for p, s in zip(params, seqs)], device=dev, dtype=x.dtype)
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp(max=vocab - 1).squeeze(1)


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> tuple[Optional[TokenLogprob], ...]:
    rows = [i for i, p in enumerate(params) if p.logprobs >= 0]
    idx = torch.tensor(rows, device=raw.device)
    lp = torch.log_softmax(raw[idx], dim=-1)
    chosen = lp.gather(1, tokens[idx][:, None]).squeeze(1).tolist()
    kmax = max(params[i].logprobs for i in rows)
    top_v, top_i = (lp.topk(kmax, dim=-1) if kmax else (lp[:, :0], lp[:, :0].long()))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    out: list[Optional[TokenLogprob]] = [None] * len(params)
    for j, i in enumerate(rows):
        k = params[i].logprobs
        out[i] = TokenLogprob(chosen[j], tuple(top_i[j][:k]), tuple(top_v[j][:k]))
    return tuple(out)
