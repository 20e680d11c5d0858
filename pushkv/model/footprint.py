"""What one rank's weights weigh, counted from the model's geometry alone (no torch, no files): the
supervisor sizes KV pools with it before anything loads, and a worker's load progress counts up to it."""
from __future__ import annotations

from pushkv.config import ModelConfig


def weight_bytes(model: ModelConfig, tp: int) -> int:
    """One TP rank's weights: attention heads and MLP columns are split over ``tp``; the
    embeddings, the LM head, the norms and an MoE router are whole on every rank."""
    d, hd = model.hidden_size, model.head_dim
    q = model.num_heads // tp
    kv = max(1, model.num_kv_heads // tp)
    inter = model.intermediate_size // tp
    if model.is_mla:  # the latent's down-projection and norm (and a query LoRA's) whole on every rank
        r, rd, ql = model.kv_lora_rank, model.qk_rope_dim, model.q_lora_rank
        attn = (ql * d + ql + q * (hd + rd) * ql) if ql else q * (hd + rd) * d
        attn += (r + rd) * d + r + q * 2 * hd * r + d * q * hd
    else:
        attn = 2 * q * hd * d + 2 * kv * hd * d
    if model.qkv_bias:
        attn += (q + 2 * kv) * hd
    if model.qk_norm and not model.is_mla:
        attn += 2 * hd
    mlp = 3 * d * inter
    if model.is_moe:
        mlp = model.num_experts * (mlp + d)  # every expert's columns, and the router's row each
        mlp += model.num_experts * model.routing.bias + 3 * d * (model.shared_intermediate_size // tp)
        mlp += d * model.shared_gate  # Qwen2-MoE's shared expert's gate, whole on every rank
    dense = model.dense_layers * 3 * d * (model.dense_intermediate_size // tp)  # DeepSeek's first layers
    layers = (model.num_layers - model.dense_layers) * (2 * d + attn + mlp) + model.dense_layers * (2 * d + attn)
    whole = model.vocab_size * d * (1 if model.tie_embeddings else 2) + d
    return (layers + dense + whole) * model.dtype_bytes
