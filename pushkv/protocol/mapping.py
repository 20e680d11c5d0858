"""Block ids to byte regions between two KV pools, merged into few descriptors.

Each side maps to its own physical layout (``pushkv.kv.layout``: per layer
group ``[num_blocks, group_layers, kv_planes, kv_heads, block_size, head_dim]``);
block sizes and TP head slices may differ. Results are ``(src_offset,
dst_offset, nbytes)`` relative to each pool's base, sorted by source offset,
and merged: regions contiguous on both sides become one. Per-descriptor cost
dominates a WRITE (see DESIGN.md), so the atoms are as large as the two
layouts allow:

- identical geometry (same block size, same local heads, all of them moved):
  one block of one layer group, so N consecutive blocks on both sides are one
  region per group. The final block moves whole, tokens past ``num_tokens``
  included (harmless: D overwrites them while decoding).
- same block size, different head slices: one region per (block, layer, plane)
  covering the moved head range (whole final block too).
- different block sizes: one region per (layer, plane, head, token run), a
  token run being tokens < ``num_tokens`` that stay inside one block on both
  sides.

Sliding-window layers (``window > 0``) move only tokens at positions
>= ``num_tokens - window``, rounded down to a whole source block: their group
skips the blocks before the window, so a hybrid model moves the window tail of
its window layers and everything of its full-attention layers, still as one
region per group for contiguous blocks.
"""
from __future__ import annotations

import gc
from typing import Optional, Sequence, Union

import numpy as np

from pushkv.kv.layout import (blocks_for, group_base, group_block_bytes, head_bytes, layer_groups,
                              layer_place, slab_bytes, token_bytes, window_group)
from pushkv.messages import KVLayoutDesc

Region = tuple[int, int, int]

_MUST_MATCH = ("num_layers", "head_dim", "dtype_bytes", "total_kv_heads", "window", "kv_planes")


def check_compatible(src: KVLayoutDesc, dst: KVLayoutDesc) -> None:
    """Raise ValueError naming the first mismatch that makes a transfer impossible."""
    for name in _MUST_MATCH:
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            raise ValueError(f"incompatible KV layouts: {name} differs (src {a}, dst {b})")
    if _window_layers(src) != _window_layers(dst):
        raise ValueError(
            "incompatible KV layouts: window_layers differs "
            f"(src {sorted(_window_layers(src))}, dst {sorted(_window_layers(dst))})"
        )
    for side, lay in (("src", src), ("dst", dst)):
        if lay.block_size < 1 or lay.kv_heads < 1 or lay.kv_planes < 1:
            raise ValueError(f"{side} layout: block_size, kv_heads and kv_planes must be >= 1")
        if not 0 <= lay.head_start <= lay.head_start + lay.kv_heads <= lay.total_kv_heads:
            raise ValueError(
                f"{side} layout: heads [{lay.head_start}, {lay.head_start + lay.kv_heads}) "
                f"outside total_kv_heads={lay.total_kv_heads}"
            )
        bad = [l for l in lay.window_layers if not 0 <= l < lay.num_layers]
        if bad:
            raise ValueError(f"{side} layout: window_layers {bad} outside num_layers={lay.num_layers}")


