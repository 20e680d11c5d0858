"""RMSNorm and RoPE's rotate-half in torch: shared by the per-sequence and batched engines
(the batched engine's CUDA path fuses them in kernels/triton_fused.py, same semantics)."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In float32 like the HF reference, so checkpoints behave as trained.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)
