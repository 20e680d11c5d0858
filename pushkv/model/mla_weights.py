"""MLA-style attention weights: names (DeepSeek-V2's Hugging Face names) and one rank's slice.

See mla.py for the attention itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pushkv.config import ModelConfig
from pushkv.model.shard import ShardPlan
from pushkv.model.weights import RankWeights, mlp_slices, with_embeddings

__all__ = ["MLALayerWeights", "load_rank_mla", "mla_names"]


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
    router: Optional[torch.Tensor] = None  # a dense SwiGLU: no experts (the MLP reads it as any layer's)


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
