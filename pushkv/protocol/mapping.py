"""Block ids to byte regions between two KV pools, merged into few descriptors.

Each side maps to its own physical layout (``pushkv.kv.layout``: regions per
(layer group, head group), blocks cut into sub-blocks); block sizes, sub-blocks,
head groups and TP head slices may all differ. Results are ``(src_offset,
dst_offset, nbytes)`` relative to each pool's base, sorted by source offset, and
merged: regions contiguous on both sides become one. Per-descriptor cost
dominates a WRITE (docs/design.md), so the atoms are as large as the two layouts
allow:

- same sub-block size, and the moved heads are whole head groups of the same
  size on both sides (what a planned P/D deployment always has, see
  ``layout.transfer_geometry``): one sub-block of one region, so a run of
  consecutive blocks on both sides is one descriptor per region moved. The final
  sub-block moves whole, tokens past ``num_tokens`` included (harmless: D
  overwrites them while decoding).
- same sub-block size otherwise: one region per (sub-block, layer, plane, head
  run), a head run being heads inside one head group on both sides.
- different sub-block sizes: one region per (layer, plane, head, token run), a
  token run being tokens < ``num_tokens`` inside one sub-block on both sides.

Sliding-window layers (``window > 0``) move only tokens at positions
>= ``num_tokens - window``, rounded down to a whole source sub-block: the window
layer group skips the sub-blocks before the window.

``groups`` (layer-streamed push) moves only those layer groups of the source's
``layer_groups``; when both sides cut their layers alike a group is whole regions.
"""
from __future__ import annotations

import gc
from typing import Optional, Sequence, Union

import numpy as np

from pushkv.kv.layout import (
    blocks_for,
    group_heads,
    head_bytes,
    layer_groups,
    layer_place,
    region_base,
    region_block_bytes,
    slab_bytes,
    token_bytes,
    unit,
    window_group,
)
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
        if lay.sub_block < 0 or lay.block_size % unit(lay):
            raise ValueError(f"{side} layout: sub_block {lay.sub_block} does not divide block_size {lay.block_size}")
        if lay.head_group < 0 or lay.kv_heads % group_heads(lay):
            raise ValueError(f"{side} layout: head_group {lay.head_group} does not divide kv_heads {lay.kv_heads}")
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
    groups: Optional[Sequence[int]] = None,
) -> list[Region]:
    """Merged ``(src_offset, dst_offset, nbytes)`` regions moving ``num_tokens`` tokens.

    ``heads`` is the global ``(start, count)`` to move; default: the heads both
    sides hold. ``groups``: only these layer groups of ``src`` (default: every layer).
    Tables name logical blocks; only the first
    ``count_blocks(num_tokens, ...)`` ids of each are used; shorter tables or ids
    outside a pool raise ValueError.
    """
    check_compatible(src, dst)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    hs, hc = resolve_heads(src, dst, heads)
    if num_tokens == 0 or hc == 0:
        return []
    sb = physical_subs(src, src_blocks, num_tokens, "src")
    db = physical_subs(dst, dst_blocks, num_tokens, "dst")
    win_sub = window_start_sub(src, num_tokens)
    layers = selected_layers(src, groups)
    if unit(src) == unit(dst):
        hg = group_heads(src)
        if (hg == group_heads(dst) and hc % hg == 0 and layer_groups(src) == layer_groups(dst)
                and (hs - src.head_start) % hg == 0 and (hs - dst.head_start) % hg == 0):
            return _map_regions(src, sb, dst, db, hs, hc, win_sub, groups)
        return _map_head_runs(src, sb, dst, db, hs, hc, win_sub, layers)
    return _map_token_runs(src, sb, dst, db, num_tokens, hs, hc, win_sub, layers)


def selected_layers(lay: KVLayoutDesc, groups: Optional[Sequence[int]]) -> Optional[frozenset]:
    """The layers of ``groups`` (indices into ``layer_groups(lay)``); None: every layer."""
    if groups is None:
        return None
    cut = layer_groups(lay)
    bad = [g for g in groups if not 0 <= g < len(cut)]
    if bad:
        raise ValueError(f"layer groups {bad} outside the {len(cut)} of the source layout")
    return frozenset(l for g in groups for l in cut[g])


def physical_subs(lay: KVLayoutDesc, blocks: Sequence[int], num_tokens: int, side: str) -> np.ndarray:
    """Physical sub-block ids holding the first ``num_tokens`` tokens of a block table
    (ValueError for a short table or ids outside the pool)."""
    return _subs(lay, _table(blocks, count_blocks(num_tokens, lay), lay.num_blocks, side), num_tokens)


def window_start_sub(src: KVLayoutDesc, num_tokens: int) -> int:
    """First source sub-block a sliding-window layer needs (0: all of them, or no window)."""
    if window_group(src) < 0:
        return 0
    return max(0, num_tokens - src.window) // unit(src)


