"""The batched forward (one packed pass per step, attention in place through the block
tables) against the per-sequence path and the dense reference; step index arrays; and,
on a GPU, the Triton kernels against their torch references and CUDA-graph replay
against eager steps."""
from __future__ import annotations

import random

import pytest
import torch

from pushkv.config import preset
from pushkv.kv.layout import blocks_for
from pushkv.messages import SeqWork
from pushkv.model import build_model
from pushkv.model.reference import generate_dense
from pushkv.model.step import plan_step

from tests.model.test_model import new_pool, paged_generate, prompt_of, shuffled_table

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def batched(name="tiny", device="cpu", **overrides):
    model = build_model(preset(name, **overrides), device=device)
    model.enable_batched(max_num_seqs=16, use_graphs=False)
    return model


# ------------------------------------------------------------------ step arrays
def test_plan_step_packs_rows_slots_and_tiles():
    seqs = [SeqWork(7, (5, 6, 7), 0, (4, 9)), SeqWork(8, (1,), 17, (2, 3, 0)),
            SeqWork(9, (2, 2), 4, (6,), sample=False)]
    p = plan_step(seqs, block_size=8, block_q=2)
    assert p.ids.tolist() == [5, 6, 7, 1, 2, 2]
    assert p.positions.tolist() == [0, 1, 2, 17, 4, 5]
    # position 17 of seq 8 -> block table[2] = 0, offset 1; seq 9 positions 4, 5 in block 6
    assert p.slots.tolist() == [32, 33, 34, 1, 52, 53]
    assert p.seq_lens.tolist() == [3, 18, 6] and p.q_starts.tolist() == [0, 3, 4]
    assert p.block_table.tolist() == [[4, 0, 0], [2, 3, 0], [6, 0, 0]]
    assert p.decode_tiles.tolist() == [1]
    assert list(zip(p.prefill_tiles.tolist(), p.prefill_q0.tolist())) == [(0, 0), (0, 2), (2, 0)]
    assert p.sample_rows.tolist() == [2, 3] and not p.is_decode
    assert plan_step(seqs[1:2], 8, 2).is_decode


# ----------------------------------------------------------------- CPU (reference ops)
@pytest.mark.parametrize("prompt_len, block_size, chunk", [(1, 16, None), (37, 8, None), (45, 4, 16)])
def test_batched_generate_matches_dense(prompt_len, block_size, chunk):
    model = batched()
    prompt = prompt_of(prompt_len)
    table = shuffled_table(blocks_for(prompt_len + 10, block_size) + 3, seed=prompt_len)
    pool = new_pool(model, len(table) + 2, block_size)
    assert paged_generate(model, pool, prompt, 10, table, chunk) == generate_dense(model, prompt, 10)


@pytest.mark.parametrize("max_position", [256, 40])
def test_warmup_keeps_within_a_short_models_positions(max_position):
    """The warm-up's steps sat at fixed positions up to 300: a model of fewer (llama2.c's stories checkpoints have
    256) failed every worker's start on the batched engine (the CUDA default) with 'index out of range' in the RoPE
    table. A whole-context request still generates as the dense reference does after it."""
    from pushkv.kv.layout import layer_views

    model = batched(max_position=max_position)
    block_size, blocks = 16, 40
    pool = new_pool(model, blocks, block_size)
    assert model.batched.warmup(layer_views(pool, model.kv_layout(blocks, block_size))) >= 0
    prompt = prompt_of(max_position - 4)
    pool = new_pool(model, blocks, block_size)
    assert paged_generate(model, pool, prompt, 4, tuple(range(blocks)), None) == generate_dense(model, prompt, 4)


def _mixed_step(model, pool_a, pool_b, block_size):
    """Three sequences at different stages in one step vs each alone."""
    prompts = [prompt_of(n, seed=n) for n in (40, 23, 9)]
    tables = [tuple(range(i * 8 + 7, i * 8 - 1, -1)) for i in range(3)]  # descending: not the identity
    # seq 0 and 1 prefilled earlier, each alone, in both pools
    for pool in (pool_a, pool_b):
        for i in (0, 1):
            model.execute([SeqWork(i, tuple(prompts[i]), 0, tables[i])], pool)
    work = [SeqWork(0, (11,), 40, tables[0]), SeqWork(1, (12, 13, 14), 23, tables[1]),
            SeqWork(2, tuple(prompts[2]), 0, tables[2])]
    together = model.logits(work, pool_a)
    alone = torch.cat([model.logits([w], pool_b) for w in work])
    return together, alone


def test_batched_mixed_step_equals_each_alone_on_cpu():
    model = batched(deterministic=False)
    together, alone = _mixed_step(model, new_pool(model, 24, 8), new_pool(model, 24, 8), 8)
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=1e-4)


def test_batched_matches_per_seq_path_hybrid_and_grouped_heads():
    # sliding-window layers go through the same op with a window
    model = batched("hybrid")
    plain = build_model(preset("hybrid"))
    prompt = prompt_of(70, seed=5)
    table = shuffled_table(12, seed=1)
    a = paged_generate(model, new_pool(model, 14, 8), prompt, 8, table)
    b = paged_generate(plain, new_pool(plain, 14, 8), prompt, 8, table)
    assert a == b


# ----------------------------------------------------------------------------- GPU
def _pool_views(kv_heads, groups, blocks, u, d, dtype, device, layers=3, layer=1):
    """A layer view of a block-major pool with `groups` head groups (as kv.layout cuts it)."""
    hg = kv_heads // groups
    pool = torch.randn(blocks, layers, 2, groups, hg, u, d, dtype=dtype, device=device)
    v = pool[:, layer]
    return v if groups > 1 else v[:, :, 0]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("window", [0, 37])
