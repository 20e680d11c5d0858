"""MLA-style attention (DeepSeek-V2 shape, simplified): one latent KV row per token.

Each layer projects the hidden state down to a latent ``c`` (``kv_lora_rank``,
RMS-normed) plus one decoupled RoPE key ``k_rope`` (``qk_rope_dim``) shared by
every head; the cache holds only ``[c, k_rope]``: one plane, one "head" of
``kv_lora_rank + qk_rope_dim`` per (block, layer). Heads expand the latent on
the fly: ``k_h = [W_uk,h c, k_rope]``, ``v_h = W_uv,h c``, queries
``[q_nope,h, rope(q_rope,h)]``.

Tensor parallelism shards the query heads, their up-projections and o_proj;
the down-projection is replicated, so every rank computes (bit for bit: the
same input after the all-reduce, the same weights) and caches the same latent.
That is the KV transfer's view of MLA: one head replicated on every rank.

Weights use DeepSeek-V2's Hugging Face names (``q_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), no query LoRA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pushkv.config import ModelConfig
from pushkv.model.shard import ShardPlan
from pushkv.model.transformer import Model, rms_norm, rotate_half
from pushkv.model.weights import RankWeights, mlp_slices, with_embeddings


def mla_names(cfg: ModelConfig, a: str) -> list[tuple[str, tuple[int, ...]]]:
    """Attention parameters of one layer (prefix ``a`` = ``model.layers.N.self_attn.``)."""
    d, hd, r, rd, nh = cfg.hidden_size, cfg.head_dim, cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.num_heads
    return [
        (a + "q_proj.weight", (nh * (hd + rd), d)),
        (a + "kv_a_proj_with_mqa.weight", (r + rd, d)),
        (a + "kv_a_layernorm.weight", (r,)),
        (a + "kv_b_proj.weight", (nh * 2 * hd, r)),  # per head: k_nope rows, then v rows
        (a + "o_proj.weight", (d, nh * hd)),
    ]


@dataclass
class MLALayerWeights:
    input_norm: torch.Tensor  # [d]
    q: torch.Tensor  # [q_heads * (hd + rd), d], local heads
    kv_a: torch.Tensor  # [r + rd, d], replicated
    kv_norm: torch.Tensor  # [r], replicated
    k_up: torch.Tensor  # [q_heads * hd, r], local heads
    v_up: torch.Tensor  # [q_heads * hd, r], local heads
    o: torch.Tensor  # [d, q_heads * hd], row-sharded (partial sums)
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def load_rank_mla(cfg: ModelConfig, plan: ShardPlan, take) -> RankWeights:
    hd, rd, r = cfg.head_dim, cfg.qk_rope_dim, cfg.kv_lora_rank
    qs, qn = plan.q_start, plan.q_heads
    i_rows = (plan.inter_start, plan.inter_start + plan.inter_size)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        kv_b = take(a + "kv_b_proj.weight", 0, qs * 2 * hd, (qs + qn) * 2 * hd).view(qn, 2 * hd, r)
        layers.append(MLALayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            q=take(a + "q_proj.weight", 0, qs * (hd + rd), (qs + qn) * (hd + rd)),
            kv_a=take(a + "kv_a_proj_with_mqa.weight"),
            kv_norm=take(a + "kv_a_layernorm.weight"),
            k_up=kv_b[:, :hd].reshape(qn * hd, r).contiguous(),
            v_up=kv_b[:, hd:].reshape(qn * hd, r).contiguous(),
            o=take(a + "o_proj.weight", 1, qs * hd, (qs + qn) * hd),
            **mlp_slices(take, p, i_rows),
        ))
    return with_embeddings(cfg, take, layers)


class MLAModel(Model):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, weights: RankWeights, device: str = "cpu", group=None):
        if cfg.checkpoint:
            raise ValueError("MLA-style presets use random weights; checkpoints are not supported")
        super().__init__(cfg, plan, weights, device, group)
        self.rope_dim = cfg.qk_rope_dim

    def latent(self, lw: MLALayerWeights, x: torch.Tensor, positions: torch.Tensor):
        """Pre-norm, queries [N, q_heads, hd + rd] and the cached latent rows [N, r + rd]."""
        cfg, eps = self.cfg, self.cfg.rms_eps
        hd, rd, r = cfg.head_dim, cfg.qk_rope_dim, cfg.kv_lora_rank
        h = rms_norm(x, lw.input_norm, eps)
        q_nope, q_rope = F.linear(h, lw.q).view(-1, self.plan.q_heads, hd + rd).split([hd, rd], -1)
        c, k_rope = F.linear(h, lw.kv_a).split([r, rd], -1)
        cos, sin = self.rope(positions)
        q_rope = q_rope * cos[:, None] + rotate_half(q_rope) * sin[:, None]
        k_rope = k_rope * cos + rotate_half(k_rope) * sin
        return torch.cat((q_nope, q_rope), -1), torch.cat((rms_norm(c, lw.kv_norm, eps), k_rope), -1)

    def _attention(self, lw, x, positions, kv_pool, plans, kind, w_block, w_slot, bs) -> list[torch.Tensor]:
        """kv_pool: this layer's [blocks, 1, 1, block, r + rd] view."""
        q, lat = self.latent(lw, x, positions)
        kv_pool[w_block, 0, 0, w_slot] = lat
        outs = []
        for p in plans:
            lo, chunks = p.attn[kind]
            past = self._past(kv_pool, p, lo, bs)
            rows = lat[p.rows] if past is None else torch.cat((past[0, 0], lat[p.rows]))
            keys, vals = self._expand(lw, rows)
            outs.append(self._sdpa(q[p.rows], keys, vals, chunks, p.num_new))
        return outs

    def _expand(self, lw: MLALayerWeights, rows: torch.Tensor):
        """Latent rows [S, r + rd] -> keys [q_heads, S, hd + rd], values [q_heads, S, hd]."""
        cfg, n = self.cfg, rows.shape[0]
        qh, hd, rd = self.plan.q_heads, cfg.head_dim, cfg.qk_rope_dim
        c, k_rope = rows.split([cfg.kv_lora_rank, rd], -1)
        k_nope = F.linear(c, lw.k_up).view(n, qh, hd)
        keys = torch.cat((k_nope, k_rope[:, None].expand(n, qh, rd)), -1)
        vals = F.linear(c, lw.v_up).view(n, qh, hd)
        return keys.transpose(0, 1), vals.transpose(0, 1)
