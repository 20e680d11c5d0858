"""A step's sampling in one Triton launch.

On a GPU host a sampler written as torch ops is bound by its launches, not by bytes:
~15 host-side calls of 10-20 us each for temperature alone, ~50 with top_k and top_p
(``topk`` on one long row is a dozen kernels), against under 0.1 ms of kernel time
(``pushkv sampling-bench --profile``). Here a step's sampling is one launch of
(segments x rows) programs; a segment is one ``BLOCK`` tile of a row's vocabulary,
held in registers:

- every program: its segment's max, the max's first id, and the sum of exp(x - max);
  for a filtered row (top_k, min_p or top_p), also its segment's ``KS`` largest keys
  (radix select: four 8-bit digit histograms over order-preserving integer keys; ties
  by lowest id), written as candidates, and the KS-th key;
- the row's last program to finish (an arrival counter per row, the split-K pattern)
  merges: greedy takes the first id of the row's max; the plain draw (temperature
  only) is the inverse CDF in vocabulary order (segment masses in float64, the target
  segment's cumulative sum); a filtered row sorts its candidates and applies
  top_k -> min_p -> top_p -> the draw exactly as ``sampling._draw_window`` does on
  ``topk``'s output (K = top_k, or ``CAND`` without one).

Candidates are exact where it matters: a segment holds back only keys at or below its
KS-th, so when every segment's KS-th key lies below the smallest key the row's
decision reads, the sorted candidates are the row's true order down to it. A row
where that fails, whose nucleus reaches past the window (the torch path's spill), or
whose top_k exceeds CAND, is answered -1 and the caller sorts its whole row.

Rows never read each other, and a row's work splits the same way in any batch, so a
token does not depend on the batch it was drawn in: what P/D disaggregation needs.
``x = logits * inv_t``; ``params`` rows are (inv_t, k, min_p, top_p, u, mode) in
float32 (k and u are exact in it).
"""
from __future__ import annotations

import torch

from pushkv.extras import missing

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:  # a CUDA torch build without Triton
    raise missing("triton", "pushkv's CUDA kernels") from e

GREEDY, PLAIN, TOPK, WINDOW, WHOLE = 0, 1, 2, 3, 4  # WHOLE: answered -1 at once (top_k > CAND)
NPARAM = 6
CAND = 1024  # the largest top_k served here, and the window of a row without one (sampling.WINDOW)
# The tuning runs' winners on an H200 (pushkv sampling-bench); a test that wants several segments
# of a small vocabulary passes ``block`` or sets BLOCK in its own process
KS = 64  # candidates a segment gives
BLOCK = 8192  # a segment's length
WARPS = 16  # per program


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
def _below32(t):
    """The float32 just below a positive ``t`` (torch.nextafter(t, 0))."""
    return (t.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)


@triton.jit
def _below64(t):
    return (t.to(tl.int64, bitcast=True) - 1).to(tl.float64, bitcast=True)


@triton.jit
def _segment_candidates(x, idx, msk, cand, KS: tl.constexpr):
    """Write this segment's KS largest keys (packed with their ids, ties by lowest id) to
    ``cand[0:KS]`` (0 where the segment has fewer); return the KS-th key (0: all taken)."""
    k = tl.where(msk, _key(x), 0)
    nvalid = tl.sum(msk.to(tl.int32), 0)
    prefix = tl.zeros([], tl.uint32)
    pmask = tl.zeros([], tl.uint32)
    rem = tl.minimum(nvalid, KS)
    bins = tl.arange(0, 256)
    for step in tl.static_range(4):  # the rem-th largest key, one 8-bit digit at a time
        match = msk & ((k & pmask) == prefix)
        hist = tl.histogram(((k >> (24 - 8 * step)) & 255).to(tl.int32), 256, mask=match)
        ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # how many have a digit >= d
        d = tl.max(tl.where(ge >= rem, bins, -1), 0)
        rem = rem - tl.sum(tl.where(bins > d, hist, 0), 0)
        prefix = prefix | (d.to(tl.uint32) << (24 - 8 * step))
        pmask = pmask | (tl.full([], 255, tl.uint32) << (24 - 8 * step))
    gt = msk & (k > prefix)
    eq = msk & (k == prefix)
    take = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= rem))
    pos = tl.cumsum(take.to(tl.int32), 0) - 1
    j = tl.arange(0, KS)
    tl.store(cand + j, tl.zeros([KS], tl.uint64))
    tl.debug_barrier()
    packed = (k.to(tl.uint64) << 32) | (idx.to(tl.uint32) ^ 0xFFFFFFFF).to(tl.uint64)
    tl.store(cand + pos, packed, mask=take)
    return tl.where(nvalid > KS, prefix, 0).to(tl.int64)


