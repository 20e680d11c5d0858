"""Prepared descriptor grids (pure): the indices a writer posts move exactly the bytes
the mapping's merged regions name, for every layout of the P/D matrix; planned
layouts always take the prepared path, and what falls off a grid is refused (None)
so that the writer posts ad-hoc descriptors instead."""
from __future__ import annotations

import numpy as np
import pytest

from pushkv.kv import layout as L
from pushkv.protocol.mapping import map_transfer
from pushkv.protocol.tp import head_overlap, producers_for
from pushkv.transport.grid import grid_of, index_plan, indices, plan_indices
from tools.layout_report import MATRIX, fragmented_table

NUM_BLOCKS = 48


def _layouts(combo, planned: bool):
    cfg = combo.config(NUM_BLOCKS)
    out = []
    for inst in (cfg.prefill, cfg.decode):
        if planned:
            out.append([L.instance_layout(cfg, inst, r) for r in range(inst.tp)])
        else:
            out.append([L.layout_for(cfg.model, inst.tp, r, inst.num_blocks, inst.block_size)
                        for r in range(inst.tp)])
    return out


def _apply(pairs, src: np.ndarray, dst: np.ndarray) -> None:
    for s, d, n in pairs:
        dst[d:d + n] = src[s:s + n]


def _tables(combo, n: int, fragmented: bool):
    if fragmented:
        return (fragmented_table(NUM_BLOCKS, 2, L.blocks_for(n, combo.p_bs)),
                fragmented_table(NUM_BLOCKS, 3, L.blocks_for(n, combo.d_bs)))
    return list(range(3, 3 + L.blocks_for(n, combo.p_bs))), list(range(L.blocks_for(n, combo.d_bs)))


def _rank_pairs(combo, total: int):
    """(P rank, D rank, global heads moved) of every pair that moves KV."""
    for d in range(combo.d_tp):
        for p in producers_for(d, combo.d_tp, combo.p_tp, total):
            heads = head_overlap(p, combo.p_tp, d, combo.d_tp, total)
            if heads is not None:
                yield p, d, heads


def _pairs(combo, planned: bool, n: int, fragmented: bool):
    p_lays, d_lays = _layouts(combo, planned)
    total = p_lays[0].total_kv_heads
    pt, dt = _tables(combo, n, fragmented)
    for p, d, heads in _rank_pairs(combo, total):
        yield p_lays[p], d_lays[d], map_transfer(p_lays[p], pt, d_lays[d], dt, n, heads)


@pytest.mark.parametrize("combo", MATRIX, ids=[c.name for c in MATRIX])
@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
@pytest.mark.parametrize("n,fragmented", [(1, False), (37, True), (200, False), (200, True)])
def test_indices_move_the_mapped_bytes(combo, planned, n, fragmented):
    rng = np.random.default_rng(n)
    for p_lay, d_lay, regions in _pairs(combo, planned, n, fragmented):
        gs, gd = grid_of(p_lay), grid_of(d_lay)
        assert gs.size == len(gs.descs(0, 0)) == L.phys_blocks(p_lay) * len(gs.base)
        assert gs.base[-1] + gs.elem[-1] * gs.count[-1] == L.pool_bytes(p_lay)  # the grid tiles the pool
        idx = indices(gs, gd, regions)
        if planned:  # what a deployment runs: always by index
            assert idx is not None, combo.name
        if idx is None:
            continue
        sd, dd = gs.descs(0, 0), gd.descs(0, 0)
        by_index = [(sd[i][0], dd[j][0], sd[i][1]) for i, j in zip(idx[0].tolist(), idx[1].tolist())]
        assert all(sd[i][1] == dd[j][1] for i, j in zip(idx[0].tolist(), idx[1].tolist()))
        assert sum(x[2] for x in by_index) == sum(r[2] for r in regions)
        src = rng.integers(0, 255, L.pool_bytes(p_lay), dtype=np.uint8)
        want, got = np.zeros(L.pool_bytes(d_lay), np.uint8), np.zeros(L.pool_bytes(d_lay), np.uint8)
        _apply(regions, src, want)
        _apply(by_index, src, got)
        assert np.array_equal(want, got)


def test_contiguous_blocks_are_contiguous_indices():
    """A run of blocks contiguous on both sides is a run of indices (NIXL joins it into one)."""
    combo = MATRIX[0]
    p_lays, d_lays = _layouts(combo, True)
    regions = map_transfer(p_lays[0], list(range(4, 14)), d_lays[0], list(range(20, 25)), 160)
    assert len(regions) == len(L.layer_groups(p_lays[0]))  # one per region (layer group, head group)
    for region in regions:
        si, di = indices(grid_of(p_lays[0]), grid_of(d_lays[0]), [region])
        assert len(si) == 10 * L.subs_per_block(p_lays[0]) and np.all(np.diff(si) == 1) and np.all(np.diff(di) == 1)


@pytest.mark.parametrize("regions", [
    [(0, 0, 3)],  # part of a sub-block
    [(7, 0, None)],  # off the source grid
    [(0, 5, None)],  # off the destination grid
    [(-1, 0, None)],  # before the pool
])
def test_off_grid_regions_are_refused(regions):
    combo = MATRIX[0]
    p_lays, d_lays = _layouts(combo, True)
    gs, gd = grid_of(p_lays[0]), grid_of(d_lays[0])
    regions = [(s, d, n if n is not None else int(gs.elem[0])) for s, d, n in regions]
    assert indices(gs, gd, regions) is None


