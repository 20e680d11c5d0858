"""MLA-style attention: paged latent cache against a dense reference that expands
K/V per head, and tensor parallelism (sharded heads, replicated latent) over
real gloo processes."""
from __future__ import annotations

import math
import os
import random

import msgspec
import pytest
import torch

from pushkv.config import ModelConfig, preset
from pushkv.kv import layout as L
from pushkv.messages import SeqWork
from pushkv.model import build_model
from pushkv.model.mla import MLAModel
from pushkv.model.transformer import rms_norm
from tests.model.test_model import run_tp_ranks

TP_TIMEOUT_S = 60.0
MLA_TINY = preset("mla", num_layers=2, hidden_size=64, num_heads=4, head_dim=16, intermediate_size=128,
                  kv_lora_rank=24, qk_rope_dim=8)


def prompt_of(n, seed=1):
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _rope(x, positions, theta):
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    ang = positions.to(torch.float64)[:, None] * freq[None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    while cos.dim() < x.dim():
        cos, sin = cos[:, None], sin[:, None]
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)


@torch.inference_mode()
def dense_mla(model: MLAModel, ids: list[int], steps: int) -> list[int]:
    """Full recompute each step, explicit per-head K/V and softmax: no cache at all."""
    cfg, w = model.cfg, model.w
    hd, rd, r, qh = cfg.head_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, model.plan.q_heads
    ids = list(ids)
    out = []
    for _ in range(steps):
        n = len(ids)
        pos = torch.arange(n)
        x = w.embed[torch.tensor(ids)]
        for lw in w.layers:
            h = rms_norm(x, lw.input_norm, cfg.rms_eps)
            q = (h @ lw.q.T).view(n, qh, hd + rd)
            ckv = h @ lw.kv_a.T
            c = rms_norm(ckv[:, :r], lw.kv_norm, cfg.rms_eps)
            k_rope = _rope(ckv[:, r:], pos, cfg.rope_theta)
            q = torch.cat((q[..., :hd], _rope(q[..., hd:], pos, cfg.rope_theta)), -1)
            k = torch.cat(((c @ lw.k_up.T).view(n, qh, hd), k_rope[:, None].expand(n, qh, rd)), -1)
            v = (c @ lw.v_up.T).view(n, qh, hd)
            s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd + rd)
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1)[None], float("-inf"))
            attn = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(n, qh * hd)
            x = model.attn_out(lw, x, attn)
            x = model.mlp(lw, x)
        tok = int(model.head(x[-1:])[0].argmax())
        out.append(tok)
        ids.append(tok)
    return out


def paged(model, prompt, steps, block_size=16, table=(5, 2, 7, 0, 3, 1, 4, 6)):
    lay = model.kv_layout(8, block_size)
    assert (lay.kv_planes, lay.kv_heads, lay.head_dim) == (1, 1, model.cfg.kv_lora_rank + model.cfg.qk_rope_dim)
    pool = torch.full(L.pool_shape(lay), float("nan"))
    views = L.layer_views(pool, lay)
    toks = model.execute([SeqWork(0, tuple(prompt), 0, table)], views)
    for i in range(steps - 1):
        toks += model.execute([SeqWork(0, (toks[-1],), len(prompt) + i, table)], views)
    return toks, pool


def test_mla_config_geometry():
    cfg = preset("mla")
    assert (cfg.kv_planes, cfg.cache_kv_heads, cfg.cache_head_dim) == (1, 1, 80)
    # 4 layers x 80 floats: 5x less than "small"'s 4 layers x 2 x 4 heads x 32
    assert cfg.kv_bytes_per_token() * 3.2 == preset("small").kv_bytes_per_token()


@pytest.mark.parametrize("n", [1, 17, 40])
def test_mla_paged_matches_dense(n):
    model = build_model(MLA_TINY)
    prompt = prompt_of(n)
    got, pool = paged(model, prompt, 5)
    assert got == dense_mla(model, prompt, 5)
    assert not torch.isnan(pool[[5, 2]]).all()  # the latent went into the pool


def _tp_worker(rank, world, init_file, out_dir, cfg_json):
    done = False
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = msgspec.json.decode(cfg_json, type=ModelConfig)
        model = build_model(cfg, tp_rank=rank, tp_size=world, group=torch.distributed.group.WORLD)
        toks, pool = paged(model, prompt_of(30, seed=3), 4)
        torch.save({"tokens": toks, "pool": pool}, os.path.join(out_dir, f"rank{rank}.pt"))
        torch.distributed.barrier()
        done = True  # no rank tears gloo down while its peer is mid-collective
    finally:
        torch.distributed.destroy_process_group()
    if done:  # skip interpreter teardown: threads of gloo still joinable there aborted a rank now and
        os._exit(0)  # then ("terminate called without an active exception", SIGABRT), results already saved


def test_mla_tensor_parallel_replicates_latent(tmp_path):
    tp = 2
    run_tp_ranks(_tp_worker, tp, tmp_path, MLA_TINY, TP_TIMEOUT_S)
    single_toks, single_pool = paged(build_model(MLA_TINY), prompt_of(30, seed=3), 4)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(tp)]
    for got in ranks:
        assert got["tokens"] == single_toks
    # every rank caches the same latent, bit for bit (replicated, not sharded)
    a, b = ranks[0]["pool"], ranks[1]["pool"]
    written = ~torch.isnan(a)
    assert torch.equal(written, ~torch.isnan(b)) and written.any()
    assert torch.equal(a[written], b[written])
    torch.testing.assert_close(a[written], single_pool[written], atol=1e-5, rtol=1e-5)