@triton.jit
def _last_to_arrive(count, S):
    """True in the row's last program to finish its segment, which then merges (acq_rel: the
    others' writes are visible to it); it leaves the counter at zero for the next launch."""
    tl.debug_barrier()
    last = tl.atomic_add(count, 1, sem="acq_rel") == S - 1
    if last:
        tl.store(count, 0)
    tl.debug_barrier()
    return last


@triton.jit
def _row_mass(parts, ti, S, NS: tl.constexpr):
    """The segments' maxima and exp-sums, the row's max, and its sum of exp(x - max) in float64."""
    m_all = tl.load(parts + ti, mask=ti < S, other=float("-inf"), cache_modifier=".cg")
    z_all = tl.load(parts + NS + ti, mask=ti < S, other=0.0, cache_modifier=".cg")
    m = tl.max(m_all, 0)
    z = tl.sum(tl.where(ti < S, z_all.to(tl.float64) * tl.exp((m_all - m).to(tl.float64)), 0.0), 0)
    return m_all, z_all, m, z


@triton.jit
def _sorted_candidates(cand, S, KS: tl.constexpr, CB: tl.constexpr):
    """The row's candidates, largest first: (keys, ids, how many are real)."""
    j = tl.arange(0, CB)
    c = tl.sort(tl.load(cand + j, mask=j < S * KS, other=0, cache_modifier=".cg"), descending=True)
    kk = (c >> 32).to(tl.uint32)
    ids = ((c & 0xFFFFFFFF).to(tl.uint32) ^ 0xFFFFFFFF).to(tl.int32)
    return kk, ids, tl.sum((kk != 0).to(tl.int32), 0)


@triton.jit
def _held_back(taus, ti, S, floor):
    """Whether a segment may have kept back a key at or above ``floor`` (its KS-th key is)."""
    return tl.max(((ti < S) & (taus != 0) & (taus >= floor)).to(tl.int32), 0) > 0


@triton.jit
def _plain(xr, V, inv_t, ms, zs, ti, S, u, offs, BLOCK: tl.constexpr):
    """Inverse CDF over exp(x - max) in vocabulary order: the first id whose cumulative mass
    exceeds u * total (never a zero-mass id)."""
    m = tl.max(ms, 0)
    t = tl.where(ti < S, zs.to(tl.float64) * tl.exp((ms - m).to(tl.float64)), 0.0)
    tcum = tl.cumsum(t, 0)
    total = tl.max(tcum, 0)
    target = tl.minimum(u.to(tl.float64) * total, _below64(total))
    sel = tl.minimum(tl.sum(((tcum <= target) & (ti < S)).to(tl.int32), 0), S - 1)
    before = tl.sum(tl.where(ti == sel - 1, tcum, 0.0), 0)
    idx = sel * BLOCK + offs
    msk = idx < V
    x = tl.load(xr + idx, mask=msk, other=float("-inf")) * inv_t
    e = tl.where(msk & (x > float("-inf")), tl.exp(x - m), 0.0)
    c = before + tl.cumsum(e.to(tl.float64), 0)
    n = tl.sum((msk & (c <= target)).to(tl.int32), 0)
    last = tl.max(tl.where(e > 0, idx, -1), 0)  # rounding left the target past the segment's end
    return tl.minimum(sel * BLOCK + n, last)


@triton.jit
def _filtered(cand, taus, ti, S, m, z, K, V, min_p, top_p, u, is_window, KS: tl.constexpr, CB: tl.constexpr):
    """top_k -> min_p -> top_p -> draw over the sorted candidates (see the module doc)."""
    j = tl.arange(0, CB)
    kk, ids, nvalid = _sorted_candidates(cand, S, KS, CB)
    valid = (j < K) & (kk != 0)
    e = tl.where(valid, tl.exp(_unkey(kk) - m), 0.0)  # m is the row's max: the first candidate
    keep = valid & (e >= min_p)
    under = valid & (e < min_p)
    w = tl.where(keep, e, 0.0)
    kept = tl.sum(w, 0)
    cum = tl.cumsum(w, 0)
    # nothing kept lies past the window: top_k, or min_p cut inside it, or it is the whole row
    covered = (is_window == 0) | (tl.max(under.to(tl.int32), 0) > 0) | (K >= V)
    total = tl.where(covered, kept, z)  # without top_k, top_p is of the whole row's mass
    keep = keep & ((cum - w) < top_p * total)
    spill = (~covered) & (tl.max(cum, 0) < top_p * total)
    # the deepest position the decision read: the k-th (top_k's set and mass), the first under
    # min_p (where min_p cuts), else the last kept (top_p's prefix)
    first_under = tl.min(tl.where(under, j, K - 1), 0)
    last_kept = tl.max(tl.where(keep, j, 0), 0)
    deep = tl.where(is_window == 0, K - 1, tl.where(min_p > 0, first_under, last_kept))
    floor = tl.sum(tl.where(j == deep, kk, 0).to(tl.int64), 0)
    spill = spill | _held_back(taus, ti, S, floor) | (deep >= nvalid)
    ww = tl.where(keep, e, 0.0)
    cdf = tl.cumsum(ww, 0)
    tot = tl.max(cdf, 0)
    target = tl.minimum(u * tot, _below32(tot))
    n = tl.minimum(tl.sum((valid & (cdf <= target)).to(tl.int32), 0), K - 1)
    tok = tl.sum(tl.where(j == n, ids, 0), 0)
    return tl.where(spill, -1, tok)


