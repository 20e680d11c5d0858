"""Descriptor grids for NIXL's prepared descriptor lists (pure: no NIXL, no I/O).

A pool is cut into regions, one per (layer group, head group) (``pushkv.kv.layout``);
each region is a dense array of physical sub-blocks of one size. A grid lists one
descriptor per (region, sub-block), region after region, so descriptor ``i`` of a
region starts at index ``first[r] + i``. A writer prepares the grid of its own pool
once and the grid of each peer's pool once per peer (``prep_xfer_dlist``); a transfer
then names descriptors by index (``make_prepped_xfer``), and NIXL joins indices that
are contiguous on both sides back into one descriptor.

``indices`` turns the mapping's merged ``(src, dst, nbytes)`` regions into those
indices, or answers None when a region does not fall on both grids (head runs of a
TP mismatch, token runs of a sub-block mismatch, a run crossing a region edge): the
caller then posts ad-hoc descriptors for that transfer, which moves the same bytes.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import chain
from typing import Optional, Sequence

import numpy as np

from pushkv.kv import layout as L
from pushkv.messages import KVLayoutDesc


@dataclass(frozen=True)
class DescGrid:
    """Regions of one pool: byte offset from the pool base, sub-block bytes, sub-block count."""

    base: np.ndarray  # int64 [regions], ascending
    elem: np.ndarray  # int64 [regions]
    count: np.ndarray  # int64 [regions]
    first: np.ndarray  # int64 [regions]: index of the region's descriptor 0
    # the same as Python lists, for the few-region path (numpy costs ~1 us per call on tiny arrays)
    rows: list = field(init=False, repr=False, compare=False)
    _bases: list[int] = field(init=False, repr=False, compare=False)  # base as a list, for bisect

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", list(zip(self.base.tolist(), self.elem.tolist(), self.count.tolist(),
                                                  self.first.tolist())))
        object.__setattr__(self, "_bases", self.base.tolist())

    def place(self, off: int, n: int) -> Optional[tuple[int, int]]:
        """(descriptor index of the run's start, sub-block bytes) or None if off this grid."""
        r = bisect_right(self._bases, off) - 1
        if r < 0:
            return None
        base, el, count, first = self.rows[r]
        rel = off - base
        if rel % el or n % el or rel + n > count * el:
            return None
        return first + rel // el, el

    @property
    def size(self) -> int:
        return int(self.count.sum())

    def strided(self, pool_base: int, dev_id: int) -> np.ndarray:
        """Nx5 (address, len, device, stride, count) rows: NIXL's compressed list form."""
        rows = np.empty((len(self.base), 5), dtype=np.int64)
        rows[:, 0] = self.base + pool_base
        rows[:, 1] = self.elem
        rows[:, 2] = dev_id
        rows[:, 3] = self.elem
        rows[:, 4] = self.count
        return rows

    def descs(self, pool_base: int, dev_id: int) -> list[tuple[int, int, int]]:
        """The same list expanded, one (address, len, device) per descriptor."""
        out: list[tuple[int, int, int]] = []
        for b, e, c in zip(self.base.tolist(), self.elem.tolist(), self.count.tolist()):
            out.extend((pool_base + b + i * e, e, dev_id) for i in range(c))
        return out


def grid_of(lay: KVLayoutDesc) -> DescGrid:
    base, elem = [], []
    for g in range(len(L.layer_groups(lay))):
        for k in range(L.head_groups(lay)):
            base.append(L.region_base(lay, g, k))
            elem.append(L.region_block_bytes(lay, g))
    count = np.full(len(base), L.phys_blocks(lay), dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    return DescGrid(np.asarray(base, dtype=np.int64), np.asarray(elem, dtype=np.int64), count, first)


def _place(grid: DescGrid, off: np.ndarray, n: np.ndarray):
    """(region, sub-block in region) of each run's start, or None if a run is off the grid."""
    r = np.searchsorted(grid.base, off, side="right") - 1
    if (r < 0).any():
        return None
    rel = off - grid.base[r]
    el = grid.elem[r]
    if (rel % el).any() or (n % el).any() or (rel + n > grid.count[r] * el).any():
        return None
    return r, rel // el


FEW_REGIONS = 8  # up to this, plain Python beats numpy's per-call overhead


def _few(src: DescGrid, dst: DescGrid, regions) -> Optional[tuple[np.ndarray, np.ndarray]]:
    si, di = [], []
    for s, d, n in regions:
        a, b = src.place(s, n), dst.place(d, n)
        if a is None or b is None or a[1] != b[1]:
            return None
        cnt = n // a[1]
        si.append(np.arange(a[0], a[0] + cnt, dtype=np.int32))
        di.append(np.arange(b[0], b[0] + cnt, dtype=np.int32))
    if len(si) == 1:
        return si[0], di[0]
    return np.concatenate(si), np.concatenate(di)


def indices(src: DescGrid, dst: DescGrid, regions: Sequence[tuple[int, int, int]]
            ) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """Descriptor indices (int32, src and dst, pairwise) covering exactly ``regions``;
    None when some region is not whole sub-blocks of one region on both sides."""
    if not regions:
        return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int32)
    if len(regions) <= FEW_REGIONS:
        return _few(src, dst, regions)
    arr = np.fromiter(chain.from_iterable(regions), dtype=np.int64, count=3 * len(regions)).reshape(-1, 3)
    s, d, n = arr[:, 0], arr[:, 1], arr[:, 2]
    ps, pd = _place(src, s, n), _place(dst, d, n)
    if ps is None or pd is None:
        return None
    (rs, is_), (rd, id_) = ps, pd
    if (src.elem[rs] != dst.elem[rd]).any():
        return None
    cnt = n // src.elem[rs]
    total = int(cnt.sum())
    # run k covers cnt[k] consecutive descriptors from its first index on each side
    starts = np.concatenate([[0], np.cumsum(cnt)[:-1]])
    step = np.arange(total, dtype=np.int64) - np.repeat(starts, cnt)
    si = np.repeat(src.first[rs] + is_, cnt) + step
    di = np.repeat(dst.first[rd] + id_, cnt) + step
    return si.astype(np.int32), di.astype(np.int32)


# ---------------------------------------------------------------------------------------
# The whole-region fast path by index: no byte regions, no merge, no search
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IndexPlan:
    """What a (P rank, D rank, heads) pair moves when whole head groups of one sub-block size
    match on both sides (every planned deployment): the grid index of sub-block 0 of each
    region moved, per side, and its sub-block bytes. Built once per peer and heads; a
    transfer is then ``first[:, None] + sub-block ids``, which ``indices(map_transfer(...))``
    equals as a set of pairs (tested), at a fraction of the cost."""

    src: KVLayoutDesc
    dst: KVLayoutDesc
    s_first: np.ndarray  # int64 [regions moved]
    d_first: np.ndarray
    elem: np.ndarray  # int64 [regions moved]: bytes of one sub-block
    windowed: np.ndarray  # bool [regions moved]: the sliding-window layer group's regions
    group: np.ndarray  # int64 [regions moved]: the layer group of each


def index_plan(src: KVLayoutDesc, dst: KVLayoutDesc, heads: Optional[tuple[int, int]] = None
               ) -> Optional[IndexPlan]:
    """The plan, or None when the pair needs the general mapping (head runs, token runs)."""
    from pushkv.protocol.mapping import check_compatible, resolve_heads

    check_compatible(src, dst)
    hs, hc = resolve_heads(src, dst, heads)
    hg = L.group_heads(src)
    if (hc == 0 or L.unit(src) != L.unit(dst) or hg != L.group_heads(dst) or hc % hg
            or L.layer_groups(src) != L.layer_groups(dst)
            or (hs - src.head_start) % hg or (hs - dst.head_start) % hg):
        return None
    js, jd = (hs - src.head_start) // hg, (hs - dst.head_start) // hg
    hgs, hgd = L.head_groups(src), L.head_groups(dst)
    ps, pd = L.phys_blocks(src), L.phys_blocks(dst)
    wg = L.window_group(src)
    s_first, d_first, elem, windowed, group = [], [], [], [], []
    for g in range(len(L.layer_groups(src))):
        for k in range(hc // hg):  # grid_of's order: layer group major, head group minor
            s_first.append((g * hgs + js + k) * ps)
            d_first.append((g * hgd + jd + k) * pd)
            elem.append(L.region_block_bytes(src, g))
            windowed.append(g == wg)
            group.append(g)
    as64 = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    return IndexPlan(src, dst, as64(s_first), as64(d_first), as64(elem), np.asarray(windowed, dtype=bool),
                     as64(group))


def plan_indices(plan: IndexPlan, src_blocks: Sequence[int], dst_blocks: Sequence[int], num_tokens: int,
                 groups: Optional[Sequence[int]] = None) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(src indices, dst indices, bytes, contiguous runs) of one transfer of ``num_tokens``
    tokens from ``src_blocks`` into ``dst_blocks`` (logical block ids, as map_transfer takes);
    ``groups``: only those layer groups' regions (default: all)."""
    from pushkv.protocol.mapping import physical_subs, window_start_sub

    if num_tokens <= 0:
        empty = np.empty(0, dtype=np.int32)
        return empty, empty, 0, 0
    if groups is not None:
        rows = np.isin(plan.group, np.asarray(sorted(set(groups)), dtype=np.int64))
        plan = IndexPlan(plan.src, plan.dst, plan.s_first[rows], plan.d_first[rows], plan.elem[rows],
                         plan.windowed[rows], plan.group[rows])
    sb = physical_subs(plan.src, src_blocks, num_tokens, "src")
    db = physical_subs(plan.dst, dst_blocks, num_tokens, "dst")
    si = plan.s_first[:, None] + sb[None, :]
    di = plan.d_first[:, None] + db[None, :]
    # descriptor runs NIXL will post: each region's table cut where either side jumps
    breaks = int(np.count_nonzero((sb[1:] != sb[:-1] + 1) | (db[1:] != db[:-1] + 1))) if sb.size > 1 else 0
    nregions, nsubs = si.shape
    nbytes = int(plan.elem.sum()) * nsubs
    win = window_start_sub(plan.src, num_tokens)
    if win and plan.windowed.any():  # the window layer group skips the sub-blocks before the window
        keep = np.ones(si.shape, dtype=bool)
        keep[plan.windowed, :win] = False
        si, di = si[keep], di[keep]
        nbytes -= int(plan.elem[plan.windowed].sum()) * win
        w_breaks = int(np.count_nonzero((sb[win + 1:] != sb[win:-1] + 1) | (db[win + 1:] != db[win:-1] + 1)))
        nwin = int(plan.windowed.sum())
        runs = (nregions - nwin) * (1 + breaks) + nwin * (1 + w_breaks)
    else:
        runs = nregions * (1 + breaks)
    return si.ravel().astype(np.int32), di.ravel().astype(np.int32), nbytes, runs
