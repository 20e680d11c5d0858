"""map_transfer: descriptor counts, and byte-level equality against a token-by-token copy."""
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushkv.kv.layout import block_bytes, expand_table, group_heads, head_bytes, layer_place, pool_bytes
from pushkv.kv.layout import phys_blocks, slab_bytes, unit
from pushkv.messages import KVLayoutDesc
from pushkv.protocol.mapping import check_compatible, count_blocks, map_transfer, total_bytes


def lay(bs=16, nb=64, layers=2, heads=4, start=0, total=4, hd=4, dtb=2, wl=(), window=0, planes=2, sub=0, hg=0):
    return KVLayoutDesc(
        num_blocks=nb, num_layers=layers, block_size=bs, kv_heads=heads, head_start=start,
        total_kv_heads=total, head_dim=hd, dtype_bytes=dtb, window_layers=wl, window=window,
        kv_planes=planes, sub_block=sub, head_group=hg,
    )


def head_view(pool, lay_, layer, head):
    """Writable [sub-block, plane, slot, bytes-of-one-token-row] view of one layer's local
    head, from the layout's byte arithmetic (an independent re-statement of it)."""
    base, stride, hstride = layer_place(lay_, layer)
    g, h = divmod(head, group_heads(lay_))
    tb = lay_.head_dim * lay_.dtype_bytes
    return np.lib.stride_tricks.as_strided(
        pool[base + g * hstride + h * head_bytes(lay_):],
        (phys_blocks(lay_), lay_.kv_planes, unit(lay_), tb), (stride, slab_bytes(lay_), tb, 1))


def view(pool, lay_):
    """Logical copy [sub-block, layer, plane, local head, slot, token row bytes]."""
    return np.stack([np.stack([head_view(pool, lay_, l, h) for h in range(lay_.kv_heads)], axis=2)
                     for l in range(lay_.num_layers)], axis=1)


def apply_regions(src, src_pool, dst, regions):
    """Copy regions into a zeroed dst pool; return (dst pool, bytes-written mask)."""
    out = np.zeros(pool_bytes(dst), np.uint8)
    written = np.zeros(pool_bytes(dst), bool)
    for so, do, n in regions:
        assert n > 0 and so >= 0 and do >= 0
        assert so + n <= pool_bytes(src) and do + n <= pool_bytes(dst)
        out[do:do + n] = src_pool[so:so + n]
        written[do:do + n] = True
    assert int(written.sum()) == total_bytes(regions), "destination regions overlap"
    return out, written


