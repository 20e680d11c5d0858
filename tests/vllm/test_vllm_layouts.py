"""vLLM's GPU KV layouts (FlashAttention NHD/HND, FlashInfer NHD/HND, 0.32's pages, MLA) as the
writer describes and maps them: a block copied region by region lands head by head where D
keeps it, whole pages at equal TP and head slices between TP sizes (pure: torch on the CPU)."""
from __future__ import annotations

import pytest
import torch

from pushkv.protocol.actions import PostWrite
from pushkv.protocol.tp import page_heads
from pushkv.vllm import regions as R
from pushkv.vllm.stream import groups_of, write_regions
from tools.vllm_gpu_harness import CASES, block_of, cache_bytes, head_of, kv_views, write_layer

L, NB, BS, HD = 3, 10, 4, 8


def cache(case: str, heads: int):
    hd = 24 if case == "mla" else HD
    buf = torch.zeros(cache_bytes(case, L, NB, BS, heads, hd, torch.bfloat16), dtype=torch.int8)
    views = kv_views(buf, case, L, NB, BS, heads, hd, torch.bfloat16)
    mem = R.describe(views, buf.data_ptr(), buf.numel(), heads, 8 if case != "mla" else 1, CASES[case], BS)
    return buf, views, mem


def copy(src: torch.Tensor, dst: torch.Tensor, regions) -> None:
    for s, d, n in regions:
        dst[d:d + n] = src[s:s + n]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2)])
