"""Damage to the KV a transfer moves, for fault-injection tests of ``--kv-verify`` only.

Each is done by a writer (or P's worker, right after summing what it stored) when its
``faults.fire`` point was armed: it models what a faulty link, NIC, memory or peer could do
to the bytes, which nothing but the checksums sees.
"""
from __future__ import annotations

from typing import Sequence

from pushkv.kv.layout import KVLayout, layer_groups, offset, subs_per_block, unit

FLIP = 0x5A  # XORed into one byte


def flip_last_token(pool, lay: KVLayout, block_ids: Sequence[int], num_tokens: int, layer: int = 0) -> int:
    """Flip one byte of the prompt's last token (K, first local head, ``layer``) in a pool;
    the last token is in every sample of units and inside every sliding window. Returns the
    byte offset."""
    t = num_tokens - 1
    block, within = divmod(t, lay.block_size)
    sub = block_ids[block] * subs_per_block(lay) + within // unit(lay)
    off = offset(lay, sub, layer, 0, 0, within % unit(lay))
    import torch

    raw = pool.tensor.view(-1).view(torch.uint8)
    raw[off] ^= FLIP
    return off


def carried_last_token(lay: KVLayout, spans: Sequence[tuple[int, int, int]]) -> tuple[int, int]:
    """``(layer, tokens)``: a last WRITE of ``(layer group, first token, end token)`` spans is
    sure to carry token ``tokens - 1`` of ``layer``: the end of its last span that reaches the
    WRITE's end, in the last layer of that span's group (-1: every group). With layer-streamed
    push, parts may have taken the prompt's end of the other groups before it; the rendezvous
    never posts a last WRITE without a span (``_last_write``)."""
    end = max(e for _, _, e in spans)
    g = next(g for g, t, e in reversed(spans) if e == end and e > t)
    return (layer_groups(lay)[g][-1] if g >= 0 else lay.num_layers - 1), end


def swap_first_two(block_ids: Sequence[int]) -> tuple[int, ...]:
    """Destination blocks 0 and 1 exchanged: each one's KV lands in the other's place."""
    ids = list(block_ids)
    if len(ids) >= 2:
        ids[0], ids[1] = ids[1], ids[0]
    return tuple(ids)


def truncated(num_tokens: int, start: int, block_size: int) -> int:
    """Tokens a truncated transfer moves: a block fewer (at least one token past ``start``)."""
    return max(start + 1, num_tokens - block_size)
