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
tensor math, batched over the seqs that need it, and no row's result depends
on another row:

- edits, sparse (only the ids named or generated): + logit_bias, the
  repetition penalty over the prompt and output so far (``SeqWork.seen``), - presence /
  frequency penalty over the output so far (``SeqWork.history``), every id
  outside ``allowed_token_ids`` (where a request names them) to -inf, then
  suppressed ids (stop ids before ``min_tokens``, bad words' next ids) to -inf;
- temperature 0: argmax;
- otherwise / temperature, then top_k -> min_p -> top_p on the top ``WINDOW``
  (or top_k) candidates, sorted by ``topk``; a row whose kept set may reach past
  the window (a flat distribution without top_k) is sorted whole instead; rows
  with no filter draw over the whole vocabulary in id order.

Log-probabilities are those of the model's raw distribution (before bias,
penalties and temperature), as vLLM reports them by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from pushkv import envs
from pushkv.messages import PromptLogprobs, SamplingParams, SeqWork, TokenLogprob
from pushkv.seeds import uniform

GREEDY = SamplingParams()
WINDOW = 1024  # candidates a row without top_k is filtered on before its whole row is sorted
# which sampler: "auto" = the one-launch Triton kernel on CUDA (kernels/triton_sample.py), the
# torch ops elsewhere; "torch" or "triton" force one (triton on CPU needs TRITON_INTERPRET=1)
SAMPLER = envs.PUSHKV_SAMPLER
KERNEL_ROWS = {"kernel": 0, "sorted": 0}  # rows the GPU sampler drew, and those it left to the sorted path
@dataclass
class Sampled:
    tokens: list[int]
    logprobs: tuple[Optional[TokenLogprob], ...] = ()  # aligned with tokens when any seq asked
    prompt: tuple[PromptLogprobs, ...] = ()  # one per seq that scored its prompt chunk (model/scoring.py)


def _up(values, dev: torch.device, dtype=None) -> torch.Tensor:
    """A small host list on ``dev`` in a plain copy (the edits' sparse ids and values, rare)."""
    return torch.tensor(values, dtype=dtype, device=dev)


_STAGES: dict = {}  # (device, dtype) -> [pinned buffer, its numpy view, event of the last copy out of it]


def _staged(values: list, dtype, dev: torch.device) -> torch.Tensor:
    """``values`` on ``dev`` through a reused pinned buffer, without blocking the host (a plain
    ``torch.tensor(..., device=cuda)`` waits for the stream: every one of them in a step would
    stop its kernels from queueing). Written through numpy (cheaper than building a tensor);
    the buffer is rewritten only after its last copy ended."""
    if dev.type != "cuda" or not values:
        return torch.tensor(values, dtype=dtype).to(dev)
    st = _STAGES.get((dev, dtype))
    if st is None or st[0].numel() < len(values):
        pinned = torch.empty(max(len(values), 4096), dtype=dtype, pin_memory=True)
        st = _STAGES[(dev, dtype)] = [pinned, pinned.numpy(), None]
    if st[2] is not None:
        st[2].synchronize()
    st[1][:len(values)] = values
    out = st[0][:len(values)].to(dev, non_blocking=True)
    if st[2] is None:
        st[2] = torch.cuda.Event()
    st[2].record(torch.cuda.current_stream(dev))
    return out


class _Rows:
    """Every per-row value a step's sampling needs on the device, gathered in Python first and
    moved in one copy per dtype; ``upload`` answers each named slice."""

    def __init__(self):
        self.ints: list = []
        self.floats: list = []
        self.spans: dict[str, tuple[bool, int, int]] = {}

    def add(self, name: str, values, floats: bool = False) -> None:
        out = self.floats if floats else self.ints
        self.spans[name] = (floats, len(out), len(values))
        out.extend(values)

    def upload(self, dev: torch.device) -> dict[str, torch.Tensor]:
        ti = _staged(self.ints, torch.long, dev)
        tf = _staged(self.floats, torch.float32, dev)
        return {k: (tf if f else ti)[a:a + n] for k, (f, a, n) in self.spans.items()}


def _params(s: SeqWork) -> SamplingParams:
    return s.sampling if s.sampling is not None else GREEDY


def _edited(p: SamplingParams, s: SeqWork) -> bool:
    return bool(p.logit_bias or p.allowed_token_ids or s.suppress or s.token_mask
                or (s.history and (p.presence_penalty or p.frequency_penalty))
                or (s.seen and p.repetition_penalty != 1.0))


