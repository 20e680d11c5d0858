"""What a scheduler checks in a ``Generate`` before it acts on it (pure, table-tested).

The router checks all of it first, but anyone who reaches a scheduler's socket can send a
``Generate`` straight to it, and every value here ends up in a step that serves a whole batch:
a token id outside the vocabulary made the sampler's scatter fail the step (every request in
it), and a negative one landed in another request's row and changed its token. So each field
the scheduler or a worker acts on is checked again against the bounds of ``pushkv.limits``,
and a bad one fails that request alone (400, the field named).
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import msgspec

from pushkv import limits as L
from pushkv import messages as m


def _ids_outside(ids: Iterable[int], vocab: int) -> Optional[int]:
    return next((t for t in ids if not 0 <= t < vocab), None)


def _in(x: float, lo: float, hi: float, lo_open: bool = False) -> bool:
    return math.isfinite(x) and lo <= x <= hi and not (lo_open and x == lo)


def check_sampling(p: m.SamplingParams, vocab: int, max_len: int) -> Optional[str]:
    """Why ``p`` may not be sampled with, naming the field, or None."""
    t = p.temperature
    if not (t == 0 or _in(t, L.MIN_TEMPERATURE, L.MAX_TEMPERATURE)):
        return f"sampling.temperature must be 0 or in [{L.MIN_TEMPERATURE:g}, {L.MAX_TEMPERATURE:g}], got {t}"
    if not _in(p.top_p, 0.0, 1.0, lo_open=True):
        return f"sampling.top_p must be in (0, 1], got {p.top_p}"
    if p.top_k < 0:
        return f"sampling.top_k must be >= 0 (0: off), got {p.top_k}"
    if not _in(p.min_p, 0.0, 1.0):
        return f"sampling.min_p must be in [0, 1], got {p.min_p}"
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not _in(v, -L.MAX_PENALTY, L.MAX_PENALTY):
            return f"sampling.{name} must be in [-{L.MAX_PENALTY:g}, {L.MAX_PENALTY:g}], got {v}"
    if not -1 <= p.logprobs <= min(L.MAX_LOGPROBS, vocab):
        return f"sampling.logprobs must be in [-1, {min(L.MAX_LOGPROBS, vocab)}], got {p.logprobs}"
    if not -1 <= p.prompt_logprobs <= min(L.MAX_LOGPROBS, vocab):
        return f"sampling.prompt_logprobs must be in [-1, {min(L.MAX_LOGPROBS, vocab)}], got {p.prompt_logprobs}"
    if not 0 <= p.min_tokens <= max_len:  # the request's, not this leg's (P's leg has max_tokens 1)
        return f"sampling.min_tokens must be in [0, {max_len}], got {p.min_tokens}"
    bias = p.logit_bias
    if len(bias) > L.MAX_LOGIT_BIAS:
        return f"sampling.logit_bias has {len(bias)} entries; at most {L.MAX_LOGIT_BIAS}"
    bad = _ids_outside((tid for tid, _ in bias), vocab)
    if bad is not None:
        return f"sampling.logit_bias token id {bad} outside the vocabulary [0, {vocab})"
    if len({tid for tid, _ in bias}) != len(bias):
        return "sampling.logit_bias names a token id twice"
    off = next((v for _, v in bias if not _in(v, -L.LOGIT_BIAS_ABS, L.LOGIT_BIAS_ABS)), None)
    if off is not None:
        return f"sampling.logit_bias value {off} outside [-{L.LOGIT_BIAS_ABS:g}, {L.LOGIT_BIAS_ABS:g}]"
    if not _in(p.repetition_penalty, 0.0, L.MAX_REPETITION_PENALTY, lo_open=True):
        return f"sampling.repetition_penalty must be in (0, {L.MAX_REPETITION_PENALTY:g}], got {p.repetition_penalty}"
    if len(p.allowed_token_ids) > L.MAX_ALLOWED_TOKEN_IDS:
        return f"sampling.allowed_token_ids has {len(p.allowed_token_ids)} ids; at most {L.MAX_ALLOWED_TOKEN_IDS}"
    bad = _ids_outside(p.allowed_token_ids, vocab)
    if bad is not None:
        return f"sampling.allowed_token_ids token id {bad} outside the vocabulary [0, {vocab})"
    if len(p.bad_words) > 2 * L.MAX_BAD_WORDS:  # each word in two spellings at most
        return f"sampling.bad_words has {len(p.bad_words)} token sequences; at most {2 * L.MAX_BAD_WORDS}"
    if any(not 1 <= len(w) <= L.MAX_BAD_WORD_TOKENS for w in p.bad_words):
        return f"sampling.bad_words: each must have 1-{L.MAX_BAD_WORD_TOKENS} token ids"
    bad = _ids_outside((t for w in p.bad_words for t in w), vocab)
    if bad is not None:
        return f"sampling.bad_words token id {bad} outside the vocabulary [0, {vocab})"
    return None


def check_generate(msg: m.Generate, vocab: int, max_len: int, max_stop_ids: int) -> Optional[str]:
    """Why a scheduler may not act on ``msg`` (the field named), or None. Role and duplicate
    checks are the scheduler's own."""
    if not msg.prompt_token_ids:
        return "empty prompt"
    if msg.max_tokens < 1:
        return "max_tokens must be >= 1"
    bad = _ids_outside(msg.prompt_token_ids, vocab)
    if bad is not None:
        return f"token id {bad} outside the vocabulary (size {vocab})"
    if len(msg.prompt_token_ids) + msg.max_tokens > max_len:
        return (f"prompt ({len(msg.prompt_token_ids)}) + max_tokens ({msg.max_tokens}) exceeds max model "
                f"length {max_len}")
    if msg.structured is not None and len(msg.structured.spec) > L.MAX_STRUCTURED_CHARS:
        return f"structured output of {len(msg.structured.spec)} characters; at most {L.MAX_STRUCTURED_CHARS}"
    if msg.structured is not None and (len(msg.structured.after) > L.MAX_REASONING_END_IDS
                                       or _ids_outside(msg.structured.after, vocab) is not None):
        return f"structured.after: at most {L.MAX_REASONING_END_IDS} token ids, each in the vocabulary"
    if len(msg.cache_salt) > L.MAX_CACHE_SALT_CHARS:
        return f"cache_salt has {len(msg.cache_salt)} characters; at most {L.MAX_CACHE_SALT_CHARS}"
    if len(msg.stop_token_ids) > max_stop_ids:
        return f"stop_token_ids has {len(msg.stop_token_ids)} ids; at most {max_stop_ids}"
    bad = _ids_outside(msg.stop_token_ids, vocab)
    if bad is not None:
        return f"stop_token_ids: token id {bad} outside the vocabulary [0, {vocab})"
    if msg.sampling is not None:
        err = check_sampling(msg.sampling, vocab, max_len)
        if err is not None:
            return err
    if msg.pull is not None:
        if not 0 <= msg.pull.first_token < vocab:
            return f"pull.first_token {msg.pull.first_token} outside the vocabulary [0, {vocab})"
        if msg.pull.num_tokens != len(msg.prompt_token_ids):
            return f"pull.num_tokens {msg.pull.num_tokens} is not the prompt's {len(msg.prompt_token_ids)} tokens"
    return None


def readable_head(payload: bytes) -> tuple[str, int]:
    """The transfer id and generation of an undecodable request, where its first fields are
    readable (``("", 0)`` otherwise), so that its refusal names them."""
    tid, gen = "", 0
    try:
        head = msgspec.msgpack.decode(payload)
        if isinstance(head, list) and len(head) >= 2 and isinstance(head[1], str):
            tid = head[1]
            gen = head[2] if len(head) >= 3 and type(head[2]) is int else 0
    except (msgspec.DecodeError, RecursionError):
        pass
    return tid, gen
