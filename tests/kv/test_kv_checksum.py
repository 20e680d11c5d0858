"""--kv-verify's checksums (pushkv/kv/checksum.py): the pure parts as tables, and the torch
sums over real pools cut as P and D cut them (TP mismatch, different block sizes, a hybrid
sliding window, an MLA latent): P's rows and D's agree on the same KV, and a flipped byte,
two swapped blocks or a missing block on D's side are each caught."""
import math

import msgspec
import pytest
import torch

from pushkv import messages as m
from pushkv.config import preset
from pushkv.kv import checksum as C
from pushkv.kv import layout as L


# ------------------------------------------------------------------ pure
def test_mix_matches_tensor_weights():
    w = C.weights(3, 2, 8, 5)
    flat = w.reshape(-1).tolist()
    base = 3 * 2 * 8 * 5
    assert flat == [C.mix(base + i) for i in range(len(flat))]
    assert all(x & 1 for x in flat)  # odd: any change of one word changes the sum
    assert len(set(flat)) == len(flat)


@pytest.mark.parametrize("mode,tokens,unit_tokens,salt,want", [
    ("off", 100, 16, 0, ()),
    ("full", 100, 16, 0, tuple(range(7))),
    ("full", 16, 16, 0, (0,)),
    ("sample", 40, 16, 5, (0, 1, 2)),  # few units: all of them
    ("sample", 0, 16, 5, ()),
])
def test_plan_units(mode, tokens, unit_tokens, salt, want):
    assert C.plan_units(mode, tokens, unit_tokens, salt) == want


def test_plan_units_sample_has_first_last_and_is_deterministic():
    for salt in range(20):
        u = C.plan_units("sample", 1000, 16, salt)
        assert u[0] == 0 and u[-1] == 62 and len(u) == C.SAMPLE_EXTRA + 2
        assert list(u) == sorted(set(u))
        assert u == C.plan_units("sample", 1000, 16, salt)
    assert len({C.plan_units("sample", 1000, 16, s) for s in range(20)}) > 1  # the salt moves the extras
    with pytest.raises(ValueError):
        C.plan_units("most", 10, 16)


def test_window_group_checks_only_units_it_moves():
    lay = L.layout_for(preset("hybrid"), 1, 0, 64, 16)  # window 48, layers 0 and 2
    assert C.group_first_token(lay, 0, 100) == 0  # full attention: everything
    assert C.group_first_token(lay, 1, 100) == 48  # (100 - 48) rounded down to a block of 16
    assert C.checked_units(lay, 1, (0, 1, 2, 3, 6), 16, 100) == [False, False, False, True, True]
    assert C.checked_units(lay, 0, (0, 1), 16, 100) == [True, True]


def _sums(units, heads=(0, 1), groups=1):
    return m.KVChecksums(16, 40, units, heads, C.pack([(7,) * (groups * len(units)) for _ in heads]))


def _k(units, heads, rows):
    return m.KVChecksums(16, 40, units, heads, C.pack(rows))


@pytest.mark.parametrize("exp,why", [
    (_sums((0, 2)), None),
    (msgspec.structs.replace(_sums((0, 2)), num_tokens=41), "cover 41 tokens"),
    (msgspec.structs.replace(_sums((0, 2)), unit_tokens=8), "unit of 8"),
    (_sums((0, 3)), "not distinct sorted"),
    (_sums((2, 0)), "not distinct sorted"),
    (_sums(()), "not distinct sorted"),
    (_sums((0, 1), groups=2), "rows do not match"),
    (msgspec.structs.replace(_sums((0, 1)), heads=(0,)), "rows do not match"),
])
def test_check_expected(exp, why):
    got = C.check_expected(exp, 40, 16, 1)
    assert (got is None) if why is None else (why in got)


