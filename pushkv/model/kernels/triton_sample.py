"""A step's sampling in one Triton launch: one program per row.

On a GPU host a sampler written as torch ops is bound by their launches, not by
bytes: ~15 host-side calls of 10-20 us each for temperature alone, ~50 with top_k
and top_p (the multi-block ``topk`` on one long row is a dozen kernels), against
under 0.1 ms of kernel time (``pushkv-sampling-bench --profile``). This kernel
does a row's whole draw in one program, reading the row a few times from L2:

- every row: max, its first index (greedy) and the sum of exp(x - max);
- mode PLAIN (temperature only): the inverse-CDF draw in vocabulary order: the
  row's tile masses, the tile the target falls in, a cumulative sum inside it;
- mode TOPK / WINDOW (top_k, min_p, top_p): the K-th largest value by radix
  select (four 8-bit digit histograms over order-preserving integer keys), the K
  candidates gathered (ties by lowest id), sorted, then the filters and the draw
  exactly as ``sampling._draw_window`` does on ``topk``'s output. K is the row's
  top_k, or ``CAND`` (the torch path's ``WINDOW``) for a row without one; such a
  row whose kept set may reach past the window is answered -1 (the caller sorts
  its whole row, as the torch path does), and so is a row of mode WHOLE (top_k
  above CAND).

Rows are independent (one program each, a fixed tile order), so a row's token
does not depend on the batch it is in: the property P/D disaggregation needs.
The values: ``x = logits * inv_t``; ``params`` rows are (inv_t, k, min_p, top_p,
u, mode) in float32 (k and u are exact in it).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

GREEDY, PLAIN, TOPK, WINDOW, WHOLE = 0, 1, 2, 3, 4  # WHOLE: answered -1 at once (top_k > CAND)
NPARAM = 6
CAND = 1024  # candidates a filtered row sorts: the largest top_k served here, and the window without one
BLOCK = int(os.environ.get("PUSHKV_SAMPLE_BLOCK", "4096"))  # a tile of the row (env: tuning runs)
WARPS = int(os.environ.get("PUSHKV_SAMPLE_WARPS", "8"))


@triton.jit
def _key(x):
    """float32 -> uint32 with the same order (sign flipped for >= 0, all bits for < 0)."""
    b = x.to(tl.uint32, bitcast=True)
    return b ^ tl.where((b >> 31) != 0, 0xFFFFFFFF, 0x80000000)


@triton.jit
def _unkey(k):
    b = tl.where((k >> 31) != 0, k ^ 0x80000000, k ^ 0xFFFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _below(t):
    """The float32 just below a positive ``t`` (torch.nextafter(t, 0))."""
    return (t.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)


@triton.jit
def _plain(xr, V, inv_t, m, u, tsum, offs, BLOCK: tl.constexpr, NTP: tl.constexpr):
    """Inverse CDF over exp(x - m) in vocabulary order: the first id whose cumulative mass
    exceeds u * total (never a zero-mass id)."""
    nt = tl.cdiv(V, BLOCK)
    for t in range(0, nt):
        idx = t * BLOCK + offs
        msk = idx < V
        x = tl.load(xr + idx, mask=msk, other=float("-inf")) * inv_t
        tl.store(tsum + t, tl.sum(tl.where(msk & (x > float("-inf")), tl.exp(x - m), 0.0), 0))
    tl.debug_barrier()
    ti = tl.arange(0, NTP)
    ts = tl.load(tsum + ti, mask=ti < nt, other=0.0)
    tcum = tl.cumsum(ts, 0)
    total = tl.max(tcum, 0)
    target = tl.minimum(u * total, _below(total))
    sel = tl.minimum(tl.sum((tcum <= target).to(tl.int32), 0), nt - 1)
    before = tl.sum(tl.where(ti == sel - 1, tcum, 0.0), 0)
    idx = sel * BLOCK + offs
    msk = idx < V
    x = tl.load(xr + idx, mask=msk, other=float("-inf")) * inv_t
    e = tl.where(msk & (x > float("-inf")), tl.exp(x - m), 0.0)
    c = before + tl.cumsum(e, 0)
    n = tl.sum((msk & (c <= target)).to(tl.int32), 0)
    last = tl.max(tl.where(e > 0, idx, -1), 0)  # rounding left the target past the tile's end
    return tl.where(sel * BLOCK + n > last, last, sel * BLOCK + n)


@triton.jit
def _filtered(xr, V, inv_t, m, z, K, min_p, top_p, u, is_window, cand, offs,
              BLOCK: tl.constexpr, CAND: tl.constexpr):
    """top_k -> min_p -> top_p -> draw over the K largest values (see the module doc)."""
    # the K-th largest key, one 8-bit digit at a time from the top
    prefix = tl.zeros([], tl.uint32)
    pmask = tl.zeros([], tl.uint32)
    rem = K
    bins = tl.arange(0, 256)
    for step in tl.static_range(4):
        hist = tl.zeros([256], tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            msk = idx < V
            k = _key(tl.load(xr + idx, mask=msk, other=0.0) * inv_t)
            match = msk & ((k & pmask) == prefix)
            hist += tl.histogram(((k >> (24 - 8 * step)) & 255).to(tl.int32), 256, mask=match)
        ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # how many have a digit >= d
        d = tl.max(tl.where(ge >= rem, bins, -1), 0)
        rem = rem - tl.sum(tl.where(bins > d, hist, 0), 0)
        prefix = prefix | (d.to(tl.uint32) << (24 - 8 * step))
        pmask = pmask | (tl.full([], 255, tl.uint32) << (24 - 8 * step))
    # gather the K candidates: every key above it, then the first ``rem`` equal to it
    base = 0
    eq_seen = 0
    for start in range(0, V, BLOCK):
        idx = start + offs
        msk = idx < V
        k = _key(tl.load(xr + idx, mask=msk, other=0.0) * inv_t)
        gt = msk & (k > prefix)
        eq = msk & (k == prefix)
        eqi = eq.to(tl.int32)
        take = gt | (eq & ((eq_seen + tl.cumsum(eqi, 0)) <= rem))
        ti = take.to(tl.int32)
        pos = base + tl.cumsum(ti, 0) - 1
        packed = (k.to(tl.uint64) << 32) | (idx.to(tl.uint32) ^ 0xFFFFFFFF).to(tl.uint64)
        tl.store(cand + pos, packed, mask=take)
        base += tl.sum(ti, 0)
        eq_seen += tl.sum(eqi, 0)
    tl.debug_barrier()
    j = tl.arange(0, CAND)
    valid = j < K
    c = tl.sort(tl.load(cand + j, mask=valid, other=0), descending=True)
    v = _unkey((c >> 32).to(tl.uint32))
    ids = ((c & 0xFFFFFFFF).to(tl.uint32) ^ 0xFFFFFFFF).to(tl.int32)
    e = tl.where(valid, tl.exp(v - m), 0.0)  # m is the row's max: the first candidate
    keep = valid & (e >= min_p)
    w = tl.where(keep, e, 0.0)
    kept = tl.sum(w, 0)
    cum = tl.cumsum(w, 0)
    last_kept = tl.sum(tl.where(j == K - 1, keep.to(tl.int32), 0), 0) > 0
    covered = (is_window == 0) | (~last_kept) | (K >= V)  # nothing kept lies past the window
    total = tl.where(covered, kept, z)  # without top_k, top_p is of the whole row's mass
    keep = keep & ((cum - w) < top_p * total)
    spill = (~covered) & (tl.max(cum, 0) < top_p * total)
    ww = tl.where(keep, e, 0.0)
    cdf = tl.cumsum(ww, 0)
    tot = tl.max(cdf, 0)
    target = tl.minimum(u * tot, _below(tot))
    n = tl.minimum(tl.sum((valid & (cdf <= target)).to(tl.int32), 0), K - 1)
    tok = tl.sum(tl.where(j == n, ids, 0), 0)
    return tl.where(spill, -1, tok)


@triton.jit
def _sample_kernel(X, stride, P, Out, Cand, Tsum, V,
                   BLOCK: tl.constexpr, CAND: tl.constexpr, NTP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    xr = X + row * stride
    p = P + row * 6
    inv_t = tl.load(p)
    K = tl.load(p + 1).to(tl.int32)
    min_p = tl.load(p + 2)
    top_p = tl.load(p + 3)
    u = tl.load(p + 4)
    mode = tl.load(p + 5).to(tl.int32)
    offs = tl.arange(0, BLOCK)
    # every row: max, its first index, sum of exp(x - max) (online over the tiles)
    m = tl.full([], float("-inf"), tl.float32)
    z = tl.zeros([], tl.float32)
    am = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        msk = idx < V
        x = tl.load(xr + idx, mask=msk, other=float("-inf")) * inv_t
        tm, ta = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        am = tl.where(tm > m, start + ta, am)
        nm = tl.maximum(m, tm)
        scale = tl.where(m == nm, 1.0, tl.exp(m - nm))
        z = z * scale + tl.sum(tl.where(x > float("-inf"), tl.exp(x - nm), 0.0), 0)
        m = nm
    if mode == 0:
        tl.store(Out + row, am.to(tl.int64))
    elif mode == 1:
        tl.store(Out + row, _plain(xr, V, inv_t, m, u, Tsum + row * NTP, offs, BLOCK, NTP).to(tl.int64))
    elif mode < 4:
        tok = _filtered(xr, V, inv_t, m, z, K, min_p, top_p, u, (mode == 3).to(tl.int32),
                        Cand + row * CAND, offs, BLOCK, CAND)
        tl.store(Out + row, tok.to(tl.int64))
    else:
        tl.store(Out + row, tl.full([], -1, tl.int64))


_SCRATCH: dict = {}  # (device, rows, ntp) -> (candidates, tile sums): reused, never shrunk


def _scratch(dev: torch.device, rows: int, ntp: int):
    key = (dev, ntp)
    s = _SCRATCH.get(key)
    if s is None or s[0].shape[0] < rows:
        n = max(rows, 64)
        s = _SCRATCH[key] = (torch.empty(n, CAND, dtype=torch.uint64, device=dev),
                             torch.empty(n, ntp, dtype=torch.float32, device=dev))
    return s


def sample_rows(x: torch.Tensor, params: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Tokens (int64 [rows]) for float32 logits ``x`` [rows, vocab] and ``params`` [rows, 6]
    (inv_t, k, min_p, top_p, u, mode); -1 where a WINDOW row needs its whole row sorted."""
    rows, vocab = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    ntp = triton.next_power_of_2(triton.cdiv(vocab, block))
    cand, tsum = _scratch(x.device, rows, ntp)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows:
        _sample_kernel[(rows,)](x, x.stride(0), params, out, cand, tsum, vocab,
                                BLOCK=block, CAND=CAND, NTP=ntp, num_warps=WARPS)
    return out