def count_blocks(num_tokens: int, block_size: Union[int, KVLayoutDesc]) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (block size or a layout)."""
    bs = block_size.block_size if isinstance(block_size, KVLayoutDesc) else block_size
    return blocks_for(num_tokens, bs)


def total_bytes(regions: Sequence[Region]) -> int:
    return sum(r[2] for r in regions)


def map_transfer(
    src: KVLayoutDesc,
    src_blocks: Sequence[int],
    dst: KVLayoutDesc,
    dst_blocks: Sequence[int],
    num_tokens: int,
    heads: Optional[tuple[int, int]] = None,
) -> list[Region]:
    """Merged ``(src_offset, dst_offset, nbytes)`` regions moving ``num_tokens`` tokens.

    ``heads`` is the global ``(start, count)`` to move; default: the heads both
    sides hold. Only the first ``count_blocks(num_tokens, ...)`` ids of each
    table are used; shorter tables or ids outside a pool raise ValueError.
    """
    check_compatible(src, dst)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    hs, hc = _resolve_heads(src, dst, heads)
    if num_tokens == 0 or hc == 0:
        return []
    sb = _table(src_blocks, count_blocks(num_tokens, src), src.num_blocks, "src")
    db = _table(dst_blocks, count_blocks(num_tokens, dst), dst.num_blocks, "dst")

    win_block = 0  # first src block a window layer needs
    if window_group(src) >= 0:
        win_block = max(0, num_tokens - src.window) // src.block_size
    same_bs = src.block_size == dst.block_size

    if same_bs and src.head_start == dst.head_start and src.kv_heads == dst.kv_heads == hc:
        return _map_group_blocks(src, sb, dst, db, win_block)
    if same_bs:
        return _map_head_ranges(src, sb, dst, db, hs, hc, win_block)
    return _map_token_runs(src, sb, dst, db, num_tokens, hs, hc, win_block)


def _map_group_blocks(src, sb, dst, db, win_block) -> list[Region]:
    """One atom per (block, layer group): the whole-block fast path."""
    wg = window_group(src)
    s_parts, d_parts, n_parts = [], [], []
    for g in range(len(layer_groups(src))):
        first = win_block if g == wg else 0
        sgb, dgb = group_block_bytes(src, g), group_block_bytes(dst, g)
        s_parts.append(group_base(src, g) + sb[first:] * sgb)
        d_parts.append(group_base(dst, g) + db[first:] * dgb)
        n_parts.append(np.full(len(sb) - first, sgb, dtype=np.int64))
    return _merge(np.concatenate(s_parts), np.concatenate(d_parts), np.concatenate(n_parts))


def _layer_places(lay) -> tuple[np.ndarray, np.ndarray]:
    """Per layer: byte offset of block 0, and the stride between block ids."""
    places = [layer_place(lay, l) for l in range(lay.num_layers)]
    return (np.array([p[0] for p in places], dtype=np.int64),
            np.array([p[1] for p in places], dtype=np.int64))


def _map_head_ranges(src, sb, dst, db, hs, hc, win_block) -> list[Region]:
    L, P = src.num_layers, src.kv_planes
    s_base, s_stride = _layer_places(src)
    d_base, d_stride = _layer_places(dst)
    plane = np.arange(P, dtype=np.int64).reshape(1, 1, P)
    s = (s_base + sb[:, None] * s_stride)[:, :, None] + plane * slab_bytes(src) + (hs - src.head_start) * head_bytes(src)
    d = (d_base + db[:, None] * d_stride)[:, :, None] + plane * slab_bytes(dst) + (hs - dst.head_start) * head_bytes(dst)
    keep = np.broadcast_to(_keep_mask(src, len(sb), win_block)[:, :, None], s.shape)  # [blocks, layers, planes]
    n = np.full(s.shape, hc * head_bytes(src), dtype=np.int64)
    return _merge(s[keep], d[keep], n[keep])


def _map_token_runs(src, sb, dst, db, num_tokens, hs, hc, win_block) -> list[Region]:
    sbs, dbs = src.block_size, dst.block_size
    starts = np.union1d(np.arange(0, num_tokens, sbs), np.arange(0, num_tokens, dbs))
    lens = np.diff(np.append(starts, num_tokens))
    sidx, sslot = np.divmod(starts, sbs)
    didx, dslot = np.divmod(starts, dbs)
    tb = token_bytes(src)
    L, P = src.num_layers, src.kv_planes
    s_base, s_stride = _layer_places(src)
    d_base, d_stride = _layer_places(dst)
    plane = np.arange(P, dtype=np.int64).reshape(1, 1, P, 1)
    h = np.arange(hc, dtype=np.int64).reshape(1, 1, 1, hc)
    # [segments, layers] -> byte offset of the segment's first token in that layer
    s_seg = s_base + sb[sidx][:, None] * s_stride + (sslot * tb)[:, None]
    d_seg = d_base + db[didx][:, None] * d_stride + (dslot * tb)[:, None]
    s = s_seg[:, :, None, None] + plane * slab_bytes(src) + (hs - src.head_start + h) * head_bytes(src)
    d = d_seg[:, :, None, None] + plane * slab_bytes(dst) + (hs - dst.head_start + h) * head_bytes(dst)
    n = np.broadcast_to((lens * tb).reshape(-1, 1, 1, 1), s.shape)
    keep = _keep_mask(src, len(sb), win_block)[sidx]  # [segments, layers]
    keep = np.broadcast_to(keep[:, :, None, None], s.shape)
    return _merge(s[keep], d[keep], n[keep])


def _keep_mask(lay, nblocks: int, win_block: int) -> np.ndarray:
    """[src block index, layer] -> whether that (block, layer) must move."""
    keep = np.ones((nblocks, lay.num_layers), dtype=bool)
    windowed = _window_layers(lay)
    if windowed and win_block:
        keep[:win_block, sorted(windowed)] = False
    return keep


def _merge(s: np.ndarray, d: np.ndarray, n: np.ndarray) -> list[Region]:
    """Sort by source offset, then join neighbours contiguous on both sides.

    Two atoms contiguous on both sides are adjacent in source order (source
    regions never overlap), so one sorted pass finds every merge.
    """
    s, d, n = s.ravel(), d.ravel(), n.ravel()
    if s.size == 0:
        return []
    if s.size > 1 and not bool(np.all(s[1:] > s[:-1])):
        order = np.argsort(s, kind="stable")
        s, d, n = s[order], d[order], n[order]
    brk = np.ones(s.size, dtype=bool)
    brk[1:] = (s[:-1] + n[:-1] != s[1:]) | (d[:-1] + n[:-1] != d[1:])
    idx = np.flatnonzero(brk)
    sizes = np.add.reduceat(n, idx)
    # Building ~10^5..10^6 small tuples trips the cyclic GC over and over (3x the
    # cost of the build itself); these tuples hold only ints and cannot form cycles.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return list(zip(s[idx].tolist(), d[idx].tolist(), sizes.tolist()))
    finally:
        if was_enabled:
            gc.enable()


def _resolve_heads(src, dst, heads) -> tuple[int, int]:
    lo = max(src.head_start, dst.head_start)
    hi = min(src.head_start + src.kv_heads, dst.head_start + dst.kv_heads)
    if heads is None:
        return lo, max(0, hi - lo)
    start, count = heads
    if count < 0 or (count and not (lo <= start and start + count <= hi)):
        raise ValueError(
            f"heads [{start}, {start + count}) not held by both sides "
            f"(src [{src.head_start}, {src.head_start + src.kv_heads}), "
            f"dst [{dst.head_start}, {dst.head_start + dst.kv_heads}))"
        )
    return start, count


def _table(ids: Sequence[int], need: int, num_blocks: int, side: str) -> np.ndarray:
    if len(ids) < need:
        raise ValueError(f"{side} block table has {len(ids)} ids, {need} needed")
    arr = np.asarray(ids[:need], dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= num_blocks):
        raise ValueError(f"{side} block id outside pool of {num_blocks}: {arr.min()}..{arr.max()}")
    return arr


def _window_layers(lay: KVLayoutDesc) -> frozenset:
    return frozenset(lay.window_layers) if lay.window > 0 else frozenset()