def _map_regions(src, sb, dst, db, hs, hc, win_sub, groups=None) -> list[Region]:
    """One atom per (sub-block, layer group, head group): the whole-region fast path."""
    wg, hg = window_group(src), group_heads(src)
    js, jd = (hs - src.head_start) // hg, (hs - dst.head_start) // hg
    s_parts, d_parts, n_parts = [], [], []
    for g in range(len(layer_groups(src))) if groups is None else sorted(set(groups)):
        first = win_sub if g == wg else 0
        rb = region_block_bytes(src, g)  # == dst's: same layers, planes, heads, sub-block
        for k in range(hc // hg):
            s_parts.append(region_base(src, g, js + k) + sb[first:] * rb)
            d_parts.append(region_base(dst, g, jd + k) + db[first:] * rb)
            n_parts.append(np.full(len(sb) - first, rb, dtype=np.int64))
    if not s_parts:
        return []
    return _merge(np.concatenate(s_parts), np.concatenate(d_parts), np.concatenate(n_parts))


def _head_runs(src, dst, hs, hc) -> list[tuple[int, int]]:
    """[hs, hs + hc) cut at both sides' head-group edges: (first head, count) per run."""
    cuts = {hs, hs + hc}
    for lay in (src, dst):
        g = group_heads(lay)
        cuts.update(h for h in range(lay.head_start, lay.head_start + lay.kv_heads + 1, g) if hs < h < hs + hc)
    edges = sorted(cuts)
    return [(a, b - a) for a, b in zip(edges, edges[1:])]


def _head_addr(lay, head: int) -> tuple[int, int]:
    """Global head -> (head group index, bytes into the group's slab)."""
    g, h = divmod(head - lay.head_start, group_heads(lay))
    return g, h * head_bytes(lay)


def _map_head_runs(src, sb, dst, db, hs, hc, win_sub, layers=None) -> list[Region]:
    P = src.kv_planes
    sp, dp = _layer_places(src), _layer_places(dst)
    plane = np.arange(P, dtype=np.int64).reshape(1, 1, P)
    keep = _keep_mask(src, len(sb), win_sub, layers)[:, :, None]  # [sub-blocks, layers, 1]
    s_all, d_all, n_all = [], [], []
    for h0, cnt in _head_runs(src, dst, hs, hc):
        (gs, os_), (gd, od) = _head_addr(src, h0), _head_addr(dst, h0)
        s = (sp[0] + gs * sp[2] + sb[:, None] * sp[1])[:, :, None] + plane * slab_bytes(src) + os_
        d = (dp[0] + gd * dp[2] + db[:, None] * dp[1])[:, :, None] + plane * slab_bytes(dst) + od
        k = np.broadcast_to(keep, s.shape)
        s_all.append(s[k])
        d_all.append(d[k])
        n_all.append(np.full(int(k.sum()), cnt * head_bytes(src), dtype=np.int64))
    return _merge(np.concatenate(s_all), np.concatenate(d_all), np.concatenate(n_all))


def _map_token_runs(src, sb, dst, db, num_tokens, hs, hc, win_sub, layers=None) -> list[Region]:
    us, ud = unit(src), unit(dst)
    starts = np.union1d(np.arange(0, num_tokens, us), np.arange(0, num_tokens, ud))
    lens = np.diff(np.append(starts, num_tokens))
    sidx, sslot = np.divmod(starts, us)
    didx, dslot = np.divmod(starts, ud)
    tb = token_bytes(src)
    P = src.kv_planes
    sp, dp = _layer_places(src), _layer_places(dst)
    plane = np.arange(P, dtype=np.int64).reshape(1, 1, P, 1)
    s_hg, s_head = np.array([_head_addr(src, h) for h in range(hs, hs + hc)], dtype=np.int64).T
    d_hg, d_head = np.array([_head_addr(dst, h) for h in range(hs, hs + hc)], dtype=np.int64).T
    # [segments, layers, 1, heads] -> byte offset of the segment's first token
    s_seg = (sp[0] + sb[sidx][:, None] * sp[1] + (sslot * tb)[:, None])[:, :, None, None] \
        + s_hg[None, None, None, :] * sp[2][None, :, None, None] + s_head[None, None, None, :]
    d_seg = (dp[0] + db[didx][:, None] * dp[1] + (dslot * tb)[:, None])[:, :, None, None] \
        + d_hg[None, None, None, :] * dp[2][None, :, None, None] + d_head[None, None, None, :]
    s = s_seg + plane * slab_bytes(src)
    d = d_seg + plane * slab_bytes(dst)
    n = np.broadcast_to((lens * tb).reshape(-1, 1, 1, 1), s.shape)
    keep = _keep_mask(src, len(sb), win_sub, layers)[sidx]  # [segments, layers]
    keep = np.broadcast_to(keep[:, :, None, None], s.shape)
    return _merge(s[keep], d[keep], n[keep])


def _layer_places(lay) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer: offset of sub-block 0 (head group 0), sub-block stride, head-group stride."""
    places = [layer_place(lay, l) for l in range(lay.num_layers)]
    first, stride, group_stride = (np.array([p[i] for p in places], dtype=np.int64) for i in range(3))
    return first, stride, group_stride


def _subs(lay, logical: np.ndarray, num_tokens: int) -> np.ndarray:
    """Physical sub-block ids holding the first num_tokens tokens."""
    m = lay.block_size // unit(lay)
    if m > 1:
        logical = (logical[:, None] * m + np.arange(m, dtype=np.int64)).ravel()
    return logical[:blocks_for(num_tokens, unit(lay))]


def _keep_mask(lay, nsubs: int, win_sub: int, layers: Optional[frozenset] = None) -> np.ndarray:
    """[src sub-block index, layer] -> whether that (sub-block, layer) must move."""
    keep = np.ones((nsubs, lay.num_layers), dtype=bool)
    if layers is not None:
        keep[:, sorted(set(range(lay.num_layers)) - layers)] = False
    windowed = _window_layers(lay)
    if windowed and win_sub:
        keep[:win_sub, sorted(windowed)] = False
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


def resolve_heads(src, dst, heads) -> tuple[int, int]:
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
