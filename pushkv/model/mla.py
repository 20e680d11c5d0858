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
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; with a query LoRA, V3's and V2's, ``q_a_proj``,
``q_a_layernorm``, ``q_b_proj``). A DeepSeek checkpoint's RoPE pairs adjacent dims: its rotated rows are
permuted at load (``mla_weights``), so RoPE here rotates halves as everywhere else; the softmax scale
is the config's (YaRN's mscale squared on 1/sqrt(query width)). Its MoE layers route as DeepSeek does
(``moe.route_grouped``: softmax or sigmoid scores, groups of experts, a correction bias for the choice,
a scaling factor) and add the shared experts; its first ``dense_layers`` are dense. These run in torch
ops, on the CPU and the GPU alike: on the per-sequence engine, or on the batched one's MLA path
(``batched._layers_mla``: the step's projections batched, each sequence's latent rows gathered for its attention).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pushkv.config import ModelConfig
from pushkv.model.mla_weights import MLALayerWeights
from pushkv.model.moe import route_grouped, routed_experts
from pushkv.model.shard import ShardPlan
from pushkv.model.transformer import Model, rms_norm, rotate_half
from pushkv.model.weights import RankWeights


class MLAModel(Model):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, weights: RankWeights, device: str = "cpu", group=None):
        if cfg.checkpoint and not cfg.architecture.startswith("Deepseek"):
            raise ValueError("MLA-style presets use random weights; checkpoints are DeepSeek-V2/V3's")
        super().__init__(cfg, plan, weights, device, group)
        self.rope_dim = cfg.qk_rope_dim
        self.attn_scale = cfg.attn_scale or None

    def mlp_delta(self, lw, h: torch.Tensor, summed: bool = True, logits=None) -> torch.Tensor:
        """A DeepSeek MoE layer: the routed experts (``moe.route_grouped``; on CUDA through the grouped Triton
        kernels, ``triton_moe.moe_routed``) plus the shared experts; a dense layer as any model's."""
        if lw.router is None:
            return super().mlp_delta(lw, h)
        cfg = self.cfg
        weights, experts = route_grouped(h, lw.router, cfg.experts_per_token, cfg.norm_topk_prob, cfg.routing,
                                         lw.router_bias)
        if h.is_cuda:  # the grouped Triton kernels, for this routing (no host sync)
            from pushkv.model.kernels import triton_moe

            out = triton_moe.moe_routed(h, weights, experts, lw.gate_up, lw.down)
        else:
            out = routed_experts(h, weights, experts, lw.gate_up, lw.down)
        return self._all_reduce(out + self.shared_expert(lw, h) if lw.shared_gate_up is not None else out)

    def latent(self, lw: MLALayerWeights, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """Pre-norm, queries [N, q_heads, hd + rd] and the cached latent rows [N, r + rd]."""
        cfg, eps = self.cfg, self.cfg.rms_eps
        hd, rd, r = cfg.head_dim, cfg.qk_rope_dim, cfg.kv_lora_rank
        h = rms_norm(x, lw.input_norm, eps)
        qh = h if lw.q_a is None or lw.q_a_norm is None else rms_norm(F.linear(h, lw.q_a), lw.q_a_norm, eps)
        q_nope, q_rope = F.linear(qh, lw.q).view(-1, self.plan.q_heads, hd + rd).split([hd, rd], -1)
        c, k_rope = F.linear(h, lw.kv_a).split([r, rd], -1)
        cos, sin = rope
        q_rope = q_rope * cos[:, None] + rotate_half(q_rope) * sin[:, None]
        k_rope = k_rope * cos + rotate_half(k_rope) * sin
        return torch.cat((q_nope, q_rope), -1), torch.cat((rms_norm(c, lw.kv_norm, eps), k_rope), -1)

    def _attention(self, lw, x, rope, kv_pool, plans, kind, w_block, w_slot, bs) -> list[torch.Tensor]:
        """kv_pool: this layer's [blocks, 1, 1, block, r + rd] view; rope: the step's cos, sin rows."""
        q, lat = self.latent(lw, x, rope)
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


def absorbed_attention(lw: MLALayerWeights, q: torch.Tensor, rows: torch.Tensor, cfg: ModelConfig, heads: int,
                       scale: float | None = None) -> torch.Tensor:
    """One decode row's attention without expanding the latent (the batched engine's, ``_mla_decode_rows``, for
    one row: its reference): each head's no-RoPE query taken through its key up-projection into the latent's
    space, scored against the cached rows [S, r + rd] as they are, the weighted latent taken through the value
    up-projection. The same sums as expanding every row per head (``MLAModel._expand``), in another order.
    q [heads, hd + rd] -> [heads * hd]."""
    hd, rd, r = cfg.head_dim, cfg.qk_rope_dim, cfg.kv_lora_rank
    q_nope, q_rope = q.split([hd, rd], -1)
    q_abs = torch.cat((torch.einsum("hd,hdr->hr", q_nope, lw.k_up.view(heads, hd, r)), q_rope), -1)
    # (matmuls, not SDPA: SDPA's one shared key head broadcast over the heads ran 70x slower on the CPU)
    scores = (q_abs @ rows.T).float() * (scale or (hd + rd) ** -0.5)
    o_lat = scores.softmax(-1).to(rows.dtype) @ rows[:, :r]
    return torch.einsum("hr,hdr->hd", o_lat, lw.v_up.view(heads, hd, r)).reshape(-1)
