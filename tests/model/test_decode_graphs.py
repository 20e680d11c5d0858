"""The decode CUDA graphs' bookkeeping, on the CPU: which graph a step replays, the padding of a
short batch, and the metadata a replay leaves behind.

A CUDA graph replays the device addresses it recorded: the pools it was captured on, whatever
pools the step names later. ``_PinnedGraph`` is ``batched._DecodeGraph`` (its static buffers,
padding and staging, unchanged) with that one property emulated: it keeps the pools it was
captured on and runs each replay eagerly on them. So these tests fail where the GPU would give
wrong tokens: a graph replayed on another pool read and wrote the first pool's blocks (float32
greedy tokens then differed from transformers' on 1-2 of 3 prompts, docs/results/2026-12-02-models-gpu/).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pushkv.config import preset
from pushkv.messages import SeqWork
from pushkv.model import build_model
from pushkv.model.batched import _DecodeGraph
from tests.model.test_model import new_pool, paged_generate, prompt_of


class _PinnedGraph(_DecodeGraph):
    def _capture(self, pools):
        self.pools = list(pools)  # what the graph recorded: these pools' memory
        self.captures = 1

    def _launch(self):
        self._forward(self.pools)


def _model(graphs: bool, max_num_seqs: int = 8, name: str = "tiny"):
    model = build_model(preset(name))  # float32
    model.enable_batched(max_num_seqs=max_num_seqs, use_graphs=graphs)
    model.batched.graph_type = _PinnedGraph
    return model


def _prefilled(model, pool, n: int, seed: int = 0):
    """n sequences prefilled into pool (8 blocks of 8 slots each); their next decode step."""
    seqs = [SeqWork(i, tuple(prompt_of(5 + 3 * i, seed=seed + i)), 0, tuple(range(8 * i, 8 * i + 8))) for i in range(n)]
    first = model.execute(seqs, pool)
    return [SeqWork(i, (t,), len(s.token_ids), s.block_table) for i, (s, t) in enumerate(zip(seqs, first))]


# every engine path a graph captures: the fused kernels' (tiny) and MLA's (its latent rows stored by slot on the
# device, its decode rows' attention with no host read)
PATHS = pytest.mark.parametrize("name", ["tiny", "mla"])


@PATHS
def test_a_graph_never_replays_on_the_pools_of_another_step(name):
    """The experiment's shape: one pool per prompt, graphs on. Before the fix the second prompt's
    decode steps ran on the first prompt's pool."""
    on, off = _model(True, name=name), _model(False, name=name)
    prompts = [prompt_of(n, seed=n) for n in (5, 11, 23)]
    got = [paged_generate(on, new_pool(on, 8, 8), p, 8, tuple(range(8))) for p in prompts]
    want = [paged_generate(off, new_pool(off, 8, 8), p, 8, tuple(range(8))) for p in prompts]
    assert on.batched.graphs, "no graph was captured"
    assert got == want


def test_one_decode_step_on_a_second_pool_equals_eager():
    on, off = _model(True), _model(False)
    on.batched.logits(_prefilled(on, pool := new_pool(on, 16, 8), 1), on._layer_pools(pool))  # captures
    other = new_pool(on, 16, 8)
    step = _prefilled(on, other, 1, seed=9)
    eager_pool = other.clone()
    got = on.batched.logits(step, on._layer_pools(other))
    want = off.batched.logits(step, off._layer_pools(eager_pool))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(other.isnan(), eager_pool.isnan()), "the step's K/V went to another pool"


