"""A decode step's projection of a few rows (``x @ W.T``) as a GEMV that loads its weights before it waits for
the kernel before it (Triton).

At one row a projection's cost is its weight bytes: Qwen3-30B-A3B's qkv is 21 MB and its o 17 MB a layer,
4-5 us at the H200's HBM rate, and cuBLAS takes 7.8 and 8.8 us for them
(docs/results/2026-12-03-moe-decode-launches). The weights never change during a step. So each program loads
its whole weight tile, ``BN`` output columns by all of K, first. Only then does it wait (``chain.wait_prior``)
for the kernel before it, whose output it multiplies. Under programmatic dependent launch (``kernels/chain.py``)
the programs are scheduled while that kernel still runs, and their weight bytes stream in behind it. Without it
the kernel is a plain GEMV that requests every byte of its tile at once.

Each output is a float32 dot over all of K, rounded once (with the bias, in float32, where there is one).
``F.linear`` sums in another order, so the two agree to rounding, not bit for bit. Taken for steps of up to
``batched.GEMV_TOKENS`` tokens, which is 0 (never) until experiments/moe_decode_probe.py has timed it on a GPU.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pushkv.extras import missing

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:  # a CUDA torch build without Triton
    raise missing("triton", "pushkv's CUDA kernels") from e

from pushkv.model.kernels import chain
from pushkv.model.kernels.chain import wait_prior

# weight elements a program holds (its BN x K tile), spread over 8 warps: at most 128 a thread (64 registers
# of bf16 pairs), which compiles without spills for sm_90 (python3 -m tools.kernel_sass)
TILE_ELEMENTS = 32768
WARPS = 8
# output columns a program at most: fewer hold fewer registers, so more programs (and more of the weights) are
# resident while the kernel before runs (experiments/moe_decode_probe.py times 8, 4 and 2: 2 was fastest at one
# token on an H200, 2.91 ms against 3.00 at 8 for Qwen3-30B-A3B's step)
COLUMNS = 2


@triton.jit(do_not_specialize=["T"])
def _gemv_kernel(X, W, B, Y, T, N, stride_x, stride_y, K: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PDL: tl.constexpr, NEXT_EARLY: tl.constexpr = False):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    kk = tl.arange(0, K)
    live = cols < N
    # the weights first: no kernel writes them, so they load while the kernel before this one runs
    w = tl.load(W + cols[:, None].to(tl.int64) * K + kk[None, :], mask=live[:, None], other=0.0)
    wait_prior(PDL, NEXT_EARLY)
    if HAS_BIAS:
        bias = tl.load(B + cols, mask=live, other=0.0).to(tl.float32)
    for t in range(T):
        x = tl.load(X + t * stride_x + kk).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * x[None, :], 1)
        if HAS_BIAS:
            y += bias
        tl.store(Y + t * stride_y + cols, y.to(Y.dtype.element_ty), mask=live)


def tile_for(n: int, k: int) -> Optional[tuple[int, int]]:
    """(output columns a program, warps) for an [n, k] weight, or None where the kernel does not serve it (k not
    a power of two, or more than TILE_ELEMENTS). At 2 columns, Qwen3-30B-A3B's o (2048 x 4096): 1,024 programs
    of 16 KB; its qkv (5120 x 2048): 2,560 of 8 KB."""
    if k & (k - 1) or k > TILE_ELEMENTS:
        return None
    return max(1, min(COLUMNS, TILE_ELEMENTS // k)), WARPS


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for x [T, K] (a decode step's few rows): the GEMV where a tile fits w [N, K]
    (contiguous), ``F.linear`` elsewhere."""
    T, K = x.shape
    N = w.shape[0]
    tile = tile_for(N, K)
    if tile is None or not w.is_contiguous() or x.stride(1) != 1:
        return F.linear(x, w, bias)
    bn, warps = tile
    y = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T:
        _gemv_kernel[(triton.cdiv(N, bn),)](x, w, bias if bias is not None else w, y, T, N, x.stride(0), y.stride(0),
                                            K=K, BN=bn, HAS_BIAS=bias is not None, num_warps=warps,
                                            **chain.launch(x, "gemv"))
    return y
