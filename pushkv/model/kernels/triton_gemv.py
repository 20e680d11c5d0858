"""One token's projection, y = x W^T (+ b), as a Triton GEMV: a decode step of one sequence.

At one row cuBLAS reaches 1.9-2.7 TB/s on Qwen3-30B-A3B's attention projections on an H200 (its o
projection split over K with a second reduce launch), against about 4 TB/s that reading the weight
once allows. Here each program owns ``BN`` output columns and streams their rows of W over the whole
of K, accumulating in float32, rounding once after the bias (as cuBLAS's epilogue does): enough
programs to cover every SM, no split, one launch.

``linear`` takes it for one row on a CUDA device and leaves everything else to ``F.linear``.
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from pushkv.extras import missing

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:  # a CUDA torch build without Triton
    raise missing("triton", "pushkv's CUDA kernels") from e


class GemvTile(NamedTuple):
    """Output columns a program, K a pass, warps, pipeline stages."""

    bn: int
    bk: int
    warps: int
    stages: int


# experiments/gemv_sweep.py sweeps it on a GPU; PUSHKV_GEMV_TILE=bn,bk,warps,stages overrides it (for such runs)
DEFAULT_TILE = GemvTile(16, 512, 4, 3)


def tile() -> GemvTile:
    env = os.environ.get("PUSHKV_GEMV_TILE", "")
    return GemvTile(*(int(v) for v in env.split(","))) if env else DEFAULT_TILE


@triton.jit
def _gemv_kernel(X, W, B, Y, N, Kd, stride_w, HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    rows = n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, Kd, BK):
        k = k0 + tl.arange(0, BK)
        km = k < Kd
        x = tl.load(X + k, mask=km, other=0.0).to(tl.float32)
        w = tl.load(W + rows + k[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    if HAS_BIAS:
        acc += tl.load(B + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(Y + n, acc.to(Y.dtype.element_ty), mask=nm)


def gemv(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None,
         t: Optional[GemvTile] = None) -> torch.Tensor:
    """x [1, K] (contiguous), w [N, K] (rows contiguous), b [N] or None -> [1, N] in x's dtype."""
    if x.dim() != 2 or x.shape[0] != 1 or w.dim() != 2 or w.shape[1] != x.shape[1] or w.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} and w {tuple(w.shape)} are not [1, K] and [N, K] rows")
    N, Kd = w.shape
    t = t or tile()
    x = x.contiguous()
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, t.bn),)](x, w, b if b is not None else w, y, N, Kd, w.stride(0),
                                         HAS_BIAS=b is not None, BN=t.bn, BK=t.bk, num_warps=t.warps,
                                         num_stages=t.stages)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear``, through ``gemv`` for one row on a CUDA device."""
    if x.shape[0] == 1 and x.is_cuda and x.dim() == 2 and w.stride(1) == 1:
        return gemv(x, w, b)
    return F.linear(x, w, b)
