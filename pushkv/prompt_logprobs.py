"""A prompt's log-probabilities on the wire (``messages.PromptLogprobs``): read, joined, checked.

The worker packs each prefill chunk's positions (``model/scoring.py``), the scheduler joins a
prompt's chunks into one (``join``) and the router reads it back per position (``positions``)
to render vLLM's and OpenAI's shapes. Pure, and ground: it imports only ``messages``, so every
side uses the one reading of the bytes.
"""
from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from typing import Sequence

from pushkv.messages import PromptLogprobs

F32, I32 = 4, 4  # bytes of one '<f4' / '<i4'


@dataclass(frozen=True)
class Position:
    """One scored prompt token: its log-probability and rank, and the ``top`` most likely ids."""

    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def _read(code: str, data: bytes) -> array:
    a = array(code)
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a


def malformed(p: PromptLogprobs) -> str:
    """Why ``p``'s bytes do not hold its ``count`` positions of ``top`` ids ("" when they do)."""
    n, k = p.count, p.top
    if p.start < 1 or n < 0 or k < 0:
        return f"start {p.start}, count {n}, top {k}: start must be >= 1, count and top >= 0"
    want = {"logprobs": n * F32, "ranks": n * I32, "top_ids": n * k * I32, "top_logprobs": n * k * F32}
    for name, size in want.items():
        if len(getattr(p, name)) != size:
            return f"{name} holds {len(getattr(p, name))} bytes, not {size} ({n} positions x top {k})"
    return ""


def positions(p: PromptLogprobs) -> list[Position]:
    """Each scored position's entry, in order (the prompt's tokens ``start`` .. ``start + count - 1``)."""
    why = malformed(p)
    if why:
        raise ValueError(f"malformed prompt logprobs: {why}")
    lps, ranks = _read("f", p.logprobs), _read("i", p.ranks)
    ids, tops = _read("i", p.top_ids), _read("f", p.top_logprobs)
    k = p.top
    return [Position(lps[i], ranks[i], tuple(ids[i * k:(i + 1) * k]), tuple(tops[i * k:(i + 1) * k]))
            for i in range(p.count)]


def join(parts: Sequence[PromptLogprobs], start: int = 1) -> PromptLogprobs:
    """A prompt's chunks, in order, as one: each must begin where the one before ended (the first
    at ``start``) and give as many alternatives. No parts: none scored, from ``start``."""
    if not parts:
        return PromptLogprobs(start, 0, 0)
    top, at = parts[0].top, start
    for p in parts:
        why = malformed(p)
        if why:
            raise ValueError(f"malformed prompt logprobs: {why}")
        if p.start != at or p.top != top:
            raise ValueError(f"a chunk's prompt logprobs start at {p.start} with top {p.top}; expected {at}, "
                             f"top {top}")
        at += p.count
    if len(parts) == 1:
        return parts[0]
    return PromptLogprobs(start, at - start, top, b"".join(p.logprobs for p in parts),
                          b"".join(p.ranks for p in parts), b"".join(p.top_ids for p in parts),
                          b"".join(p.top_logprobs for p in parts))