@dataclass
class _DrawPlan:
    """Which rows (of the temperature > 0 ones) draw over the whole row and which filter, and
    the filters' window: decided on the host, before anything moves."""

    plain: list[int]
    filtered: list[int]
    has_k: list[bool]  # per filtered row
    width: int  # candidates the window path sorts


def _draw_plan(params: list[SamplingParams], seqs: list[SeqWork], vocab: int, rows: _Rows) -> _DrawPlan:
    rows.add("u", [uniform(p.seed, s.output_index) for p, s in zip(params, seqs)], floats=True)
    filtered = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0]
    fset = set(filtered)
    plain = [i for i in range(len(params)) if i not in fset]
    fp = [params[i] for i in filtered]
    has_k = [0 < p.top_k < vocab for p in fp]
    width = min(vocab, max([p.top_k for p, k in zip(fp, has_k) if k] + ([WINDOW] if not all(has_k) else [0])))
    if filtered and plain:
        rows.add("plain", plain)
        rows.add("filtered", filtered)
    rows.add("mask", [v for p, k in zip(fp, has_k) for v in ((p.top_k if k else width), p.min_p, p.top_p)],
             floats=True)
    rows.add("has_k", [float(k) for k in has_k], floats=True)
    return _DrawPlan(plain, filtered, has_k, width)


def sample(logits: torch.Tensor, seqs: Sequence[SeqWork]) -> Sampled:
    """Tokens for ``seqs`` (those with sample=True, in order) from their logits rows.

    ``logits`` is only read: the rows that need work are gathered into copies.
    """
    if logits.shape[0] != len(seqs):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(seqs)} sampled seqs")
    params = [_params(s) for s in seqs]
    if all(p.temperature == 0 and p.logprobs < 0 and not _edited(p, s) for p, s in zip(params, seqs)):
        return Sampled(logits.argmax(-1).tolist())  # the all-greedy step: nothing else to do
    dev = logits.device
    if _use_kernel(dev):
        return _sample_kernel(logits, seqs, params)
    cold = [i for i, p in enumerate(params) if p.temperature == 0]
    hot = [i for i, p in enumerate(params) if p.temperature > 0]
    ps, hs = [params[i] for i in hot], [seqs[i] for i in hot]
    inv_t = [1.0 / p.temperature for p in ps]
    rows = _Rows()
    if cold and hot:
        rows.add("cold", cold)
        rows.add("hot", hot)
    rows.add("inv_t", inv_t, floats=True)
    plan = _draw_plan(ps, hs, logits.shape[1], rows) if hot else None
    t = rows.upload(dev)
    cold_tokens: Optional[torch.Tensor] = None
    drawn: Optional[torch.Tensor] = None
    if cold:
        x = logits[t["cold"]] if hot else logits.clone()
        _edit(x, [params[i] for i in cold], [seqs[i] for i in cold])
        cold_tokens = x.argmax(-1)
    if hot:
        scale = t["inv_t"].to(logits.dtype)[:, None]
        if any(_edited(p, s) for p, s in zip(ps, hs)):  # (logit + edit) / T
            x = logits[t["hot"]] if cold else logits.clone()
            _edit(x, ps, hs)
            x.mul_(scale)
        else:
            x = logits[t["hot"]].mul_(scale) if cold else logits * scale  # one new tensor either way
        assert plan is not None
        drawn = _draw(x, plan, t)
    if cold_tokens is not None and drawn is not None:
        tokens = torch.empty(len(seqs), dtype=torch.long, device=dev)
        tokens[t["cold"]] = cold_tokens
        tokens[t["hot"]] = drawn
    elif cold_tokens is not None:
        tokens = cold_tokens
    else:
        assert drawn is not None  # every seq is cold or hot
        tokens = drawn
    tokens_list = tokens.tolist()
    if all(p.logprobs < 0 for p in params):
        return Sampled(tokens_list)
    return Sampled(tokens_list, _logprobs(logits, tokens, params))


def _use_kernel(dev: torch.device) -> bool:
    return SAMPLER == "triton" or (SAMPLER == "auto" and dev.type == "cuda")


def _kernel_rows(params: list[SamplingParams], seqs: Sequence[SeqWork], vocab: int, TS) -> list[tuple]:
    """Each row's (inv_t, k, min_p, top_p, u, mode) for kernels/triton_sample.py."""
    out = []
    window = min(TS.CAND, vocab)
    for p, s in zip(params, seqs):
        t = p.temperature
        if t == 0:
            out.append((1.0, 0, 0.0, 1.0, 0.5, TS.GREEDY))
            continue
        k = p.top_k
        if 0 < k < vocab:
            mode = TS.TOPK if k <= TS.CAND else TS.WHOLE
        else:
            k = window
            mode = TS.WINDOW if (p.top_p < 1.0 or p.min_p > 0) else TS.PLAIN
        out.append((1.0 / t, k, p.min_p, p.top_p, uniform(p.seed, s.output_index), mode))
    return out