def reference(src, sb, src_pool, dst, db, num_tokens, heads, all_tokens):
    """Token-by-token copy. all_tokens=False: only what must move (window applied);
    True: every token both tables can hold (what a correct over-copy may write)."""
    hs, hc = heads
    out = np.zeros(pool_bytes(dst), np.uint8)
    need = np.zeros(view(out, dst).shape[:-1], bool)
    win = set(src.window_layers) if src.window else set()
    end = min(len(sb) * src.block_size, len(db) * dst.block_size) if all_tokens else num_tokens
    ss, ds = expand_table(src, sb), expand_table(dst, db)
    us, ud = unit(src), unit(dst)
    for layer in range(src.num_layers):
        for h in range(hs, hs + hc):
            sv = head_view(src_pool, src, layer, h - src.head_start)
            dv = head_view(out, dst, layer, h - dst.head_start)
            for t in range(end):
                if not all_tokens and layer in win and t < num_tokens - src.window:
                    continue
                dv[ds[t // ud], :, t % ud] = sv[ss[t // us], :, t % us]
                need[ds[t // ud], layer, :, h - dst.head_start, t % ud] = True
    return out, need


def check_bytes(src, sb, dst, db, num_tokens, heads=None, seed=0):
    """Regions move every required token row, and nothing they write is wrong."""
    rng = np.random.default_rng(seed)
    src_pool = rng.integers(0, 256, pool_bytes(src), dtype=np.uint8)
    regions = map_transfer(src, sb, dst, db, num_tokens, heads)
    if heads is None:
        lo = max(src.head_start, dst.head_start)
        hi = min(src.head_start + src.kv_heads, dst.head_start + dst.kv_heads)
        heads = (lo, hi - lo)
    got, written = apply_regions(src, src_pool, dst, regions)
    must, need = reference(src, sb, src_pool, dst, db, num_tokens, heads, all_tokens=False)
    may, _ = reference(src, sb, src_pool, dst, db, num_tokens, heads, all_tokens=True)
    row_written = view(written, dst)
    assert (row_written.all(-1) == row_written.any(-1)).all(), "a region splits a token row"
    row_written = row_written.all(-1)
    assert not (need & ~row_written).any(), "a required token was not moved"
    gv, mv = view(got, dst), view(must, dst)
    assert np.array_equal(gv[need], mv[need])
    assert np.array_equal(got[written], may[written]), "a region wrote the wrong bytes"
    return regions, row_written


# --- identical geometry: descriptor counts -------------------------------------------------
FAST = [
    # name, src table, dst table, tokens, expected regions
    ("contiguous", [0, 1, 2, 3], [8, 9, 10, 11], 64, 1),
    ("partial_last_block", [0, 1, 2, 3], [8, 9, 10, 11], 50, 1),
    ("dst_fragmented", [0, 1, 2, 3], [8, 9, 20, 21], 64, 2),
    ("both_fragmented_aligned", [0, 1, 5, 6], [8, 9, 20, 21], 64, 2),
    ("misaligned_runs", [0, 1, 2, 5], [3, 7, 8, 9], 64, 3),
    ("reversed_both", [3, 2, 1, 0], [9, 8, 7, 6], 64, 1),  # sorted by src, still one run
    ("interleaved", [0, 2, 4, 6], [1, 3, 5, 7], 64, 4),
    ("extra_ids_ignored", [0, 1, 2, 3, 40], [8, 9, 10, 11, 60], 33, 1),
]


@pytest.mark.parametrize("name,sb,db,n,expected", FAST, ids=[c[0] for c in FAST])
def test_identical_geometry_descriptor_count(name, sb, db, n, expected):
    src = dst = lay()
    regions, _ = check_bytes(src, sb, dst, db, n)
    assert len(regions) == expected
    assert total_bytes(regions) == count_blocks(n, 16) * block_bytes(src)  # whole blocks


def test_identical_geometry_16k_tokens_fast():
    src = dst = lay(bs=16, nb=2048, layers=32, heads=8, total=8, hd=128)
    sb, db = list(range(1024)), list(range(1000, 2024))
    map_transfer(src, sb, dst, db, 16384)
    t = time.perf_counter()
    regions = map_transfer(src, sb, dst, db, 16384)
    assert time.perf_counter() - t < 0.010
    assert regions == [(0, 1000 * block_bytes(src), 1024 * block_bytes(src))]


def test_differing_block_sizes_16k_tokens_under_200ms():
    src, dst = lay(bs=16, nb=2048, layers=8, heads=4, hd=64), lay(bs=32, nb=2048, layers=8, heads=4, hd=64)
    t = time.perf_counter()
    regions = map_transfer(src, list(range(1024)), dst, list(range(512)), 16384)
    assert time.perf_counter() - t < 0.2
    assert total_bytes(regions) == 16384 * 8 * 2 * 4 * 64 * 2


# --- block sizes and head slices: byte-level -----------------------------------------------
BYTES = [
    # name, src layout, src table, dst layout, dst table, tokens, heads
    ("p16_d32", lay(bs=16), [3, 4, 5, 9, 10], lay(bs=32), [7, 2, 3], 70, None),
    ("p32_d16", lay(bs=32), [7, 2, 3], lay(bs=16), [3, 4, 5, 9, 10], 70, None),
    ("p16_d48_uneven", lay(bs=16), list(range(10, 17)), lay(bs=48), [5, 1, 2], 100, None),
    ("p5_d7_odd", lay(bs=5, nb=40), list(range(20)), lay(bs=7, nb=40), list(range(30, 15, -1)), 97, None),
    ("tp_1_to_2_rank1", lay(), [0, 1, 2], lay(heads=2, start=2), [5, 6, 7], 40, None),
    ("tp_2_to_1_rank0", lay(heads=2, start=0), [0, 1, 2], lay(), [5, 6, 7], 40, None),
    ("tp_2_to_4_explicit_heads", lay(heads=2, start=2), [0, 1], lay(heads=1, start=3), [9, 4], 20, (3, 1)),
    ("tp_and_block_size", lay(bs=32, heads=2, start=2), [1, 2], lay(bs=16, heads=1, start=3), [6, 7, 8, 20], 60, None),
    ("sub_range_same_geometry", lay(), [0, 1], lay(), [2, 3], 32, (1, 2)),
]


@pytest.mark.parametrize("name,src,sb,dst,db,n,heads", BYTES, ids=[c[0] for c in BYTES])
def test_bytes_match_token_by_token(name, src, sb, dst, db, n, heads):
    check_bytes(src, sb, dst, db, n, heads)


def test_p16_d32_descriptor_shape():
    # one run per (src block, layer, K/V, head); consecutive odd->even block boundaries merge
    src, dst = lay(bs=16, layers=2, heads=4), lay(bs=32, layers=2, heads=4)
    regions = map_transfer(src, [0, 1, 2, 3], dst, [10, 11], 64)
    atoms = 4 * 2 * 2 * 4
    assert len(regions) == atoms - 1  # src 1|2 joins dst 10|11
    sizes = sorted(n for _, _, n in regions)
    assert sizes == [16 * 4 * 2] * (atoms - 2) + [2 * 16 * 4 * 2]


def test_head_slice_is_one_region_per_block_layer_kv():
    src, dst = lay(heads=4), lay(heads=2, start=2)
    regions = map_transfer(src, [0, 1, 2], dst, [0, 1, 2], 48)
    assert len(regions) == 3 * 2 * 2
    assert {n for _, _, n in regions} == {2 * 16 * 4 * 2}


# --- sliding window --------------------------------------------------------------------------
WINDOW = [
    # name, src, dst, tokens; window layer 1 of 2, window 20 tokens
    ("diff_block_size", lay(bs=16, wl=(1,), window=20), lay(bs=32, wl=(1,), window=20), 90),
    ("head_slice", lay(bs=16, wl=(1,), window=20), lay(bs=16, heads=2, start=2, wl=(1,), window=20), 90),
    ("window_longer_than_prompt", lay(bs=16, wl=(1,), window=200), lay(bs=32, wl=(1,), window=200), 90),
]


@pytest.mark.parametrize("name,src,dst,n", WINDOW, ids=[c[0] for c in WINDOW])
def test_sliding_window_moves_only_window_tokens(name, src, dst, n):
    sb = list(range(count_blocks(n, src)))
    db = list(range(10, 10 + count_blocks(n, dst)))
    _, rows = check_bytes(src, sb, dst, db, n)
    lo = (max(0, n - src.window) // src.block_size) * src.block_size  # rounded to src block
    for i, blk in enumerate(db):
        for slot in range(dst.block_size):
            t = i * dst.block_size + slot
            if t >= n:
                continue
            assert rows[blk, 0, :, :, slot].all(), t  # full-attention layer: every token
            assert rows[blk, 1, :, :, slot].any() == (t >= lo), (t, lo)


def test_identical_geometry_all_window_layers_skips_early_blocks():
    src = dst = lay(bs=16, layers=2, wl=(0, 1), window=20)
    regions, _ = check_bytes(src, list(range(6)), dst, list(range(20, 26)), 90)
    # tokens >= 70 -> src blocks 4, 5
    assert regions == [(4 * block_bytes(src), 24 * block_bytes(src), 2 * block_bytes(src))]


def test_identical_geometry_mixed_window_one_region_per_group():
    # hybrid: layer 0 full, layer 1 windowed -> two groups; the full group moves all six
    # blocks, the window group only the blocks holding tokens >= 70 (src blocks 4, 5)
    src = dst = lay(bs=16, nb=64, layers=2, wl=(1,), window=20)
    regions, _ = check_bytes(src, list(range(6)), dst, list(range(20, 26)), 90)
    gb = block_bytes(src) // 2  # one layer's share of a block
    win_base = 64 * gb  # the window group follows the full group
    assert regions == [(0, 20 * gb, 6 * gb), (win_base + 4 * gb, win_base + 24 * gb, 2 * gb)]


# name, layout kwargs, src table, dst table, tokens, expected regions
HYBRID = [
    ("fresh", dict(layers=4, wl=(0, 2), window=40), list(range(8)), list(range(8)), 120, 2),
    ("fresh_no_window_reach", dict(layers=4, wl=(0, 2), window=400), list(range(8)), list(range(8)), 120, 2),
    ("fragmented_dst", dict(layers=4, wl=(0, 2), window=40), list(range(8)), [0, 1, 2, 9, 10, 11, 12, 30],
     120, 3 + 2),  # full: runs 0-2, 9-12, 30; window (blocks 4..7 -> 10,11,12,30): 2
    ("all_window", dict(layers=2, wl=(0, 1), window=40), list(range(8)), list(range(8)), 120, 1),
]


@pytest.mark.parametrize("name,kw,sb,db,n,expected", HYBRID, ids=[c[0] for c in HYBRID])
def test_hybrid_descriptor_count(name, kw, sb, db, n, expected):
    src = dst = lay(**kw)
    regions, _ = check_bytes(src, sb, dst, db, n)
    assert len(regions) == expected


def test_hybrid_moves_fewer_bytes_than_full():
    full, hyb = lay(layers=4), lay(layers=4, wl=(0, 2), window=40)
    n, t = 120, list(range(8))
    moved = total_bytes(map_transfer(hyb, t, hyb, t, n))
    # full layers: 8 blocks; window layers: blocks from (120 - 40) // 16 = 5 -> 3 blocks
    assert moved == (2 * 8 + 2 * 3) * block_bytes(full) // 4
    assert total_bytes(map_transfer(full, t, full, t, n)) == 8 * block_bytes(full)


# --- MLA-style latent: one plane, one head replicated on every rank -------------------------
MLA = [
    ("same_geometry", lay(planes=1, heads=1, total=1, hd=10), lay(planes=1, heads=1, total=1, hd=10), 1),
    ("p16_d32", lay(planes=1, heads=1, total=1, hd=10), lay(bs=32, planes=1, heads=1, total=1, hd=10), 6 * 2 - 2),
    # 6 src segments x 2 layers; src blocks 1|2 and 3|4 join across dst blocks 3|4 and 4|5
    ("hybrid_p32_d16", lay(bs=32, planes=1, heads=1, total=1, hd=10, wl=(1,), window=30),
     lay(bs=16, planes=1, heads=1, total=1, hd=10, wl=(1,), window=30), None),
]


@pytest.mark.parametrize("name,src,dst,expected", MLA, ids=[c[0] for c in MLA])
def test_mla_latent_bytes(name, src, dst, expected):
    n = 90
    sb = list(range(count_blocks(n, src)))
    db = list(range(3, 3 + count_blocks(n, dst)))
    regions, _ = check_bytes(src, sb, dst, db, n)
    if expected is not None:
        assert len(regions) == expected


def test_kv_planes_mismatch_refused():
    with pytest.raises(ValueError, match="kv_planes"):
        check_compatible(lay(planes=1, heads=1, total=1), lay(planes=2, heads=1, total=1))


# --- sub-blocks and head groups: what a planned deployment cuts its pools into ------------
# name, src, dst, tokens, heads (None: what both hold), expected regions on fresh tables
PLANNED = [
    ("p16_d32_sub16", lay(bs=16), lay(bs=32, sub=16), 150, None, 1),
    ("p32_d16_sub16", lay(bs=32, sub=16), lay(bs=16), 150, None, 1),
    ("p16_d24_sub8", lay(bs=16, sub=8), lay(bs=24, sub=8), 150, None, 1),
    ("tp2_to_1_rank1", lay(heads=2, start=2), lay(hg=2), 150, None, 1),
    ("tp1_to_2_rank1", lay(hg=2), lay(heads=2, start=2), 150, None, 1),
    ("tp2_to_4_rank3", lay(heads=2, start=2, hg=1), lay(heads=1, start=3), 150, (3, 1), 1),
    ("tp4_to_2_rank1", lay(heads=1, start=1), lay(heads=2, start=0, hg=1), 150, (1, 1), 1),
    ("tp2_to_1_p32_d16", lay(bs=32, sub=16, heads=2, start=2), lay(bs=16, hg=2), 150, None, 1),
    ("hybrid_tp1_to_2_p16_d32", lay(hg=2, layers=4, wl=(0, 2), window=40),
     lay(bs=32, sub=16, heads=2, start=2, layers=4, wl=(0, 2), window=40), 150, None, 2),
    ("mla_p16_d32", lay(planes=1, heads=1, total=1), lay(bs=32, sub=16, planes=1, heads=1, total=1), 150, None, 1),
    # unplanned peers still move correct bytes, in smaller pieces
    ("tp2_to_1_no_groups", lay(heads=2, start=2), lay(), 150, None, 10 * 2 * 2),
    ("p16_d32_no_sub", lay(bs=16), lay(bs=32), 48, None, 3 * 2 * 2 * 4 - 1),
]


@pytest.mark.parametrize("name,src,dst,n,heads,expected", PLANNED, ids=[c[0] for c in PLANNED])
def test_planned_geometry_moves_whole_regions(name, src, dst, n, heads, expected):
    sb = list(range(count_blocks(n, src)))
    db = list(range(5, 5 + count_blocks(n, dst)))
    regions, _ = check_bytes(src, sb, dst, db, n, heads)
    assert len(regions) == expected


def test_planned_geometry_fragmented_costs_one_region_per_common_run():
    src, dst = lay(bs=16, nb=64), lay(bs=32, sub=16, nb=64)
    sb = [0, 1, 2, 3, 10, 11, 12, 13, 20, 21]  # 150 tokens: 10 blocks of 16
    db = [7, 8, 30, 31, 40]  # 5 blocks of 32 = sub-blocks 14-17, 60-63, 80-81
    regions, _ = check_bytes(src, sb, dst, db, 150)
    # runs on both sides: src 0-3 | dst 14-17; src 10-13 | dst 60-63; src 20-21 | dst 80-81
    assert len(regions) == 3


def test_sub_block_and_head_group_must_tile():
    with pytest.raises(ValueError, match="sub_block 5 does not divide"):
        map_transfer(lay(bs=16, sub=5), [0], lay(), [0], 4)
    with pytest.raises(ValueError, match="head_group 3 does not divide"):
        map_transfer(lay(hg=3), [0], lay(), [0], 4)


# --- compatibility and bad input -------------------------------------------------------------
INCOMPATIBLE = [
    ("num_layers", dict(layers=3)),
    ("head_dim", dict(hd=8)),
    ("dtype_bytes", dict(dtb=4)),
    ("total_kv_heads", dict(total=8)),
    ("window", dict(wl=(1,), window=16)),
    ("kv_planes", dict(planes=1)),
]


@pytest.mark.parametrize("field,kw", INCOMPATIBLE, ids=[c[0] for c in INCOMPATIBLE])
def test_check_compatible_names_mismatch(field, kw):
    with pytest.raises(ValueError, match=field):
        check_compatible(lay(), lay(**kw))


def test_window_layers_mismatch():
    with pytest.raises(ValueError, match="window_layers"):
        check_compatible(lay(wl=(0,), window=8), lay(wl=(1,), window=8))


def test_block_size_may_differ():
    check_compatible(lay(bs=16), lay(bs=32))


@pytest.mark.parametrize(
    "sb,db,n,heads,msg",
    [
        ([0], [0, 1], 20, None, "src block table has 1"),
        ([0, 1], [0, 64], 20, None, "dst block id outside"),
        ([0, 1], [0, 1], 20, (0, 5), "not held by both"),
        ([0, 1], [0, 1], -1, None, "num_tokens"),
    ],
)
def test_bad_input(sb, db, n, heads, msg):
    with pytest.raises(ValueError, match=msg):
        map_transfer(lay(), sb, lay(), db, n, heads)


def test_empty():
    assert map_transfer(lay(), [], lay(), [], 0) == []
    assert map_transfer(lay(heads=2, start=0), [0], lay(heads=2, start=2), [0], 5) == []  # disjoint heads


@pytest.mark.parametrize("n,bs,expected", [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2)])
def test_count_blocks(n, bs, expected):
    assert count_blocks(n, bs) == expected
    assert count_blocks(n, lay(bs=bs)) == expected


# --- property: regions == token-by-token, no destination overlap ----------------------------
@st.composite
def transfers(draw):
    total = draw(st.sampled_from([1, 2, 4]))
    layers = draw(st.integers(1, 3))
    hd = draw(st.sampled_from([1, 2, 4]))

    def side():
        tp = draw(st.sampled_from([t for t in (1, 2, 4) if t <= total]))
        r = draw(st.integers(0, tp - 1))
        return draw(st.integers(1, 8)), total // tp, r * (total // tp)

    (sbs, sh, ss), (dbs, dh, ds) = side(), side()
    if draw(st.booleans()):
        dbs = sbs  # exercise the same-block-size paths often
    wl, window = (), 0
    planes = draw(st.sampled_from([1, 2]))
    if draw(st.booleans()):
        wl = tuple(sorted(draw(st.sets(st.integers(0, layers - 1), min_size=1))))
        window = draw(st.integers(1, 30))
    nbs, nbd = 24, 24
    n = draw(st.integers(0, min(60, nbs * sbs, nbd * dbs)))

    def divisor(x):  # a sub-block size or head group that tiles x (0 = x itself)
        return draw(st.sampled_from([0] + [k for k in range(1, x + 1) if x % k == 0]))

    src = lay(bs=sbs, nb=nbs, layers=layers, heads=sh, start=ss, total=total, hd=hd, dtb=1, wl=wl,
              window=window, planes=planes, sub=divisor(sbs), hg=divisor(sh))
    dst = lay(bs=dbs, nb=nbd, layers=layers, heads=dh, start=ds, total=total, hd=hd, dtb=1, wl=wl,
              window=window, planes=planes, sub=divisor(dbs), hg=divisor(dh))
    need_s, need_d = count_blocks(n, sbs), count_blocks(n, dbs)
    sb = draw(st.permutations(range(nbs)))[: need_s + draw(st.integers(0, 2))]
    db = draw(st.permutations(range(nbd)))[: need_d + draw(st.integers(0, 2))]
    if draw(st.booleans()):
        sb = sorted(sb)
        db = sorted(db)
    return src, sb, dst, db, n


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transfers())
def test_property_regions_equal_token_copy(t):
    src, sb, dst, db, n = t
    check_bytes(src, sb, dst, db, n)
