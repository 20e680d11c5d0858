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
    attn = 2 * q * hd * d + 2 * kv * hd * d
    if model.qkv_bias:
        attn += (q + 2 * kv) * hd
    if model.qk_norm and not model.is_mla:
        attn += 2 * hd
    mlp = 3 * d * inter
    if model.is_moe:
        mlp = model.num_experts * (mlp + d)  # every expert's columns, and the router's row each
    layer = 2 * d + attn + mlp
    whole = model.vocab_size * d * (1 if model.tie_embeddings else 2) + d
    return (model.num_layers * layer + whole) * model.dtype_bytes