def warmup(vocab: int, dev) -> None:
    """Compile the GPU sampler now (start-up), not at the first sampled step of serving."""
    dev = torch.device(dev)
    if not _use_kernel(dev):
        return
    mixes = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_k=5),
             SamplingParams(temperature=0.7, top_p=0.5, logprobs=1), None]
    seqs = [SeqWork(i, (0,), 1, (0,), sampling=p) for i, p in enumerate(mixes)]
    sample(torch.randn(len(seqs), vocab, device=dev), seqs)


def _sample_kernel(logits: torch.Tensor, seqs: Sequence[SeqWork], params: list[SamplingParams]) -> Sampled:
    """The GPU sampler: the request's edits (sparse, rare) on a copy, then every row's draw in one
    launch; a row it answers -1 (a nucleus wider than the window, or top_k above it) is drawn
    over its whole sorted row here, as the torch path does."""
    from pushkv.model.kernels import triton_sample as TS

    vocab = logits.shape[1]
    x = logits
    if any(_edited(p, s) for p, s in zip(params, seqs)):
        x = logits.clone()
        _edit(x, params, seqs)
    rows = _kernel_rows(params, seqs, vocab, TS)
    t = _staged([v for r in rows for v in r], torch.float32, logits.device).view(len(rows), TS.NPARAM)
    out = TS.sample_rows(x, t)
    tokens = out.tolist()
    redo = [i for i, v in enumerate(tokens) if v < 0]
    KERNEL_ROWS["kernel"] += len(tokens) - len(redo)
    KERNEL_ROWS["sorted"] += len(redo)
    if redo:
        idx = _up(redo, logits.device)
        with_k = [rows[i][5] in (TS.TOPK, TS.WHOLE) for i in redo]
        mask = _up([(r[1] if k else vocab, r[2], r[3]) for r, k in zip((rows[i] for i in redo), with_k)],
                   logits.device, torch.float32)
        has_k = _up([float(k) for k in with_k], logits.device, torch.float32)
        got = _draw_sorted(x[idx] * t[idx, 0:1], mask, has_k, t[idx, 4])
        out[idx] = got
        for i, v in zip(redo, got.tolist()):
            tokens[i] = v
    if all(p.logprobs < 0 for p in params):
        return Sampled(tokens)
    return Sampled(tokens, _logprobs(logits, out, params))


def _edit(x: torch.Tensor, params: list[SamplingParams], seqs: Sequence[SeqWork]) -> None:
    """Bias, penalties and suppression, in place, as sparse scatters: touches only the ids a
    request names or generated, never the whole vocabulary. Penalties are computed on the
    device from the padded output histories (no per-token Python loop)."""
    vocab, dev = x.shape[1], x.device
    where: list[int] = []
    delta: list[float] = []
    banned: list[int] = []
    pen_rows: list[int] = []
    only_rows: list[int] = []  # rows restricted to their allowed_token_ids
    masks: list = []  # structured output: (row, its packed mask of the tokens it may draw)
    seen: list = []  # repetition_penalty: each row's ids of the prompt and output so far (int32, little-endian)
    seen_at: list[tuple[int, float]] = []  # ... and that row's (first flat id, penalty)
    only: list[int] = []  # those rows' allowed ids, flat
    for j, (p, s) in enumerate(zip(params, seqs)):
        if not _edited(p, s):
            continue
        base = j * vocab
        for tok, bias in p.logit_bias:
            where.append(base + tok)
            delta.append(bias)
        if s.history and (p.presence_penalty or p.frequency_penalty):
            pen_rows.append(j)
        if s.seen and p.repetition_penalty != 1.0:
            seen.append(np.frombuffer(s.seen, dtype="<i4"))
            seen_at.append((base, p.repetition_penalty))
        if s.token_mask:
            masks.append((j, s.token_mask))
        if p.allowed_token_ids:
            only_rows.append(j)
            only.extend(base + t for t in p.allowed_token_ids)
        banned.extend(base + t for t in s.suppress)
    flat = x.view(-1)
    if where:
        flat.index_add_(0, _up(where, dev), _up(delta, dev, x.dtype))
    if seen:  # vLLM's and transformers' repetition penalty: a positive logit divided by it, any other multiplied
        counts = _up([len(a) for a in seen], dev)
        rows = _up(seen_at, dev, torch.float64)  # each row's base id and penalty; ids < 2^53 are exact
        at = torch.from_numpy(np.concatenate(seen)).to(dev).long() + rows[:, 0].long().repeat_interleave(counts)
        by = rows[:, 1].to(x.dtype).repeat_interleave(counts)
        v = flat[at]
        flat.index_copy_(0, at, torch.where(v > 0, v / by, v * by))
    if pen_rows:
        flat.index_add_(0, *_penalties([seqs[j].history for j in pen_rows], pen_rows,
                                       [params[j] for j in pen_rows], vocab, x))
    if only_rows:  # the allowed ids keep their (edited) logits; the rest of those rows go to -inf
        at = _up(only, dev)
        kept = flat[at]
        x.index_fill_(0, _up(only_rows, dev), float("-inf"))
        flat.index_copy_(0, at, kept)
    if masks:  # structured output: the tokens the grammar does not allow now go to -inf
        rows = _up([j for j, _ in masks], dev)
        words = torch.from_numpy(np.stack([np.frombuffer(b, dtype="<i4") for _, b in masks])).to(dev)
        bits = (words[:, :, None] >> torch.arange(32, device=dev, dtype=words.dtype)) & 1
        keep = bits.reshape(len(masks), -1)[:, :vocab].bool()
        x[rows] = x[rows].masked_fill(~keep, float("-inf"))
    if banned:
        flat.index_fill_(0, _up(banned, dev), float("-inf"))


