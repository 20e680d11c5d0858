"""Physical layout of one rank's KV pool.

The pool is one tensor ``[num_blocks, num_layers, 2, kv_heads, block_size, head_dim]``:
block-major across layers, so one block of one request is a single contiguous
region of ``block_bytes`` and a run of consecutive blocks is one descriptor.
Head-major inside a (layer, K/V) slab so that a tensor-parallel head slice is
contiguous per (block, layer, K/V).
"""
from __future__ import annotations

from pushkv.messages import KVLayoutDesc

KVLayout = KVLayoutDesc  # the wire struct is the layout; helpers below


def pool_shape(lay: KVLayout) -> tuple[int, ...]:
    return (lay.num_blocks, lay.num_layers, 2, lay.kv_heads, lay.block_size, lay.head_dim)


def token_bytes(lay: KVLayout) -> int:
    """Bytes of one token of one head in one (layer, K/V) slab."""
    return lay.head_dim * lay.dtype_bytes


def head_bytes(lay: KVLayout) -> int:
    """Bytes of one head of one block in one (layer, K/V) slab."""
    return lay.block_size * token_bytes(lay)


def slab_bytes(lay: KVLayout) -> int:
    """Bytes of one (block, layer, K/V) slab: all local heads."""
    return lay.kv_heads * head_bytes(lay)


def block_bytes(lay: KVLayout) -> int:
    return lay.num_layers * 2 * slab_bytes(lay)


def pool_bytes(lay: KVLayout) -> int:
    return lay.num_blocks * block_bytes(lay)


def offset(lay: KVLayout, block: int, layer: int = 0, kv: int = 0, head: int = 0, token: int = 0) -> int:
    """Byte offset of (block, layer, K/V, local head, token-in-block) from the pool base."""
    return (
        block * block_bytes(lay)
        + (layer * 2 + kv) * slab_bytes(lay)
        + head * head_bytes(lay)
        + token * token_bytes(lay)
    )


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def layout_for(model, tp: int, rank: int, num_blocks: int, block_size: int) -> KVLayout:
    """This rank's pool layout for a ModelConfig (no weights needed)."""
    from pushkv.protocol.tp import rank_heads

    head_start, kv_heads = rank_heads(tp, rank, model.num_kv_heads)
    return KVLayout(
        num_blocks=num_blocks, num_layers=model.num_layers, block_size=block_size,
        kv_heads=kv_heads, head_start=head_start, total_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, dtype_bytes=model.dtype_bytes,
        window_layers=tuple(model.window_layers) if model.sliding_window else (),
        window=model.sliding_window,
    )
