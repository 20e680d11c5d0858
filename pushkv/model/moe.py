"""Mixture-of-experts MLP in torch: the reference (and the CPU path) the GPU's grouped kernel
is to equal.

A softmax router scores every expert per token; the top ``k`` are kept (their weights
renormalised to sum to 1 where the family does: Mixtral always, Qwen3-MoE by
``norm_topk_prob``); each expert is a SwiGLU over the tokens routed to it, and a token's output
is its experts' outputs weighted. Tokens are grouped by expert (one stable sort), so each expert
runs one matmul per projection over its whole group, not one per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route(h: torch.Tensor, router: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, d], router [E, d] -> weights [T, k] (in h's dtype) and expert ids [T, k]. The softmax
    runs in float32, as transformers' MoE blocks do, so a bf16 model picks the experts they pick."""
    probs = F.linear(h, router).float().softmax(dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(h.dtype), experts


def moe_mlp(h: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            k: int, renorm: bool) -> torch.Tensor:
    """h [T, d] (normed) -> [T, d]: the routed experts' SwiGLU outputs, weighted and summed.
    gate_up [E, 2 i, d], down [E, d, i] (this rank's i columns: a partial sum under TP)."""
    weights, experts = route(h, router, k, renorm)
    return routed_experts(h, weights, experts, gate_up, down)


def routed_experts(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """The experts' half of ``moe_mlp`` for a routing already made (weights and expert ids [T, k]):
    each projection rounded to h's dtype, each slot's output times its weight rounded, and a
    token's slots summed in h's dtype in the order of their expert ids."""
    k = experts.shape[1]
    flat = experts.flatten()
    order = flat.argsort(stable=True)  # token-slots grouped by expert, tokens in order within
    rows = order // k
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    out = torch.zeros_like(h)
    start = 0
    for e, n in enumerate(counts):
        if n:
            sel = order[start:start + n]
            r = rows[start:start + n]
            gate, up = F.linear(h[r], gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, down[e])
            out.index_add_(0, r, y * weights.flatten()[sel][:, None])
            start += n
    return out
