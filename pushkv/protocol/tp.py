"""Which tensor-parallel rank produces each KV head, and which ranks consume it.

Which heads a rank holds is a fact of its pool's layout (``kv.layout.rank_heads``,
re-exported here): a contiguous slice of the KV heads when ``tp <=
total_kv_heads``; beyond that, heads are replicated and each rank holds exactly
one (rank ``r`` holds head ``r * total // tp``). When P replicates a head,
only the lowest P rank holding it writes it to D, so every D head has exactly
one producer and D counts exactly one completion per producer rank; the other
P replicas write nothing and free their blocks as soon as prefill ends. An
MLA-style latent cache is one "head" held by every rank: P rank 0 writes it to
every D rank.
"""
from __future__ import annotations

from typing import Optional

from pushkv.kv.layout import rank_heads

__all__ = ["rank_heads", "producer_of", "is_producer", "producers_for", "consumers_for", "head_overlap"]


def producer_of(head: int, p_tp: int, total_kv_heads: int) -> int:
    """The one P rank that writes global ``head`` (lowest rank holding it)."""
    if not 0 <= head < total_kv_heads:
        raise ValueError(f"head {head} out of range for total_kv_heads={total_kv_heads}")
    rank_heads(p_tp, 0, total_kv_heads)  # validates p_tp
    if p_tp <= total_kv_heads:
        return head // (total_kv_heads // p_tp)
    return head * (p_tp // total_kv_heads)


def is_producer(p_rank: int, p_tp: int, total_kv_heads: int) -> bool:
    """Whether P rank ``p_rank`` writes anything (whatever D's TP): False for a rank
    whose every head is replicated on a lower rank, which then frees at once."""
    start, count = rank_heads(p_tp, p_rank, total_kv_heads)
    return any(producer_of(h, p_tp, total_kv_heads) == p_rank for h in range(start, start + count))


def producers_for(d_rank: int, d_tp: int, p_tp: int, total_kv_heads: int) -> list[int]:
    """P ranks that write into D rank ``d_rank`` (ascending, each once)."""
    start, count = rank_heads(d_tp, d_rank, total_kv_heads)
    out: list[int] = []
    for h in range(start, start + count):
        p = producer_of(h, p_tp, total_kv_heads)
        if not out or out[-1] != p:
            out.append(p)
    return out


def consumers_for(p_rank: int, p_tp: int, d_tp: int, total_kv_heads: int) -> list[int]:
    """D ranks that P rank ``p_rank`` writes into, every D replica included (ascending)."""
    rank_heads(p_tp, p_rank, total_kv_heads)  # validates p_rank
    rank_heads(d_tp, 0, total_kv_heads)  # validates d_tp (at most MAX_TP ranks to look at)
    return [
        d for d in range(d_tp) if p_rank in producers_for(d, d_tp, p_tp, total_kv_heads)
    ]


def head_overlap(
    p_rank: int, p_tp: int, d_rank: int, d_tp: int, total_kv_heads: int
) -> Optional[tuple[int, int]]:
    """Global ``(start, count)`` of D rank's heads that ``p_rank`` produces, or None.

    Producers are monotone in the head index, so the heads form one range.
    """
    rank_heads(p_tp, p_rank, total_kv_heads)
    start, count = rank_heads(d_tp, d_rank, total_kv_heads)
    mine = [
        h for h in range(start, start + count)
        if producer_of(h, p_tp, total_kv_heads) == p_rank
    ]
    if not mine:
        return None
    return mine[0], len(mine)


def page_heads(p_rank: int, p_tp: int, d_rank: int, d_tp: int, total_kv_heads: int):
    """What P rank ``p_rank`` moves into D rank ``d_rank`` of pages laid out by head: None
    (whole pages, same TP), False (nothing) or ``(P's head, D's head, count)`` in each
    side's own head indices."""
    shared = head_overlap(p_rank, p_tp, d_rank, d_tp, total_kv_heads)
    if shared is None:
        return False
    if p_tp == d_tp:  # the same heads in both ranks' pages (a replicated head too): whole pages
        return None
    start, count = shared
    return (start - rank_heads(p_tp, p_rank, total_kv_heads)[0], start - rank_heads(d_tp, d_rank, total_kv_heads)[0],
            count)