def test_every_layout_moves_each_head_where_d_keeps_it(case, p_tp, d_tp):
    if case == "mla" and p_tp != d_tp:
        p_tp = d_tp = 1  # one latent page every rank holds: tested as equal TP
    total = 1 if case == "mla" else 8
    ph, dh = max(1, total // p_tp), max(1, total // d_tp)
    p_blocks, d_blocks = [1, 2, 3, 7], [9, 0, 1]  # D has the first block from its prefix cache
    ps = [cache(case, ph) for _ in range(p_tp)]
    ds = [cache(case, dh) for _ in range(d_tp)]
    for r, (_, views, _) in enumerate(ps):
        for li, name in enumerate(views):
            write_layer(case, views[name], li, p_blocks, seed=r + 1)
    for pr, (pbuf, _, pmem) in enumerate(ps):
        for dr, (dbuf, _, dmem) in enumerate(ds):
            heads = None if p_tp == d_tp else page_heads(pr, p_tp, dr, d_tp, total)
            if heads is False or (p_tp == d_tp and pr != dr):
                continue
            copy(pbuf, dbuf, R.map_blocks(pmem, p_blocks, dmem, d_blocks, heads))
    for dr, (_, dviews, _) in enumerate(ds):
        for name, dv in dviews.items():
            for h in range(dh):
                g = dr * dh + h  # the model's head
                pr, ph_local = divmod(g, ph)
                pv = ps[pr][1][name]
                for pb, db in zip(p_blocks[1:], d_blocks):
                    want = head_of(block_of(pv, case, pb), case, ph_local)
                    got = head_of(block_of(dv, case, db), case, h)
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (name, g, db)
            assert not block_of(dv, case, 5).view(torch.int16).any()  # nothing else written


@pytest.mark.parametrize("case", ["flash_attn_nhd", "flashinfer_hnd", "mla"])
def test_streamed_spans_together_move_exactly_the_whole_write(case):
    _, _, mem = cache(case, 1 if case == "mla" else 8)
    blocks, d_blocks, tokens = [1, 2, 3, 7], [4, 5, 6, 8], 4 * BS - 1
    groups = groups_of(L, 2)
    whole = R.map_blocks(mem, blocks, mem, d_blocks)
    parts = [PostWrite("t", 0, tuple(blocks), BS * 2, 0, (), 0, False, ((0, 0, 2 * BS), (1, 0, BS))),
             PostWrite("t", 0, tuple(blocks), tokens, 0, (), 0, True, ((0, 2 * BS, tokens), (1, BS, tokens)))]
    got = sorted(r for a in parts for r in write_regions(mem, a, mem, d_blocks, tokens, None, groups))
    assert sum(n for *_, n in got) == sum(n for *_, n in whole)
    covered = sorted((s, n) for s, _, n in got)
    for (s0, n0), (s1, _) in zip(covered, covered[1:]):
        assert s0 + n0 <= s1  # no byte moved twice


def test_heads_that_are_not_the_page_s_cannot_pair_between_tp_sizes():
    _, _, mem = cache("flash_attn_nhd", 8)
    flat = R.KVMemory(mem.nbytes, mem.num_blocks, tuple(R.LayerRegion(lr.offset, lr.block_stride, lr.page_bytes)
                                                          for lr in mem.layers), 8)
    assert "cannot be paired" in flat.pairing_problem(1, mem, 2, "peer")
    assert "differ" in mem.pairing_problem(1, cache("flash_attn_hnd", 8)[2], 1, "peer")  # NHD against HND


def test_expandable_segments_are_refused_with_the_reason():
    from pushkv.vllm.cuda_kv import sharing_problem

    t = torch.zeros(4)
    why = sharing_problem(t, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True"})
    assert "expandable_segments" in why and "legacy CUDA IPC" in why


def test_a_part_of_blocks_in_d_s_prefix_cache_posts_nothing():
    """D registers only the blocks its prefix cache lacks (the prompt's last): a part of the first
    blocks has no region there, and is no post (NIXL refuses an empty one, which failed the
    transfer); a part reaching D's blocks, and a last WRITE, have regions."""
    from types import SimpleNamespace

    from pushkv.vllm.stream import regions_of

    _, _, mem = cache("flash_attn_nhd", 8)
    groups, tokens = groups_of(L, 2), 4 * BS - 1
    reg, peer = SimpleNamespace(d_rank=0, d_tp=1, block_ids=(8,), num_tokens=tokens), SimpleNamespace(layout=mem)
    blocks = (1, 2, 3, 7)
    early = PostWrite("t", 0, blocks, 3 * BS, 0, (), 0, False, ((0, 0, 3 * BS),))  # D holds blocks 0-2
    late = PostWrite("t", 0, blocks, tokens, 0, (), 0, False, ((0, 0, tokens),))
    last = PostWrite("t", 0, blocks, tokens, 0, (), 0, True, ((1, 0, tokens),))
    assert regions_of(mem, early, 0, 1, 8, groups)(reg, peer) is None
    assert regions_of(mem, late, 0, 1, 8, groups)(reg, peer)
    assert regions_of(mem, last, 0, 1, 8, groups)(reg, peer)


@pytest.mark.parametrize("cached_blocks", [0, 2, 3])
def test_p_streams_nothing_of_what_d_s_prefix_cache_holds(cached_blocks):
    """P's side as the vLLM writer drives it (the rendezvous under ``PrefillSide``, each WRITE's
    regions from ``regions_of``), D registering the blocks its prefix cache lacks and saying how many
    tokens it holds (``cached_tokens``): no part is asked that has nothing to move, and together
    the WRITEs move exactly the registered blocks, each byte once. Without ``cached_tokens`` (the
    registration before) the parts of the cached blocks were asked and posted nothing."""
    from types import SimpleNamespace

    from pushkv.messages import Register
    from pushkv.protocol.rendezvous import PushRendezvous
    from pushkv.vllm.stream import regions_of
    from pushkv.writer import sides

    _, _, mem = cache("flash_attn_hnd", 8)
    groups, tokens = groups_of(L, 2), 4 * BS - 1
    p_blocks, d_blocks = (1, 2, 3, 7), (5, 8, 6, 4)[cached_blocks:]
    peer = SimpleNamespace(layout=mem)

    def run(cached):
        side = sides.PrefillSide(PushRendezvous(0, 1, 8, 30.0, 30.0, stream_unit=BS, stream_groups=len(groups)))
        reg = Register("t", 0, "D", 0, 1, d_blocks, tokens, 0.0, cached_tokens=cached)
        posts, now = [], 0.0

        def posted(effects):
            for e in effects:
                if isinstance(e, sides.Post):
                    posts.append(regions_of(mem, e.write, 0, 1, 8, groups)(reg, peer))
                    posted(side.write_ended(e.key, now, part=not e.write.last))  # it completed

        posted(side.registration(reg, now))
        for step_end in (2 * BS, tokens):  # two chunks, each stored group by group
            for g in range(len(groups)):
                now += 1.0
                posted(side.progress(("t", 0), p_blocks, step_end, now, g))
        posted(side.prefill_done(("t", 0), p_blocks, tokens, 0, now + 1.0))
        return posts

    posts = run(cached_blocks * BS)
    assert posts and all(r is not None for r in posts), posts  # no part of nothing
    got = sorted(r for regions in posts for r in regions)
    assert got == sorted(R.map_blocks(mem, p_blocks, mem, d_blocks))  # exactly D's blocks, once
    if cached_blocks:
        assert None in run(0)  # the registration without cached_tokens asked parts of D's cached blocks
