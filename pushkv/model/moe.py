"""Mixture-of-experts MLP in torch: the reference (and the CPU path) the GPU's grouped kernel
is to equal.

A softmax router scores every expert per token; the top ``k`` are kept (their weights
renormalised to sum to 1 where the family does: Mixtral always, Qwen3-MoE by
``norm_topk_prob``); each expert is a SwiGLU over the tokens routed to it, and a token's output
is its experts' outputs weighted. Tokens are grouped by expert (one stable sort), so each expert
runs one matmul per projection over its whole group, not one per token.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pushkv.config import MoeRouting


def route(h: torch.Tensor, router: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, d], router [E, d] -> weights [T, k] (in h's dtype) and expert ids [T, k]. The softmax
    runs in float32, as transformers' MoE blocks do, so a bf16 model picks the experts they pick."""
    probs = F.linear(h, router).float().softmax(dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(h.dtype), experts


def route_grouped(h: torch.Tensor, router: torch.Tensor, k: int, renorm: bool, routing: MoeRouting,
                  bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing, as transformers' DeepSeek-V2 and V3 routers run it (in float32): scores by softmax or
    sigmoid; with ``routing.groups`` > 1, only the ``topk_groups`` groups of experts with the best group score (its
    best expert's, or its two best summed) are chosen from; the choice ranks the scores plus ``bias`` (V3's
    correction bias), the weights are the scores without it, renormalised where ``renorm``, times
    ``routing.scale``. -> weights [T, k] in h's dtype and expert ids [T, k]."""
    logits = F.linear(h.float(), router.float())
    scores = logits.softmax(dim=-1) if routing.scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if routing.groups > 1:
        T, E = choice.shape
        grouped = choice.view(T, routing.groups, E // routing.groups)
        best = (grouped.max(dim=-1).values if routing.group_score == "max"
                else grouped.topk(2, dim=-1).values.sum(dim=-1))
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(routing.topk_groups, dim=-1).indices,
                                                                  True)
        # V2 masks the other groups' softmax scores to 0, V3 its biased sigmoid scores to -inf
        choice = choice.masked_fill(~keep.repeat_interleave(E // routing.groups, dim=1),
                                    0.0 if routing.scoring == "softmax" else float("-inf"))
    experts = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, experts)
    if renorm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * routing.scale).to(h.dtype), experts


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