@triton.jit
def _sample_kernel(X, stride, P, Out, Parts, Taus, Cand, Count, V,
                   BLOCK: tl.constexpr, KS: tl.constexpr, NS: tl.constexpr):
    s = tl.program_id(0)
    S = tl.num_programs(0)
    row = tl.program_id(1).to(tl.int64)
    xr = X + row * stride
    p = P + row * 6
    inv_t = tl.load(p)
    mode = tl.load(p + 5).to(tl.int32)
    offs = tl.arange(0, BLOCK)
    idx = s * BLOCK + offs
    msk = idx < V
    x = tl.load(xr + idx, mask=msk, other=float("-inf")) * inv_t
    ms, am = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    zs = tl.sum(tl.where(x > float("-inf"), tl.exp(x - ms), 0.0), 0)
    parts = Parts + row * 3 * NS
    tl.store(parts + s, ms)
    tl.store(parts + NS + s, zs)
    tl.store(parts + 2 * NS + s, (s * BLOCK + am).to(tl.float32))  # ids < 2^24: exact
    cand = Cand + row * NS * KS
    if (mode == 2) | (mode == 3):
        tl.store(Taus + row * NS + s, _segment_candidates(x, idx, msk, cand + s * KS, KS))
    if _last_to_arrive(Count + row, S):
        ti = tl.arange(0, NS)
        m_all, z_all, m, z = _row_mass(parts, ti, S, NS)
        if mode == 0:
            first = tl.min(tl.where((m_all == m) & (ti < S), ti, NS), 0)
            a_all = tl.load(parts + 2 * NS + ti, mask=ti < S, other=0.0, cache_modifier=".cg")
            tok = tl.sum(tl.where(ti == first, a_all, 0.0), 0).to(tl.int32)
        elif mode == 1:
            tok = _plain(xr, V, inv_t, m_all, z_all, ti, S, tl.load(p + 4), offs, BLOCK)
        elif mode < 4:
            taus = tl.load(Taus + row * NS + ti, mask=ti < S, other=0, cache_modifier=".cg")
            tok = _filtered(cand, taus, ti, S, m, z.to(tl.float32), tl.load(p + 1).to(tl.int32), V,
                            tl.load(p + 2), tl.load(p + 3), tl.load(p + 4), (mode == 3).to(tl.int32), KS, NS * KS)
        else:
            tok = tl.full([], -1, tl.int32)
        tl.store(Out + row, tok.to(tl.int64))


class _Scratch:
    """Per device and kernel: the merge's buffers (reused; grown, never shrunk) and the arrival
    counters, which every launch leaves at zero."""

    def __init__(self, dev: torch.device, rows: int, ns: int, ks: int, out_cols: int, out_dtype):
        self.rows, self.ns, self.ks = rows, ns, ks
        self.parts = torch.empty(rows, 3, ns, dtype=torch.float32, device=dev)
        self.taus = torch.empty(rows, ns, dtype=torch.int64, device=dev)
        self.cand = torch.empty(rows, ns * ks, dtype=torch.uint64, device=dev)
        self.count = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.out = torch.empty(rows, out_cols, dtype=out_dtype, device=dev)


_SCRATCH: dict = {}


def _scratch(kind: str, dev: torch.device, rows: int, ns: int, ks: int, out_cols: int, out_dtype) -> _Scratch:
    s = _SCRATCH.get((kind, dev))
    if s is None or s.rows < rows or s.ns != ns:
        s = _SCRATCH[(kind, dev)] = _Scratch(dev, max(rows, 64, s.rows if s is not None else 0), ns, ks, out_cols,
                                             out_dtype)
    return s


