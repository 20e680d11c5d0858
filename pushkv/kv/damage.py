"""Damage to the KV a transfer moves, for fault-injection tests of ``--kv-verify`` only.

Each is done by a writer (or P's worker, right after summing what it stored) when its
``faults.fire`` point was armed: it models what a faulty link, NIC, memory or peer could do
to the bytes, which nothing but the checksums sees.
"""
from __future__ import annotations

from typing import Sequence

from pushkv.kv.layout import KVLayout, offset, subs_per_block, unit

FLIP = 0x5A  # XORed into one byte


def flip_last_token(pool, lay: KVLayout, block_ids: Sequence[int], num_tokens: int) -> int:
    """Flip one byte of the prompt's last token (layer 0, K, first local head) in a pool;
    the last token is in every sample of units and inside every sliding window. Returns the
    byte offset."""
    t = num_tokens - 1
    block, within = divmod(t, lay.block_size)
    sub = block_ids[block] * subs_per_block(lay) + within // unit(lay)
    off = offset(lay, sub, 0, 0, 0, within % unit(lay))
    import torch

    raw = pool.tensor.view(-1).view(torch.uint8)
    raw[off] ^= FLIP
    return off


def swap_first_two(block_ids: Sequence[int]) -> tuple[int, ...]:
    """Destination blocks 0 and 1 exchanged: each one's KV lands in the other's place."""
    ids = list(block_ids)
    if len(ids) >= 2:
        ids[0], ids[1] = ids[1], ids[0]
    return tuple(ids)


def truncated(num_tokens: int, start: int, block_size: int) -> int:
    """Tokens a truncated transfer moves: a block fewer (at least one token past ``start``)."""
    return max(start + 1, num_tokens - block_size)
