"""Which keys a query sees: causal, and within a sliding window where the layer has one. One definition for the
torch paths (the per-sequence engine, the batched engine's MLA prefill, the paged and plain references)."""
from __future__ import annotations

import torch


def visible(qpos: torch.Tensor, kpos: torch.Tensor, window: int) -> torch.Tensor:
    """Bool, broadcast of qpos against kpos: key position <= query position, and > query position - window where
    ``window`` is set (0: no window)."""
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    return mask


def causal_mask(ctx: int, n: int, window: int, device: torch.device) -> torch.Tensor:
    """[n, ctx] bool: what each of a sequence's last n queries sees of its ctx keys."""
    return visible(torch.arange(ctx - n, ctx, device=device)[:, None], torch.arange(ctx, device=device)[None, :],
                   window)