def sample_rows(x: torch.Tensor, params: torch.Tensor, block: int = 0) -> torch.Tensor:
    """Tokens (int64 [rows], a view of a reused buffer: read it before the next call) for float32
    logits ``x`` [rows, vocab] and ``params`` [rows, 6]; -1 where the caller must sort the row."""
    block = block or BLOCK
    rows, vocab = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    segs = triton.cdiv(vocab, block)
    sc = _scratch("sample", x.device, rows, triton.next_power_of_2(segs), KS, 1, torch.int64)
    if rows:
        _sample_kernel[(segs, rows)](x, x.stride(0), params, sc.out, sc.parts, sc.taus, sc.cand, sc.count, vocab,
                                     BLOCK=block, KS=KS, NS=sc.ns, num_warps=WARPS)
    return sc.out[:rows, 0]


# -- log-probabilities: the same segments, over the raw logits ---------------------------------
LP_MAX = 20  # top_logprobs the API allows (pushkv/limits.py MAX_LOGPROBS, which the schedulers check)
LP_KS = 32  # candidates a segment gives (>= LP_MAX)


@triton.jit
def _logprob_kernel(X, stride, Rows, Tok, N, Out, Parts, Taus, Cand, Count, V,
                    BLOCK: tl.constexpr, KS: tl.constexpr, NS: tl.constexpr, W: tl.constexpr):
    """Per row of ``Rows``: log p(token) = x[token] - logsumexp(x), and the row's ``N`` largest
    log-probabilities with their ids, in ``Out[r] = (chosen, values[W], ids[W], exact)``; exact is 0
    where a segment held back a value the top ``N`` needed (the caller redoes that row)."""
    s = tl.program_id(0)
    S = tl.num_programs(0)
    r = tl.program_id(1).to(tl.int64)
    row = tl.load(Rows + r).to(tl.int64)
    xr = X + row * stride
    offs = tl.arange(0, BLOCK)
    idx = s * BLOCK + offs
    msk = idx < V
    x = tl.load(xr + idx, mask=msk, other=float("-inf"))
    ms = tl.max(x, 0)
    zs = tl.sum(tl.where(x > float("-inf"), tl.exp(x - ms), 0.0), 0)
    parts = Parts + r * 3 * NS
    tl.store(parts + s, ms)
    tl.store(parts + NS + s, zs)
    cand = Cand + r * NS * KS
    tl.store(Taus + r * NS + s, _segment_candidates(x, idx, msk, cand + s * KS, KS))
    if _last_to_arrive(Count + r, S):
        ti = tl.arange(0, NS)
        m_all, z_all, m, z = _row_mass(parts, ti, S, NS)
        lse = m + tl.log(z.to(tl.float32))
        out = Out + r * (2 * W + 2)
        tl.store(out, tl.load(xr + tl.load(Tok + row)) - lse)
        n = tl.load(N + r)
        j = tl.arange(0, NS * KS)
        kk, ids, nvalid = _sorted_candidates(cand, S, KS, NS * KS)
        floor = tl.sum(tl.where(j == n - 1, kk, 0).to(tl.int64), 0)
        taus = tl.load(Taus + r * NS + ti, mask=ti < S, other=0, cache_modifier=".cg")
        held_back = _held_back(taus, ti, S, floor) & (n > 0)
        tl.store(out + 1 + j, _unkey(kk) - lse, mask=j < n)
        tl.store(out + 1 + W + j, ids.to(tl.float32), mask=j < n)
        tl.store(out + 1 + 2 * W, tl.where(held_back | (n > nvalid), 0.0, 1.0))


def logprob_rows(x: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, n: torch.Tensor,
                 block: int = 0) -> torch.Tensor:
    """float32 [len(rows), 2 * LP_MAX + 2]: per row of ``rows`` (int64 ids into ``x``), the log-prob
    of ``tokens[row]``, the top ``n[i]`` log-probs (``n`` aligned with ``rows``) and their ids (as floats: exact
    below 2^24), and
    1.0 where those are exact (else the caller computes that row's top by torch). A view of a reused
    buffer: read it before the next call."""
    block = block or BLOCK
    nrows, vocab = rows.numel(), x.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    segs = triton.cdiv(vocab, block)
    sc = _scratch("logprob", x.device, nrows, triton.next_power_of_2(segs), LP_KS, 2 * LP_MAX + 2, torch.float32)
    if nrows:
        _logprob_kernel[(segs, nrows)](x, x.stride(0), rows, tokens, n, sc.out, sc.parts, sc.taus, sc.cand, sc.count,
                                       vocab, BLOCK=block, KS=LP_KS, NS=sc.ns, W=LP_MAX, num_warps=WARPS)
    return sc.out[:nrows]
