"""A LoRA delta for a step of a few rows in two Triton launches (pushkv/model/lora.py's ``LoraStep.add``).

The torch form of a projection's delta is three launches: ``x A^T`` over every slot of the bank, the mask that keeps
each row's own slot's columns, and ``y += u B^T``. At a decode step each moves a few hundred KB, so each costs its
launch, not its bytes: on an H100 a Qwen3-8B step through a rank-16 adapter on every projection took 1.29-1.32x the
base model's, 12 small launches a layer (docs/results/2026-12-06-lora-gpu). Here:

- ``_shrink_kernel``: ``x A^T`` split over the bank's columns and over K, each program a float32 partial of its
  columns for every row (the split gives a few columns of a wide K enough programs to read A at the HBM's rate);
  a program whose columns belong to slots no row of the step uses reads and writes nothing;
- ``_expand_kernel``: each program sums the partials in a fixed order, rounds them to the step's dtype (as torch's
  ``x.mm(A.t())`` rounds), keeps each row's own slot's columns, and adds ``u B^T`` to its tile of ``y`` in float32,
  rounded once (as ``addmm_`` with beta 1 does), skipping each chunk of columns no row keeps.

So a step reads A and B of the slots its rows use, not of every adapter the bank holds: a deployment serving many
adapters pays for those a step runs (at most ``--max-loras``), where torch's form multiplies by every slot.

The dots take their tiles in float32 (TF32 on the tensor cores, which holds a 16-bit model's values exactly; IEEE
float32 for a float32 model): the same arithmetic as the torch form up to the order of each float32 sum, so the two
agree to rounding, not bit for bit. Taken for steps of up to ``TOKENS`` rows on CUDA (a graph bucket bound: a step
sums alike replayed or eager).
"""
from __future__ import annotations

import torch

from pushkv.extras import missing

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:  # a CUDA torch build without Triton
    raise missing("triton", "pushkv's CUDA kernels") from e

# steps of up to this many rows take the kernels (0: never, the torch form always)
TOKENS = 64
BN, BK = 16, 128  # the shrink's tile: bank columns a program, K a chunk
BO = 64  # the expand's output columns a program
PROGRAMS = 128  # the shrink's programs at most: the split over K gives a few columns this many
PARTIAL_ROWS = 256  # split x rows of partials each expand program sums at most (its reads of them from L2)


@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(X, A, Slots, P, T, K, N, W, stride_x, KS, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   IEEE: tl.constexpr, SKIP: tl.constexpr):
    # P[s, t, n] = sum over this split's K of X[t, k] A[n, k], for the columns of the slots the step's rows use (the
    # others are left unwritten: the expand masks them off; SKIP False: every column, a bank of one slot)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    split = tl.program_id(1)
    rows = tl.arange(0, BT)
    go = True
    if SKIP:
        row_slot = tl.load(Slots + rows, mask=rows < T, other=0)
        first, last = (tl.program_id(0) * BN) // W + 1, (tl.program_id(0) * BN + BN - 1) // W + 1
        go = tl.sum(((row_slot >= first) & (row_slot <= last)).to(tl.int32), 0) > 0
    if go:
        acc = tl.zeros((BT, BN), dtype=tl.float32)
        for k0 in range(split * KS, tl.minimum(split * KS + KS, K), BK):
            kk = k0 + tl.arange(0, BK)
            kin = kk < tl.minimum(split * KS + KS, K)
            x = tl.load(X + rows[:, None] * stride_x + kk[None, :], mask=(rows[:, None] < T) & kin[None, :],
                        other=0.0)
            a = tl.load(A + cols[None, :].to(tl.int64) * K + kk[:, None], mask=(cols[None, :] < N) & kin[:, None],
                        other=0.0)
            x, a = x.to(tl.float32), a.to(tl.float32)  # a 16-bit value is exact in TF32
            if IEEE:
                acc = tl.dot(x, a, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, a, acc)
        out = P + split * BT * N + rows[:, None] * N + cols[None, :]
        tl.store(out, acc, mask=(rows[:, None] < T) & (cols[None, :] < N))


@triton.jit
def _uses(bits_a, lo_a, hi_a, bits_b, lo_b, hi_b):
    return bits_a | bits_b, tl.minimum(lo_a, lo_b), tl.maximum(hi_a, hi_b)


