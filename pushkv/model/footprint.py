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


def lora_slots(model: ModelConfig) -> int:
    """The adapter slots a rank's LoRA bank holds from the start (pushkv/model/lora.py): every launch adapter, and
    at least ``--max-loras`` (room for runtime loads, as vLLM keeps ``--max-loras`` on the GPU); 0 without LoRA."""
    lora = model.lora
    if not lora.enabled:
        return 0
    return max(len(lora.modules), lora.max_loras)


def lora_bank_bytes(model: ModelConfig, tp: int, slots: int = -1) -> int:
    """One TP rank's LoRA bank at ``slots`` adapters (default ``lora_slots``), each at ``--max-lora-rank`` on every
    projection an adapter may touch (q/k/v, o, and a dense MLP's gate/up and down; on an MoE model its attention
    only), the most it takes whatever the adapters hold: A [rank, in] and B [out, rank] a projection, as the bank
    lays them out (q/k/v and gate/up fused, split over ``tp`` as the base weights are)."""
    slots = lora_slots(model) if slots < 0 else slots
    if not slots:
        return 0
    r, d, hd = model.lora.max_rank, model.hidden_size, model.head_dim
    q, kv = model.num_heads // tp, max(1, model.num_kv_heads // tp)
    attn = 3 * r * d + (q + 2 * kv) * hd * 3 * r  # qkv: A [3r, d], B [q + 2 kv rows, 3r]
    attn += r * q * hd + d * r  # o: A [r, q rows], B [d, r]
    inter = (model.dense_intermediate_size if model.is_moe else model.intermediate_size) // tp
    mlp = 2 * r * d + 2 * inter * 2 * r  # gate/up: A [2r, d], B [2 inter, 2r]
    mlp += r * inter + d * r  # down: A [r, inter], B [d, r]
    dense = model.dense_layers if model.is_moe else model.num_layers  # an MoE layer's experts take no adapter
    return slots * (model.num_layers * attn + dense * mlp) * model.dtype_bytes