def test_triton_attention_matches_reference(dtype, groups, window):
    from pushkv.model.kernels import paged, triton_paged
    from pushkv.model.step import StepTensors

    dev = torch.device("cuda")
    torch.manual_seed(0)
    kvh, G, d, u = 4, 4, 128, 16
    cache = _pool_views(kvh, groups, 400, u, d, dtype, dev)
    rng = random.Random(1)
    seqs, used = [], list(range(400))
    rng.shuffle(used)
    for i, (ctx, n) in enumerate([(1, 1), (300, 1), (1000, 1), (517, 517), (700, 133), (64, 2)]):
        nb = blocks_for(ctx, u)
        table, used = tuple(used[:nb]), used[nb:]
        seqs.append(SeqWork(i, tuple(range(n)), ctx - n, table))
    plan = plan_step(seqs, u, block_q=128 // G if dtype == torch.bfloat16 else 64 // G)
    meta = StepTensors.upload(plan, dev)
    q = torch.randn(plan.num_tokens, kvh * G, d, dtype=dtype, device=dev)
    k = torch.randn(plan.num_tokens, kvh, d, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    ref_cache = cache.clone()
    paged.store_kv_ref(ref_cache, k, v, meta.slots.long())
    triton_paged.store_kv(cache, k, v, meta.slots)
    assert torch.equal(cache, ref_cache)
    want = paged.attention_ref(q.float(), ref_cache.float(), meta.block_table, meta.seq_lens, meta.q_starts,
                               meta.q_lens, window)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    for splits in (1, 3, 16):
        got = paged.attention(q, cache, meta, window, decode_splits=splits)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@gpu
def test_gpu_batched_mixed_step_and_graphs():
    model = build_model(preset("medium", dtype="bfloat16", deterministic=False), device="cuda")
    model.enable_batched(max_num_seqs=8, use_graphs=True)
    together, alone = _mixed_step(model, new_pool(model, 24, 8).cuda(), new_pool(model, 24, 8).cuda(), 8)
    # bf16 matmuls of a different batch shape differ in the last bits; logits stay close
    torch.testing.assert_close(together, alone, atol=0.15, rtol=0.05)
    # decode steps through the graph equal eager decode steps
    pool = new_pool(model, 64, 16).cuda()
    seqs = [SeqWork(i, tuple(prompt_of(30 + 7 * i, seed=i)), 0, tuple(range(8 * i, 8 * i + 8))) for i in range(5)]
    model.execute(seqs, pool)
    step = [SeqWork(i, (3 + i,), 30 + 7 * i, s.block_table) for i, s in enumerate(seqs)]
    eager_pool = pool.clone()
    g = model.batched.logits(step, model._layer_pools(pool))
    model.batched.use_graphs = False
    e = model.batched.logits(step, model._layer_pools(eager_pool))
    assert model.batched.graphs, "no graph was captured"
    torch.testing.assert_close(g, e, atol=0, rtol=0)


@gpu
def test_gpu_deterministic_greedy_equals_dense_fp32():
    model = build_model(preset("small"), device="cuda")  # float32, deterministic
    model.enable_batched(max_num_seqs=8)
    prompt = prompt_of(90, seed=4)
    table = shuffled_table(16, seed=2)
    got = paged_generate(model, new_pool(model, 18, 8).cuda(), prompt, 16, table)
    cpu = build_model(preset("small"))
    assert got == generate_dense(cpu, prompt, 16)


@gpu
def test_gpu_fused_kernels_match_torch_ops():
    model = build_model(preset("medium", dtype="bfloat16", deterministic=False), device="cuda")
    model.enable_batched(max_num_seqs=8, use_graphs=False)
    seqs = [SeqWork(0, tuple(prompt_of(70, seed=1)), 0, tuple(range(0, 10))),
            SeqWork(1, tuple(prompt_of(5, seed=2)), 0, tuple(range(10, 12)))]
    pools = [new_pool(model, 16, 8).cuda() for _ in range(2)]
    fwd = model.batched
    assert fwd.fused
    a = fwd.logits(seqs, model._layer_pools(pools[0]))
    fwd.fused = False
    b = fwd.logits(seqs, model._layer_pools(pools[1]))
    torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_real_presets_shard_at_tp_1_2_4_8():
    from pushkv.model.shard import shard_plan

    for name in ("qwen3-8b", "qwen3-32b"):
        cfg = preset(name)
        for tp in (1, 2, 4, 8):
            plans = [shard_plan(cfg, r, tp) for r in range(tp)]
            assert sum(p.q_heads for p in plans) == cfg.num_heads
            assert sum(p.inter_size for p in plans) == cfg.intermediate_size
            assert all(p.q_heads // p.kv_heads == cfg.num_heads // cfg.num_kv_heads for p in plans)


@pytest.mark.timeout(240)
def test_cpu_deployments_on_batched_engine_push_equals_local():
    """The batched engine behind real processes (CPU: torch reference ops)."""
    from tools.launch import launched

    ps = [prompt_of(n, seed=n) for n in (1, 17, 90)]
    got = {}
    for mode in ("local", "push"):
        with launched("--mode", mode, "--model", "tiny", "--engine", "batched", "--batch-invariant", "on",
                      start_timeout_s=120) as d:
            got[mode] = [d.tokens(p, 12) for p in ps]
    assert got["push"] == got["local"]
    assert all(len(t) == 12 for t in got["push"])