@PATHS
def test_padded_rows_store_nothing_and_leave_real_rows_alone(name):
    """Three sequences in the bucket of four, after a replay of four: the fourth row of the last
    replay is padding again (no keys, slot -1), and the three real rows equal eager ones."""
    on, off = _model(True, name=name), _model(False, name=name)
    pool = new_pool(on, 64, 8)
    step = _prefilled(on, pool, 4)
    on.batched.logits(step, on._layer_pools(pool))  # four real rows in the bucket of 4
    last = step[3]
    pool[last.block_table[last.start_pos // 8], :, :, :, last.start_pos % 8] = float("nan")  # a stale row would store
    step = [SeqWork(s.seq_id, (7,), s.start_pos + 1, s.block_table) for s in step[:3]]
    before = pool.clone()
    eager_pool = pool.clone()
    got = on.batched.logits(step, on._layer_pools(pool))
    want = off.batched.logits(step, off._layer_pools(eager_pool))
    assert set(on.batched.graphs) == {4}
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    written = (pool.isnan() != before.isnan()).any(dim=(1, 2, 3, 5)).nonzero().tolist()
    assert written == [[s.block_table[s.start_pos // 8], s.start_pos % 8] for s in step]
    assert torch.equal(pool.isnan(), eager_pool.isnan())


def test_buckets_captures_and_split_counts_agree():
    """capture() makes the graphs replay picks, and an eager decode step splits its keys as the
    graph of its bucket does (the same summation order, so the same float32 tokens)."""
    model = _model(True, max_num_seqs=10)
    fwd = model.batched
    assert fwd.buckets == [1, 2, 4, 8, 10]
    assert [fwd.bucket(n) for n in (1, 3, 8, 9, 10, 11)] == [1, 4, 8, 10, 10, 11]
    pool = model._layer_pools(new_pool(model, 8, 8))
    fwd.capture(pool, up_to=5)
    assert sorted(fwd.graphs) == [1, 2, 4, 8]
    fwd.cuda, fwd.sms = True, 132  # the H200's count, for the arithmetic alone
    assert [fwd.decode_splits(n) for n in (3, 5, 9)] == [fwd.decode_splits(n) for n in (4, 8, 10)]
    assert (fwd.decode_splits(9), fwd.decode_splits(11)) == (14, 12)  # 2 x 132 SMs over 10 or 11 seqs x 2 heads
    fwd.cuda = False
    other = model._layer_pools(new_pool(model, 8, 8))
    fwd.capture(other)
    assert sorted(fwd.graphs) == fwd.buckets and all(g.pools == other for g in fwd.graphs.values())


def test_an_mla_decode_step_reads_nothing_on_the_host():
    """What lets a CUDA graph capture MLA's decode step: the step runs with its lengths and slots unreadable from
    the host (a read of one raises here), and gives the eager step's logits."""
    from pushkv.model import batched

    model = _model(False, name="mla")
    pool = new_pool(model, 64, 8)
    step = _prefilled(model, pool, 3)
    want = model.batched.logits(step, model._layer_pools(pool.clone()))

    class Unreadable(torch.Tensor):
        def __int__(self):
            raise AssertionError("a host read of the step's metadata")

        __bool__ = __index__ = __int__

        def item(self):
            raise AssertionError("a host read of the step's metadata")

        def tolist(self):
            raise AssertionError("a host read of the step's metadata")

    fwd = model.batched
    plan = batched.plan_step(step, 8, fwd.block_q)
    meta = batched.StepTensors.upload(plan, fwd.device, fwd.staging)
    meta = dataclasses.replace(meta, **{f: getattr(meta, f).as_subclass(Unreadable)
                                        for f in ("seq_lens", "q_lens", "q_starts", "slots", "block_table")})
    got = fwd.forward(meta, model._layer_pools(pool), fwd.decode_splits(plan.num_seqs))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("one_copy", [True, False])
def test_a_replay_lands_its_table_in_one_copy_or_two_and_reads_only_its_rows_blocks(one_copy, monkeypatch):
    """``batched.ONE_COPY_ENTRIES``: a small graph's table is a view of the buffer its replay's one copy lands in
    (the rows staged at the graph's width), a larger one's its own, filled by a second copy. Either way a step of
    wide tables (three sequences of 6 blocks) and then one of narrow tables (three others of 1 block, the columns
    past it still holding the first step's blocks) give the eager step's logits and store their K/V where eager
    does, and the graph's rows start with the step's tables."""
    from pushkv.model import batched

    monkeypatch.setattr(batched, "ONE_COPY_ENTRIES", batched.ONE_COPY_ENTRIES if one_copy else 0)
    on, off = _model(True), _model(False)
    pool = new_pool(on, 64, 8)
    seqs = [SeqWork(i, tuple(prompt_of(40 if i < 3 else 5, seed=i)), 0, tuple(range(8 * i, 8 * i + 8)))
            for i in range(6)]
    first = on.execute(seqs, pool)
    decode = [SeqWork(s.seq_id, (t,), len(s.token_ids), s.block_table) for s, t in zip(seqs, first)]
    for step in (decode[:3], decode[3:]):
        eager_pool = pool.clone()
        got = on.batched.logits(step, on._layer_pools(pool))
        want = off.batched.logits(step, off._layer_pools(eager_pool))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(pool.isnan(), eager_pool.isnan())
        g = on.batched.graphs[4]
        table, plan = g.meta.block_table, batched.plan_step(step, 8, on.batched.block_q)
        assert g.one_copy == one_copy and table.shape == (4, g.width)
        assert (table.untyped_storage().data_ptr() == g.inputs.untyped_storage().data_ptr()) == one_copy
        W = plan.block_table.shape[1]
        assert table[:3, :W].tolist() == plan.block_table.tolist() and table[3, :W].tolist() == [0] * W
    assert W == 1 and table[:3, 1:6].tolist() == [list(range(8 * i + 1, 8 * i + 6)) for i in range(3)]
