"""Physical layout of one rank's KV pool.

Layers are split into **groups** by attention kind: one group when every
layer attends the same way, two (full-attention layers, then sliding-window
layers) for a hybrid model. Each group is one region of the pool,
``[num_blocks, group_layers, kv_planes, kv_heads, block_size, head_dim]``, and
the regions follow each other (full group first). A block id names the same
block in every group. Within a group the layout is block-major across layers,
so one block of one request is a single contiguous region per group and a run
of consecutive blocks is one descriptor per group; a sliding-window group can
move only the blocks inside the window and still stay one descriptor.
Head-major inside a (layer, plane) slab, so a tensor-parallel head slice is
contiguous per (block, layer, plane).

``kv_planes`` is 2 (K and V) for GQA/MHA; 1 for an MLA-style latent cache,
whose one "head" (``total_kv_heads == 1``) every TP rank holds in full.

With one group, the pool tensor is 6-d, ``pool_shape(lay)``; with two it is
flat and ``layer_views`` gives each layer's ``[blocks, planes, heads, block,
head_dim]`` view (it works on either).
"""
from __future__ import annotations

from functools import lru_cache

from pushkv.messages import KVLayoutDesc

KVLayout = KVLayoutDesc  # the wire struct is the layout; helpers below


def layer_groups(lay: KVLayout) -> tuple[tuple[int, ...], ...]:
    """Layers of each group, in pool order: full attention first, then sliding window."""
    return _groups(lay.num_layers, tuple(lay.window_layers) if lay.window > 0 else ())


@lru_cache(maxsize=256)
def _groups(num_layers: int, window_layers: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    win = set(window_layers)
    full = tuple(l for l in range(num_layers) if l not in win)
    windowed = tuple(l for l in range(num_layers) if l in win)
    return tuple(g for g in (full, windowed) if g)


def window_group(lay: KVLayout) -> int:
    """Index of the sliding-window group, or -1 when no layer uses the window."""
    if lay.window <= 0 or not lay.window_layers:
        return -1
    return len(layer_groups(lay)) - 1


def pool_shape(lay: KVLayout) -> tuple[int, ...]:
    if len(layer_groups(lay)) == 1:
        return (lay.num_blocks, lay.num_layers, lay.kv_planes, lay.kv_heads, lay.block_size, lay.head_dim)
    return (pool_bytes(lay) // lay.dtype_bytes,)


def token_bytes(lay: KVLayout) -> int:
    """Bytes of one token of one head in one (layer, plane) slab."""
    return lay.head_dim * lay.dtype_bytes


def head_bytes(lay: KVLayout) -> int:
    """Bytes of one head of one block in one (layer, plane) slab."""
    return lay.block_size * token_bytes(lay)


def slab_bytes(lay: KVLayout) -> int:
    """Bytes of one (block, layer, plane) slab: all local heads."""
    return lay.kv_heads * head_bytes(lay)


def layer_bytes(lay: KVLayout) -> int:
    """Bytes of one layer of one block: every plane."""
    return lay.kv_planes * slab_bytes(lay)


def block_bytes(lay: KVLayout) -> int:
    """Bytes one block id holds, summed over every group."""
    return lay.num_layers * layer_bytes(lay)


def group_block_bytes(lay: KVLayout, group: int) -> int:
    """Bytes of one block inside one group (the stride between block ids there)."""
    return len(layer_groups(lay)[group]) * layer_bytes(lay)


def group_base(lay: KVLayout, group: int) -> int:
    """Byte offset of a group's region from the pool base."""
    return lay.num_blocks * sum(group_block_bytes(lay, g) for g in range(group))


def pool_bytes(lay: KVLayout) -> int:
    return lay.num_blocks * block_bytes(lay)


def layer_place(lay: KVLayout, layer: int) -> tuple[int, int]:
    """``(byte offset of block 0 of this layer, stride between block ids)``."""
    for g, layers in enumerate(layer_groups(lay)):
        if layer in layers:
            gbb = group_block_bytes(lay, g)
            return group_base(lay, g) + layers.index(layer) * layer_bytes(lay), gbb
    raise ValueError(f"layer {layer} outside num_layers={lay.num_layers}")


def offset(lay: KVLayout, block: int, layer: int = 0, kv: int = 0, head: int = 0, token: int = 0) -> int:
    """Byte offset of (block, layer, plane, local head, token-in-block) from the pool base."""
    base, stride = layer_place(lay, layer)
    return base + block * stride + kv * slab_bytes(lay) + head * head_bytes(lay) + token * token_bytes(lay)


def layer_views(pool, lay: KVLayout) -> list:
    """Per-layer ``[blocks, planes, heads, block_size, head_dim]`` views of a pool tensor
    (6-d or flat, contiguous, element type of the model)."""
    flat = pool.reshape(-1)
    if flat.numel() * flat.element_size() != pool_bytes(lay):
        raise ValueError(f"pool of {flat.numel() * flat.element_size()} B does not match layout "
                         f"({pool_bytes(lay)} B)")
    esz = flat.element_size()
    hd, bs, heads = lay.head_dim, lay.block_size, lay.kv_heads
    views = []
    for layer in range(lay.num_layers):
        base, stride = layer_place(lay, layer)
        views.append(flat.as_strided(
            (lay.num_blocks, lay.kv_planes, heads, bs, hd),
            (stride // esz, slab_bytes(lay) // esz, bs * hd, hd, 1),
            flat.storage_offset() + base // esz))
    return views


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def layout_for(model, tp: int, rank: int, num_blocks: int, block_size: int) -> KVLayout:
    """This rank's pool layout for a ModelConfig (no weights needed)."""
    from pushkv.protocol.tp import rank_heads

    total = model.cache_kv_heads
    head_start, kv_heads = rank_heads(tp, rank, total)
    return KVLayout(
        num_blocks=num_blocks, num_layers=model.num_layers, block_size=block_size,
        kv_heads=kv_heads, head_start=head_start, total_kv_heads=total,
        head_dim=model.cache_head_dim, dtype_bytes=model.dtype_bytes,
        window_layers=tuple(sorted(model.window_layers)) if model.sliding_window else (),
        window=model.sliding_window if model.window_layers else 0,
        kv_planes=model.kv_planes,
    )
