"""MLA-style attention weights: names (DeepSeek-V2's and V3's Hugging Face names) and one rank's slice, with a
DeepSeek checkpoint's MLP: its dense first layers, or its router (and correction bias), experts and shared experts.

See mla.py for the attention itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pushkv.config import ModelConfig
from pushkv.model.shard import ShardPlan
from pushkv.model.weights import RankWeights, moe_slices, shared_slices, swiglu_slices, tp_columns, with_embeddings

__all__ = ["MLALayerWeights", "load_rank_mla", "mla_names"]


def mla_names(cfg: ModelConfig, a: str) -> list[tuple[str, tuple[int, ...]]]:
    """Attention parameters of one layer (prefix ``a`` = ``model.layers.N.self_attn.``)."""
    d, hd, r, rd, nh = cfg.hidden_size, cfg.head_dim, cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.num_heads
    ql = cfg.q_lora_rank
    q = ([(a + "q_a_proj.weight", (ql, d)), (a + "q_a_layernorm.weight", (ql,)),
          (a + "q_b_proj.weight", (nh * (hd + rd), ql))] if ql else [(a + "q_proj.weight", (nh * (hd + rd), d))])
    return q + [
        (a + "kv_a_proj_with_mqa.weight", (r + rd, d)),
        (a + "kv_a_layernorm.weight", (r,)),
        (a + "kv_b_proj.weight", (nh * 2 * hd, r)),  # per head: k_nope rows, then v rows
        (a + "o_proj.weight", (d, nh * hd)),
    ]


@dataclass
class MLALayerWeights:
    input_norm: torch.Tensor  # [d]
    q: torch.Tensor  # [q_heads * (hd + rd), d], local heads (with a query LoRA: [q_heads * (hd + rd), q_lora])
    kv_a: torch.Tensor  # [r + rd, d], replicated
    kv_norm: torch.Tensor  # [r], replicated
    k_up: torch.Tensor  # [q_heads * hd, r], local heads
    v_up: torch.Tensor  # [q_heads * hd, r], local heads
    o: torch.Tensor  # [d, q_heads * hd], row-sharded (partial sums)
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    router: Optional[torch.Tensor] = None  # [experts, d], replicated: an MoE layer's (None: a dense SwiGLU)
    q_a: Optional[torch.Tensor] = None  # [q_lora, d], replicated: the query LoRA's down-projection
    q_a_norm: Optional[torch.Tensor] = None  # [q_lora]
    router_bias: Optional[torch.Tensor] = None  # [experts]: added to the scores for the choice only (DeepSeek-V3)
    shared_gate_up: Optional[torch.Tensor] = None  # [2 * shared_local, d]: the shared experts, one SwiGLU
    shared_down: Optional[torch.Tensor] = None  # [d, shared_local], row-sharded (partial sums)
    shared_gate: Optional[torch.Tensor] = None  # unused: DeepSeek's shared experts are ungated


def _halves(t: torch.Tensor, width: int, rd: int) -> torch.Tensor:
    """Rows [..., width] of which each group's last ``rd`` are RoPE's in adjacent pairs (0, 1), (2, 3)...: those
    reordered evens first, then odds, the halves RoPE rotates here (cfg.rope_interleave)."""
    g = t.view(-1, width, *t.shape[1:])
    order = torch.cat((torch.arange(0, rd, 2), torch.arange(1, rd, 2))) + (width - rd)
    g[:, width - rd:] = g[:, order].clone()
    return g.view(t.shape)


def load_rank_mla(cfg: ModelConfig, plan: ShardPlan, take) -> RankWeights:
    hd, rd, r = cfg.head_dim, cfg.qk_rope_dim, cfg.kv_lora_rank
    qs, qn = plan.q_start, plan.q_heads
    heads = (qs * (hd + rd), (qs + qn) * (hd + rd))
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        kv_b = take(a + "kv_b_proj.weight", 0, qs * 2 * hd, (qs + qn) * 2 * hd).view(qn, 2 * hd, r)
        q = take(a + ("q_b_proj.weight" if cfg.q_lora_rank else "q_proj.weight"), 0, *heads)
        kv_a = take(a + "kv_a_proj_with_mqa.weight")
        if cfg.rope_interleave:
            q, kv_a = _halves(q, hd + rd, rd), _halves(kv_a, r + rd, rd)
        layers.append(MLALayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            q=q,
            q_a=take(a + "q_a_proj.weight") if cfg.q_lora_rank else None,
            q_a_norm=take(a + "q_a_layernorm.weight") if cfg.q_lora_rank else None,
            kv_a=kv_a,
            kv_norm=take(a + "kv_a_layernorm.weight"),
            k_up=kv_b[:, :hd].reshape(qn * hd, r).contiguous(),
            v_up=kv_b[:, hd:].reshape(qn * hd, r).contiguous(),
            o=take(a + "o_proj.weight", 1, qs * hd, (qs + qn) * hd),
            **_mlp(cfg, plan, take, p, i),
        ))
    return with_embeddings(cfg, take, layers)


def _mlp(cfg: ModelConfig, plan: ShardPlan, take, p: str, layer: int) -> dict:
    """Layer ``layer``'s MLP slices: a dense SwiGLU (every layer of a model without experts; DeepSeek's first
    ``dense_layers``), or the router, its correction bias, the experts and the shared experts."""
    if not cfg.is_moe or layer < cfg.dense_layers:
        width = cfg.dense_intermediate_size if cfg.is_moe else cfg.intermediate_size
        gate_up, down = swiglu_slices(take, p + "mlp.", tp_columns(width, plan, "intermediate_size"))
        return dict(post_norm=take(p + "post_attention_layernorm.weight"), gate_up=gate_up, down=down)
    out = moe_slices(cfg, take, p, tp_columns(cfg.intermediate_size, plan, "moe_intermediate_size"))
    if cfg.routing.bias:
        # float32, as DeepSeek keeps it: a small bias that decides near ties, which bf16 would round away
        out["router_bias"] = take(p + "mlp.gate.e_score_correction_bias", as_dtype=torch.float32)
    return out | shared_slices(cfg, plan, take, p)