def _penalties(histories, rows, params, vocab: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat ids, values) to add: - (frequency + presence on an id's first occurrence) per
    generated token, i.e. - (frequency * count + presence) per distinct id."""
    dev = x.device
    width = max(len(h) for h in histories)
    hist = _up([tuple(h) + (-1,) * (width - len(h)) for h in histories], dev, torch.long)
    coef = _up([(p.frequency_penalty, p.presence_penalty, r * vocab) for p, r in zip(params, rows)],
               dev, torch.float64)
    ids = hist.sort(dim=1).values
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    valid = ids >= 0
    vals = -(coef[:, 0:1] + coef[:, 1:2] * first) * valid
    flat_ids = ids.clamp(min=0) + coef[:, 2:3].long()
    return flat_ids.ravel(), vals.ravel().to(x.dtype)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row-wise: the first position whose cumulative weight exceeds u * total (never a zero weight)."""
    cdf = weights.double().cumsum(-1)  # float64: a 150k-token row's sum drifts in float32
    total = cdf[:, -1:]
    target = torch.minimum(u.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp(max=weights.shape[1] - 1).squeeze(1)


def _draw(x: torch.Tensor, plan: _DrawPlan, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """One token per row of the temperature-scaled, edited logits: top_k -> min_p -> top_p -> draw."""
    u = t["u"]
    if not plan.filtered:  # x is sample()'s own copy: ours to overwrite
        return _draw_plain(x, u)
    if not plan.plain:
        return _draw_filtered(x, plan, t, u)
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    out[t["plain"]] = _draw_plain(x[t["plain"]], u[t["plain"]])
    out[t["filtered"]] = _draw_filtered(x[t["filtered"]], plan, t, u[t["filtered"]])
    return out


def _draw_plain(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """No filter: the whole distribution, in vocabulary order (``x`` overwritten)."""
    return _inverse_cdf(x.sub_(x.max(-1, keepdim=True).values).exp_(), u)


def _draw_filtered(x: torch.Tensor, plan: _DrawPlan, t: dict[str, torch.Tensor], u: torch.Tensor) -> torch.Tensor:
    mask = t["mask"].view(-1, 3)
    got, spill = _draw_window(x, plan, mask, t["has_k"], u)
    if spill:  # the window did not hold these rows' candidates: sort their whole rows
        back = _up(spill, x.device)
        got[back] = _draw_sorted(x[back], mask[back], t["has_k"][back], u[back])
    return got


def _draw_window(x: torch.Tensor, plan: _DrawPlan, mask: torch.Tensor, has_k: torch.Tensor,
                 u: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Filters on the top ``plan.width`` candidates only: no sort of the vocabulary. ``mask``
    rows are (top_k or the width, min_p, top_p).

    A row whose kept set may reach past the window (no top_k, and min_p or top_p
    not yet satisfied inside it) is returned in ``spill`` for the full path.
    """
    vals, ids = x.topk(plan.width, dim=-1)  # sorted, descending
    e = torch.exp(vals - vals[:, :1])
    keep = torch.arange(plan.width, device=x.device)[None, :] < mask[:, 0:1]
    keep &= e >= mask[:, 1:2]  # e is p / p_max
    top_p = mask[:, 2:3]
    w = e * keep
    kept = w.sum(-1, keepdim=True)
    all_k = all(plan.has_k)
    covered = (has_k[:, None] > 0) | ~keep[:, -1:]  # nothing kept lies past the window
    if all_k:
        total = kept
    else:  # without top_k, top_p is of the whole row's mass
        total = torch.where(covered, kept, torch.exp(x - vals[:, :1]).sum(-1, keepdim=True))
    cum = w.cumsum(-1)
    keep &= (cum - w) < top_p * total
    if all_k:
        spill: list[int] = []
    else:  # one host sync, only when some row has no top_k
        fits = covered | (cum[:, -1:] >= top_p * total)
        spill = (~fits).squeeze(1).nonzero().squeeze(1).tolist()
    pos = _inverse_cdf(e * keep, u)
    return ids.gather(1, pos[:, None]).squeeze(1), spill


def _draw_sorted(x: torch.Tensor, mask: torch.Tensor, has_k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The same filters over whole sorted rows (rows without top_k whose nucleus is wide)."""
    vals, ids = x.sort(dim=-1, descending=True)
    e = torch.exp(vals - vals[:, :1])
    k = torch.where(has_k > 0, mask[:, 0], float(x.shape[1]))
    keep = torch.arange(x.shape[1], device=x.device)[None, :] < k[:, None]
    keep &= e >= mask[:, 1:2]
    w = e * keep
    keep &= (w.cumsum(-1) - w) < mask[:, 2:3] * w.sum(-1, keepdim=True)
    pos = _inverse_cdf(e * keep, u)
    return ids.gather(1, pos[:, None]).squeeze(1)


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor,
              params: list[SamplingParams]) -> tuple[Optional[TokenLogprob], ...]:
    """Each asking row's TokenLogprob (None for the others): on CUDA one launch
    (``triton_sample.logprob_rows``), else torch ops."""
    rows = [i for i, p in enumerate(params) if p.logprobs >= 0]
    out: list[Optional[TokenLogprob]] = [None] * len(params)
    if _use_kernel(raw.device):
        from pushkv.model.kernels import triton_sample as TS

        t = _staged(rows + [params[i].logprobs for i in rows], torch.long, raw.device)
        host = TS.logprob_rows(raw, t[:len(rows)], tokens, t[len(rows):]).tolist()
        redo = []
        for j, i in enumerate(rows):
            k, h = params[i].logprobs, host[j]
            if h[-1] == 1.0:
                ids = tuple(int(v) for v in h[1 + TS.LP_MAX:1 + TS.LP_MAX + k])
                out[i] = TokenLogprob(h[0], ids, tuple(h[1:1 + k]))
            else:  # a segment held back a value its top k needed: torch's topk for this row
                redo.append(i)
        rows = redo
    if rows:
        for i, lp in zip(rows, _logprobs_torch(raw, tokens, params, rows)):
            out[i] = lp
    return tuple(out)


def _logprobs_torch(raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams], rows: list[int]
                    ) -> list[TokenLogprob]:
    """logprob = logit - logsumexp(row): no vocab-sized output is materialised."""
    x = raw
    if len(rows) < len(params):
        idx = _up(rows, raw.device)
        x, tokens = raw[idx], tokens[idx]
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    chosen = x.gather(1, tokens[:, None]) - lse
    kmax = max(params[i].logprobs for i in rows)
    if kmax:  # one copy to the host: [chosen, top values, top ids] per row (ids < 2^24: exact in fp32)
        top_v, top_i = x.topk(kmax, dim=-1)
        host = torch.cat([chosen, top_v - lse, top_i.to(x.dtype)], dim=1).tolist()
        lps: list[float] = [r[0] for r in host]
        vals: list[list[float]] = [r[1:1 + kmax] for r in host]
        ids: list[list[int]] = [[int(t) for t in r[1 + kmax:]] for r in host]
    else:
        lps, vals, ids = chosen.squeeze(1).tolist(), [[]] * len(rows), [[]] * len(rows)
    return [TokenLogprob(lps[j], tuple(ids[j][:params[i].logprobs]), tuple(vals[j][:params[i].logprobs]))
            for j, i in enumerate(rows)]