@triton.jit(do_not_specialize=["T"])
def _expand_kernel(P, Slots, B, Y, T, N, O, W, stride_y, SPLITS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                   BO: tl.constexpr, IEEE: tl.constexpr, SKIP: tl.constexpr, BITS: tl.constexpr):
    # Y[t, o] += sum over n of round(sum_s P[s, t, n]) * (slot[t] == n // W + 1) * B[o, n]
    outs = tl.program_id(0) * BO + tl.arange(0, BO)
    rows = tl.arange(0, BT)
    live = rows < T
    slot = tl.load(Slots + rows, mask=live, other=0)
    acc = tl.zeros((BT, BO), dtype=tl.float32)
    # in one reduction over the rows: the slots they use, a bit each (BITS: a bank of at most 61 slots), so each
    # chunk's test is scalar work; and the lowest and the highest, so the loop walks the chunks between them, not
    # the whole bank (every chunk walked, the expand took 2.1x as long with 16 adapters held as with one)
    # (SKIP False, a bank of one slot: no test, every chunk; a test before the loads cost a step through the one
    # adapter 1.2-1.5 % on an H100, where nothing is left to skip)
    start, end = 0, N
    if SKIP:
        adapted = live & (slot > 0)
        used, lo, hi = tl.reduce((tl.where(live, tl.full((BT,), 1, tl.int64) << slot.to(tl.int64), 0),
                                  tl.where(adapted, slot, 2147483647), tl.where(adapted, slot, 0)), 0, _uses)
        start, end = tl.minimum(lo - 1, hi) * W // BN * BN, hi * W
    for n0 in range(start, end, BN):
        nn = n0 + tl.arange(0, BN)
        keep = live[:, None] & (nn[None, :] < N) & (slot[:, None] == nn[None, :] // W + 1)
        wanted = True
        if SKIP and BITS:
            first, last = n0 // W + 1, (n0 + BN - 1) // W + 1
            wanted = (used & ((tl.full((), 2, tl.int64) << last) - (tl.full((), 1, tl.int64) << first))) != 0
        if wanted:  # a chunk of slots no row uses: neither its partials nor its B are read
            u = tl.zeros((BT, BN), dtype=tl.float32)
            for s in range(SPLITS):
                u += tl.load(P + s * BT * N + rows[:, None] * N + nn[None, :], mask=keep, other=0.0)
            u = u.to(Y.dtype.element_ty).to(tl.float32)
            b = tl.load(B + outs[None, :].to(tl.int64) * N + nn[:, None],
                        mask=(outs[None, :] < O) & (nn[:, None] < N), other=0.0).to(tl.float32)
            if IEEE:
                acc = tl.dot(u, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(u, b, acc)
    m = live[:, None] & (outs[None, :] < O)
    at = Y + rows[:, None] * stride_y + outs[None, :]
    y = tl.load(at, mask=m, other=0.0)
    tl.store(at, (y.to(tl.float32) + acc).to(Y.dtype.element_ty), mask=m)


def splits_for(t: int, k: int, n: int) -> int:
    """How many parts the shrink's K is split in: enough for ``PROGRAMS`` programs over ``n`` columns (one slot's:
    those of the slots no row uses do nothing, so a bank of many adapters must not thin out the split of the one a
    step runs), each part at least a chunk of K, and at most ``PARTIAL_ROWS`` split x rows for each expand program
    to sum."""
    rows = max(16, triton.next_power_of_2(t))
    return max(1, min(PROGRAMS // triton.cdiv(n, BN), k // BK, PARTIAL_ROWS // rows))


def add_delta(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
              width: int) -> torch.Tensor:
    """``y += ((x A^T) * mask) B^T`` in place, the mask keeping row t's columns of slot ``slots[t]`` (each slot
    ``width`` columns of the bank: slot s in [(s - 1) width, s width)); y [T, O], x [T, K] (unit stride on K), a
    [N, K] and b [O, N] contiguous, slots [T] int32, T at most ``TOKENS``."""
    T, K = x.shape
    N, O = a.shape[0], b.shape[0]
    if not T:
        return y
    bt = max(16, triton.next_power_of_2(T))
    splits = splits_for(T, K, width)
    ks = triton.cdiv(triton.cdiv(K, splits), BK) * BK
    splits = triton.cdiv(K, ks)
    partial = torch.empty((splits, bt, N), dtype=torch.float32, device=x.device)
    ieee = x.dtype == torch.float32  # a float32 model's dots in float32, not TF32
    skip = N > width  # a bank of more than one slot: the slots no row uses are skipped
    _shrink_kernel[(triton.cdiv(N, BN), splits)](x, a, slots, partial, T, K, N, width, x.stride(0), ks, BT=bt, BN=BN,
                                                 BK=BK, IEEE=ieee, SKIP=skip, num_warps=4)
    _expand_kernel[(triton.cdiv(O, BO),)](partial, slots, b, y, T, N, O, width, y.stride(0), SPLITS=splits, BT=bt,
                                          BN=BN, BO=BO, IEEE=ieee, SKIP=skip, BITS=triton.cdiv(N, width) <= 61,
                                          num_warps=4)
    return y