def test_run_past_the_pool_is_refused():
    combo = MATRIX[0]
    p_lays, d_lays = _layouts(combo, True)
    gs, gd = grid_of(p_lays[0]), grid_of(d_lays[0])
    last = int(gs.base[-1] + gs.elem[-1] * (gs.count[-1] - 1))
    assert indices(gs, gd, [(last, 0, int(gs.elem[-1]))]) is not None
    assert indices(gs, gd, [(last, 0, 2 * int(gs.elem[-1]))]) is None


@pytest.mark.parametrize("combo", MATRIX, ids=[c.name for c in MATRIX])
@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
@pytest.mark.parametrize("n,fragmented", [(1, False), (37, True), (200, False), (200, True)])
def test_index_plan_equals_mapped_indices(combo, planned, n, fragmented):
    """The writer's fast path (indices straight from block ids) names exactly the (src, dst)
    descriptor pairs of indices(map_transfer(...)), bytes included; planned layouts always
    take it, and a pair it cannot serve answers None (the general mapping then runs)."""
    p_lays, d_lays = _layouts(combo, planned)
    total = p_lays[0].total_kv_heads
    pt, dt = _tables(combo, n, fragmented)
    for p, d, heads in _rank_pairs(combo, total):
        plan = index_plan(p_lays[p], d_lays[d], heads)
        regions = map_transfer(p_lays[p], pt, d_lays[d], dt, n, heads)
        want = indices(grid_of(p_lays[p]), grid_of(d_lays[d]), regions)
        if plan is None:
            assert not planned, f"{combo.name}: a planned pair fell off the fast path"
            continue
        si, di, nbytes, runs = plan_indices(plan, pt, dt, n)
        assert want is not None
        assert sorted(zip(si.tolist(), di.tolist())) == sorted(zip(want[0].tolist(), want[1].tolist()))
        assert nbytes == sum(r[2] for r in regions)
        assert 1 <= runs <= len(si)


def test_index_plan_checks_the_tables():
    combo = MATRIX[0]
    p_lays, d_lays = _layouts(combo, True)
    plan = index_plan(p_lays[0], d_lays[0])
    with pytest.raises(ValueError, match="block table"):
        plan_indices(plan, [0], [0], 10 * combo.p_bs)
    with pytest.raises(ValueError, match="outside pool"):
        plan_indices(plan, [NUM_BLOCKS + 5], [0], 1)


@pytest.mark.parametrize("combo", [c for c in MATRIX if c.model != "hybrid"], ids=lambda c: c.name)
@pytest.mark.parametrize("n,fragmented", [(37, True), (200, False)])
def test_layer_groups_move_apart_what_the_whole_moves(combo, n, fragmented):
    """Layer-streamed push: pools cut into layer groups; each group's WRITE (mapped regions and
    planned indices alike) moves its own layers' bytes, and the groups together move exactly
    what one whole WRITE moves, with nothing moved twice."""
    import msgspec

    cfg = combo.config(NUM_BLOCKS)
    cfg = msgspec.structs.replace(cfg, mode="push", push_stream="layer", push_stream_groups=3)
    p_lays = [L.instance_layout(cfg, cfg.prefill, r) for r in range(cfg.prefill.tp)]
    d_lays = [L.instance_layout(cfg, cfg.decode, r) for r in range(cfg.decode.tp)]
    groups = L.layer_groups(p_lays[0])
    assert len(groups) == min(3, cfg.model.num_layers) and sorted(sum(groups, ())) == list(range(cfg.model.num_layers))
    total = p_lays[0].total_kv_heads
    pt, dt = _tables(combo, n, fragmented)
    for p, d, heads in _rank_pairs(combo, total):
        whole = map_transfer(p_lays[p], pt, d_lays[d], dt, n, heads)
        parts = [map_transfer(p_lays[p], pt, d_lays[d], dt, n, heads, (g,)) for g in range(len(groups))]
        src = np.arange(L.pool_bytes(p_lays[p]), dtype=np.int64)
        a = np.full(L.pool_bytes(d_lays[d]), -1, dtype=np.int64)
        b = a.copy()
        _apply(whole, src, a)
        for g, regions in enumerate(parts):
            assert regions, (combo.name, g)
            mine = np.zeros(len(b), dtype=bool)
            for _, dd, k in regions:
                assert not mine[dd:dd + k].any()  # nothing twice within a group
                mine[dd:dd + k] = True
            assert not (b[mine] >= 0).any(), "two groups wrote the same bytes"
            _apply(regions, src, b)
        assert np.array_equal(a, b), combo.name
        plan = index_plan(p_lays[p], d_lays[d], heads)
        if plan is None:
            continue
        si, di, nbytes, _ = plan_indices(plan, pt, dt, n)
        got = [plan_indices(plan, pt, dt, n, (g,)) for g in range(len(groups))]
        assert sum(x[2] for x in got) == nbytes == sum(r[2] for r in whole)
        pairs = sorted(pr for x in got for pr in zip(x[0].tolist(), x[1].tolist()))
        assert pairs == sorted(zip(si.tolist(), di.tolist()))
