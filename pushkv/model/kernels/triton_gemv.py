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
from pushkv.model.kernels.triton_fused import _rope_head, qk_norm_rope_store
from pushkv.model.kernels.triton_paged import _cache_strides

# weight elements a program holds (its BN x K tile), spread over 8 warps: at most 128 a thread (64 registers
# of bf16 pairs), which compiles without spills for sm_90 (python3 -m tools.kernel_sass)
TILE_ELEMENTS = 32768
WARPS = 8
# output columns a program at most: fewer hold fewer registers, so more programs (and more of the weights) are
# resident while the kernel before runs (experiments/moe_decode_probe.py times 8, 4 and 2: 2 was fastest at one
# token on an H200, 2.91 ms against 3.00 at 8 for Qwen3-30B-A3B's step)
COLUMNS = 2
# A one-token step's qkv GEMV also does each head's q/k norm, RoPE and K/V store, by the head's last program
# (``qkv_rope``): no launch between the projection and the attention. Off until experiments/moe_decode_probe.py
# (variant ``rope_epilogue``) has timed it on a GPU
ROPE_EPILOGUE = False

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(dev: torch.device, n: int) -> torch.Tensor:
    """``_gemv_rope_kernel``'s per-head counters on ``dev`` (at least n): zero, and each launch leaves them zero, so
    one buffer serves every layer, step and graph replay (a device's steps run one at a time, on one stream)."""
    c = _COUNTERS.get(dev)
    if c is None or c.numel() < n:
        c = _COUNTERS[dev] = torch.zeros(max(n, 256), dtype=torch.int32, device=dev)
    return c


@triton.jit(do_not_specialize=["T"])
def _gemv_kernel(X, W, B, Y, T, N, stride_x, stride_y, K: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PDL: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    kk = tl.arange(0, K)
    live = cols < N
    # the weights first: no kernel writes them, so they load while the kernel before this one runs
    w = tl.load(W + cols[:, None].to(tl.int64) * K + kk[None, :], mask=live[:, None], other=0.0)
    wait_prior(PDL)
    if HAS_BIAS:
        bias = tl.load(B + cols, mask=live, other=0.0).to(tl.float32)
    for t in range(T):
        x = tl.load(X + t * stride_x + kk).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * x[None, :], 1)
        if HAS_BIAS:
            y += bias
        tl.store(Y + t * stride_y + cols, y.to(Y.dtype.element_ty), mask=live)


@triton.jit
def _gemv_rope_kernel(X, W, B, Y, Counter, QN, KN, Cos, Sin, Pos, Slots, Qout, cache, N, stride_cos,
                      s_blk, s_plane, s_grp, s_head, s_slot, HG, U, eps, K: tl.constexpr, BN: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                      HAS_NORM: tl.constexpr, PDL: tl.constexpr):
    """One token's fused qkv projection, then each head's q/k norm, RoPE and K/V store by the last program to
    finish its columns (a k head counts its v head's columns too), so no launch runs between the projection and
    the attention."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    kk = tl.arange(0, K)
    live = cols < N
    w = tl.load(W + cols[:, None].to(tl.int64) * K + kk[None, :], mask=live[:, None], other=0.0)
    wait_prior(PDL)
    x = tl.load(X + kk).to(tl.float32)
    y = tl.sum(w.to(tl.float32) * x[None, :], 1)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=live)
    head = (tl.program_id(0) * BN) // D
    if head >= HQ + HK:
        head -= HK  # a v head's columns count toward its k head
    parts = tl.where(head >= HQ, 2 * (D // BN), D // BN)
    # every thread's stores issued before the one atomic, whose release publishes them and whose acquire, in the
    # head's last program, makes the others' visible to it
    tl.debug_barrier()
    arrived = tl.atomic_add(Counter + head, 1, sem="acq_rel")
    if arrived == parts - 1:
        tl.atomic_xchg(Counter + head, 0, sem="relaxed")  # zero for the next launch: the kernel boundary orders it
        t = tl.zeros((1,), tl.int64)
        _rope_head(Y, QN, KN, Cos, Sin, Pos, Slots, Qout, cache, t, t < 1, head, N, stride_cos,
                   s_blk, s_plane, s_grp, s_head, s_slot, HG, U, eps, HQ, HK, D, HAS_NORM)


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
                                            **chain.launch(x))
    return y


def qkv_rope(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], q_heads: int, kv_heads: int,
             head_dim: int, q_norm, k_norm, eps: float, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``qk_norm_rope_store(linear(x, w, bias), ...)``: in one launch where ``ROPE_EPILOGUE`` is on and the step is
    one token whose GEMV tile divides a head (the same bits: each output the same float32 dot, each head the same
    norm and rotation), else the two as before."""
    T, K = x.shape
    N = w.shape[0]
    tile = tile_for(N, K)
    if (not ROPE_EPILOGUE or T != 1 or tile is None or head_dim % tile[0] or head_dim & (head_dim - 1)
            or N != (q_heads + 2 * kv_heads) * head_dim or not w.is_contiguous() or x.stride(1) != 1):
        return qk_norm_rope_store(linear(x, w, bias), q_heads, kv_heads, head_dim, q_norm, k_norm, eps, cos, sin,
                                  positions, slots, cache)
    bn, warps = tile
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    q = torch.empty(1, q_heads, head_dim, device=x.device, dtype=x.dtype)
    blk, plane, grp, hd, slot, hg, u = _cache_strides(cache)
    has_norm = q_norm is not None
    _gemv_rope_kernel[(triton.cdiv(N, bn),)](
        x, w, bias if bias is not None else w, y, _counters(x.device, q_heads + kv_heads),
        q_norm if has_norm else y, k_norm if has_norm else y, cos, sin, positions, slots, q, cache, N, cos.stride(0),
        blk, plane, grp, hd, slot, hg, u, eps, K=K, BN=bn, HAS_BIAS=bias is not None, HQ=q_heads, HK=kv_heads,
        D=head_dim, HAS_NORM=has_norm, num_warps=warps, **chain.launch(x))
    return q