def test_merge_and_compare_tables():
    lay = L.layout_for(preset("small"), 1, 0, 8, 16)
    a = _k((0, 2), (0, 1), ((1, 2), (3, 4)))
    b = _k((0, 2), (2, 3), ((5, 6), (7, -(2**63))))
    merged = C.merge([b, None, a])
    assert merged.heads == (0, 1, 2, 3) and C.rows(merged) == [(1, 2), (3, 4), (5, 6), (7, -(2**63))]
    assert C.merge([None]) is None
    with pytest.raises(ValueError):
        C.merge([a, msgspec.structs.replace(b, units=(0, 1))])
    with pytest.raises(ValueError):  # bytes that do not split into a row per head
        C.merge([msgspec.structs.replace(a, sums=a.sums[:-1])])
    mine = _k((0, 2), (2, 3), ((5, 6), (7, -(2**63))))
    assert C.compare(lay, merged, mine) == ("", 4)
    bad = _k((0, 2), (2, 3), ((5, 6), (7, 9)))
    reason, _ = C.compare(lay, merged, bad)
    assert "tokens 32..39 (unit 2)" in reason and "KV head 3" in reason
    reason, _ = C.compare(lay, a, mine)
    assert "no checksum from P for KV head 2" in reason


# ------------------------------------------------------------------ torch over real pools
def _pools(model, tp, block_size, sub, hg, num_blocks):
    lays = [L.layout_for(model, tp, r, num_blocks, block_size, sub, hg) for r in range(tp)]
    dt = getattr(torch, model.dtype)
    pools = []
    for lay in lays:
        t = torch.zeros(L.pool_bytes(lay) // lay.dtype_bytes, dtype=dt)
        pools.append((lay, t, L.layer_views(t, lay)))
    return pools


def _store(pools, kv, table):
    """Write the logical KV ``[layers, planes, heads, tokens, dim]`` where each rank keeps it."""
    for lay, _, views in pools:
        subs = L.expand_table(lay, table)
        u, hg = L.unit(lay), L.group_heads(lay)
        for t in range(kv.shape[3]):
            s, o = subs[t // u], t % u
            for h in range(lay.kv_heads):
                for layer in range(lay.num_layers):
                    v = views[layer]
                    dst = v[s, :, h, o] if v.dim() == 5 else v[s, :, h // hg, h % hg, o]
                    dst.copy_(kv[layer, :, lay.head_start + h, t])


def _wire(pools, table, n, units, unit_tokens):
    return [C.to_wire(lay, C.unit_sums(views, lay, table, n, units, unit_tokens), units, unit_tokens, n)
            for lay, _, views in pools]


def _verified(pools, table, n, units, unit_tokens, expected):
    """Each rank's answer as D's worker computes it (``verify``, on the sums' device), checked
    equal to the host reference ``compare``."""
    out = []
    for lay, _, views in pools:
        sums = C.unit_sums(views, lay, table, n, units, unit_tokens)
        got = C.verify(lay, expected, sums)
        assert got == C.compare(lay, expected, C.to_wire(lay, sums, units, unit_tokens, n))
        out.append(got)
    return out


# (model, P tp, D tp, P block, D block, prompt tokens)
LAYOUTS = [
    ("small", 1, 1, 16, 16, 70),
    ("small", 1, 2, 16, 32, 70),  # TP mismatch, D's blocks twice P's
    ("small", 2, 1, 32, 16, 61),  # and the other way
    ("hybrid", 1, 2, 16, 16, 100),  # window group moves only the last 48 tokens' blocks
    ("mla", 2, 1, 16, 8, 45),  # one latent row, held whole by every rank
    ("tiny", 4, 2, 8, 16, 30),  # more ranks than KV heads: replicated heads
]


@pytest.mark.parametrize("name,tp_p,tp_d,bs_p,bs_d,n", LAYOUTS)
def test_p_and_d_agree_and_damage_is_caught(name, tp_p, tp_d, bs_p, bs_d, n):
    model = preset(name, dtype="bfloat16")
    total = model.cache_kv_heads
    hp, hd = L.rank_heads(tp_p, 0, total)[1], L.rank_heads(tp_d, 0, total)[1]
    sub, hg = math.gcd(bs_p, bs_d), math.gcd(hp, hd)
    P = _pools(model, tp_p, bs_p, sub, hg, 16)
    D = _pools(model, tp_d, bs_d, sub, hg, 16)
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(model.num_layers, model.kv_planes, total, n, model.cache_head_dim, generator=g).to(torch.bfloat16)
    p_table = [5, 2, 9, 0, 7, 11, 3, 4][:L.blocks_for(n, bs_p)]
    d_table = [6, 1, 8, 3, 10, 12, 2, 0][:L.blocks_for(n + 4, bs_d)]
    _store(P, kv, p_table)
    _store(D, kv, d_table)
    win = L.window_group(P[0][0])
    if win >= 0:  # the window group's blocks before the window are not moved: D holds other bytes there
        layers = L.layer_groups(D[0][0])[win]
        for lay, _, views in D:
            for layer in layers:
                views[layer][L.expand_table(lay, d_table)[0]].fill_(3.0)
    for mode in ("full", "sample"):
        units = C.plan_units(mode, n, bs_p, salt=7)
        expected = C.merge(_wire(P, p_table, n, units, bs_p))
        assert expected.heads == tuple(range(total))
        assert C.check_expected(expected, n, bs_p, len(L.layer_groups(P[0][0]))) is None
        for rank, (reason, checked) in enumerate(_verified(D, d_table, n, units, bs_p, expected)):
            assert reason == "" and checked > 0, (mode, rank, reason)

    units = C.plan_units("full", n, bs_p)
    expected = C.merge(_wire(P, p_table, n, units, bs_p))

    def caught(pools, table) -> str:
        return next((r for r, _ in _verified(pools, table, n, units, bs_p, expected) if r), "")

    # one flipped byte of the last token (every sample has it, every window moves it)
    lay, t, _ = D[0]
    raw = t.view(torch.uint8)
    subs = L.expand_table(lay, d_table)
    off = L.offset(lay, subs[(n - 1) // L.unit(lay)], 0, 0, 0, (n - 1) % L.unit(lay)) + 1
    raw[off] ^= 0x10
    assert "KV checksum mismatch" in caught(D, d_table)
    raw[off] ^= 0x10
    assert caught(D, d_table) == ""
    # D's first two blocks swapped: as if each one's KV had landed in the other's place
    swapped = [d_table[1], d_table[0]] + d_table[2:]
    assert "KV checksum mismatch: tokens 0.." in caught(D, swapped)
    # the last block never written (a truncated transfer): D's stale bytes there
    for lay, _, views in D:
        last = L.expand_table(lay, d_table)[(n - 1) // L.unit(lay)]
        for v in views:
            v[last].zero_()
    assert f"unit {(n - 1) // bs_p}" in caught(D, d_table)


def test_words_past_the_prompt_do_not_count():
    model = preset("tiny")
    (lay, t, views), = _pools(model, 1, 16, 16, 0, 4)
    t.normal_()
    a = C.unit_sums(views, lay, [1, 2], 20, (0, 1), 16)
    for v in views:
        v[2, :, :, 4:].fill_(9.0)  # tokens 20..31 of block 2: past the prompt
    assert torch.equal(a, C.unit_sums(views, lay, [1, 2], 20, (0, 1), 16))
    for v in views:
        v[2, :, :, 3].fill_(9.0)  # token 19: the prompt's last
    assert not torch.equal(a, C.unit_sums(views, lay, [1, 2], 20, (0, 1), 16))


def test_window_rule_is_the_mappings():
    """The units a window group checks start where protocol/mapping.py starts moving it."""
    from pushkv.protocol.mapping import window_start_sub

    for sub in (8, 16):
        lay = L.layout_for(preset("hybrid"), 1, 0, 64, 16, sub_block=sub)
        for n in (1, 47, 48, 49, 63, 64, 100, 257):
            assert C.group_first_token(lay, 1, n) == window_start_sub(lay, n) * L.unit(lay), (sub, n)


def test_moved_units_drops_the_units_d_held_in_its_prefix_cache():
    """D checks only what crossed: units before its cached tokens go, in every group's row."""
    from pushkv import messages as m
    from pushkv.kv.checksum import moved_units

    exp = m.KVChecksums(16, 100, (0, 2, 6), (0, 3), C.pack([(1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11, 12)]))  # 2 groups
    assert moved_units(exp, 0) is exp
    got = moved_units(exp, 32)  # units 0 and 1 were cached: unit 2 (tokens 32..47) on
    assert got.units == (2, 6) and C.rows(got) == [(2, 3, 5, 6), (8, 9, 11, 12)] and got.heads == (0, 3)
    assert moved_units(exp, 112) is None
    none = moved_units(m.KVChecksums(16, 100, (0, 2, 6), (), b""), 32)  # a peer's, with no rows
    assert none.units == (2, 6) and none.sums == b"" and C.check_expected(none, 100, 16, 2) is None


def test_verify_on_the_sums_device_answers_as_compare():
    """D's device-side check (``verify``: one reduction, two numbers back) gives the host
    reference's answer, reason and count, in every case: equal, a mismatch anywhere (the first
    in (head, group, unit) order is named), a mismatch only where a window group checks
    nothing, a head P sent no row for (after or before a mismatch), rows of the wrong size."""
    lay = L.layout_for(preset("hybrid"), 2, 1, 64, 16)  # heads 2 and 3; groups: full, window 48
    n, units = 100, (0, 1, 3, 5, 6)
    assert lay.head_start == 2 and lay.kv_heads == 2 and C.window_group(lay) == 1
    g = torch.Generator().manual_seed(3)
    mine = torch.randint(-2**62, 2**62, (2, len(units), 2), generator=g, dtype=torch.int64)
    mine[1, :2] = 0  # window group: units 0 and 1 lie before the window (48), summed as 0
    exp = C.to_wire(lay, mine, units, 16, n)

    def both(expected, sums):
        got = C.verify(lay, expected, sums)
        assert got == C.compare(lay, expected, C.to_wire(lay, sums, units, 16, n)), got
        return got

    assert both(exp, mine) == ("", 2 * (5 + 3))  # the window group checks units 3, 5, 6
    for grp, i, h in [(0, 0, 0), (0, 4, 1), (1, 3, 0), (1, 4, 1)]:
        bad = mine.clone()
        bad[grp, i, h] += 1
        reason, compared = both(exp, bad)
        assert f"(unit {units[i]}), layer group {grp}, KV head {2 + h}" in reason, reason
        if (grp, i, h) != (1, 4, 1):
            bad[1, 4, 1] -= 1  # the last in order too: the first is still named
            assert both(exp, bad)[0] == reason
    bad = mine.clone()
    bad[1, 1, 0] = 7  # before the window: not checked
    assert both(exp, bad) == ("", 16)
    other = m.KVChecksums(16, n, units, (2, 7), exp.sums)  # head 3's row named 7: P sent none for 3
    assert both(other, mine) == ("no checksum from P for KV head 3", 8)
    bad = mine.clone()
    bad[0, 1, 0] ^= 1
    assert "KV head 2" in both(other, bad)[0]  # head 2's mismatch comes first
    assert both(msgspec.structs.replace(exp, sums=exp.sums[8:]), mine)[0] == "no checksum from P for KV head 2"


@pytest.mark.parametrize("spans,want", [
    ([(-1, 0, 40)], (3, 40)),  # one WRITE of every group
    ([(-1, 32, 40)], (3, 40)),  # after D's cached prefix
    ([(0, 32, 64), (1, 48, 64), (2, 48, 64)], (3, 64)),  # layer-streamed: each group's rest
    ([(0, 48, 64), (1, 48, 64)], (2, 64)),  # the last group's end left in a part: the one before it
    ([(2, 48, 64)], (3, 64)),  # every group's parts reached the end: the rendezvous re-sends the last unit
    ([(1, 48, 64), (2, 48, 50)], (2, 64)),  # a short last span: the one that reaches the end
])
def test_source_fault_flips_what_the_last_write_carries(spans, want):
    """kv_flip_source (pushkv/kv/damage.py) picks a byte the last WRITE moves, so it is seen
    with layer-streamed push too: small's 4 layers in 3 groups are (0,), (1, 2), (3,)."""
    from pushkv.kv import damage

    lay = L.layout_for(preset("small"), 1, 0, 8, 16, layer_split=3)
    assert L.layer_groups(lay) == ((0,), (1, 2), (3,))
    layer, end = damage.carried_last_token(lay, spans)
    assert (layer, end) == want
    g = next(g for g, t, e in reversed(spans) if e == end)
    assert g < 0 or layer in L.layer_groups(lay)[g]
