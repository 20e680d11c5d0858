"""Triton kernels: store new K/V into the paged pool, and attention that reads K/V in place.

The pool is seen per layer as ``cache[block, plane, group, head-in-group, slot, dim]``
(any strides; one group when head groups are not cut), so the same kernels serve every
pool layout of ``pushkv.kv.layout`` with no copy of past KV.

Attention is one kernel for prefill and decode. A program takes one *tile* (up to
``BLOCK_Q`` consecutive query tokens of one sequence) and one KV head, and puts the
``BLOCK_Q x G`` query rows of that head's G query heads in one matrix, so GQA reads each
K/V tile once for all its query heads. Keys are walked ``BLOCK_N`` at a time through the
block table with an online softmax (FlashAttention-2 style). Decode tiles (one token)
can split the key range over ``num_splits`` programs (flash-decoding), whose partial
results a second kernel merges: at small batch that is what keeps every SM reading. With
``FUSED_MERGE`` the split programs count themselves in on a counter instead, and the last
of a tile's to finish merges, one launch less; the same arithmetic, the same bits. With
``PREFETCH_KV`` a decode program asks L2 for its first key tile before it waits for the kernel before it.
"""
from __future__ import annotations

import torch

from pushkv.extras import missing

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:  # a CUDA torch build without Triton
    raise missing("triton", "pushkv's CUDA kernels") from e

from pushkv.model.kernels import chain, prefetch
from pushkv.model.kernels.chain import wait_prior
from pushkv.model.kernels.paged import decode_scratch
from pushkv.model.kernels.prefetch import l2_lines

LOG2E = 1.4426950408889634
# Prefill: tiles with the most keys start first, and key tiles wholly before a tile's queries are walked
# without a mask (experiments/moe_prefill_probe.py turns each off to measure what it gives)
HEAVY_FIRST = True
FREE_LOOP = True
# Decode: the last split program of a tile merges the partials, no second launch. Off: on an H200 it took
# Qwen3-30B-A3B's chained batch-1 step from 2.90 to 2.98 ms (the same logits): one program merging a tile's 8
# heads after the others have finished costs more than the merge launch's 32 programs, whose launch chaining
# already hides (experiments/moe_decode_probe.py, variant ``fused_merge``; docs/results/2026-12-04-decode-launches)
FUSED_MERGE = False
# Decode: each program asks L2 for its first key tile's K and V lines before it waits for the kernel before it
# (the q/k norm, RoPE and store), so its first loads after the wait find them there (kernels/prefetch.py); the
# same bits. On: on an H200 Qwen3-30B-A3B's decode step went 2.910 -> 2.853 ms at batch 1 (-2.0 %) and 8.072 ->
# 8.058 at 8 (experiments/moe_decode_probe.py, variant ``ahead_kv`` against ``no_kv``; the float32 tokens of
# Qwen3-MoE and Mixtral equal transformers' with it, docs/results/2026-12-05-moe-ahead)
PREFETCH_KV = True


@triton.jit
def _store_kv_kernel(K, V, cache, slots, stride_kt, stride_kh, stride_vt, stride_vh,
                     s_blk, s_plane, s_grp, s_head, s_slot, HG, U,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, PLANES: tl.constexpr = 2):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        blk = slot // U
        s = slot % U
        off = blk * s_blk + (h // HG) * s_grp + (h % HG) * s_head + s * s_slot + d
        k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=dm)
        tl.store(cache + off, k, mask=dm)
        if PLANES == 2:
            v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=dm)
            tl.store(cache + s_plane + off, v, mask=dm)


def store_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, kv_heads, D] into cache at flat slots (block * U + slot; < 0: skip)."""
    blk, plane, grp, head, slot, hg, u = _cache_strides(cache)
    T, H, D = k.shape
    if T == 0:
        return
    _store_kv_kernel[(T, H)](k, v, cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                             blk, plane, grp, head, slot, hg, u,
                             D=D, BLOCK_D=triton.next_power_of_2(D), num_warps=1)


def store_latent(cache: torch.Tensor, lat: torch.Tensor, slots: torch.Tensor) -> None:
    """MLA's latent rows lat [T, D] into its one plane, cache [blocks, 1, 1, U, D], at flat slots (< 0: skip)."""
    blk, plane, grp, head, slot, hg, u = _cache_strides(cache)
    T, D = lat.shape
    if T == 0:
        return
    _store_kv_kernel[(T, 1)](lat, lat, cache, slots, lat.stride(0), 0, lat.stride(0), 0,
                             blk, plane, grp, head, slot, hg, u,
                             D=D, BLOCK_D=triton.next_power_of_2(D), PLANES=1, num_warps=1)


def _cache_strides(cache: torch.Tensor):
    """(block, plane, group, head, slot strides, heads per group, slots per block)."""
    if cache.dim() == 5:  # [blocks, planes, heads, U, D]
        s = cache.stride()
        if s[4] != 1:
            raise ValueError("cache rows must be contiguous in head_dim")
        return s[0], s[1], 0, s[2], s[3], cache.shape[2], cache.shape[3]
    if cache.dim() == 6:  # [blocks, planes, groups, group heads, U, D]
        s = cache.stride()
        if s[5] != 1:
            raise ValueError("cache rows must be contiguous in head_dim")
        return s[0], s[1], s[2], s[3], s[4], cache.shape[3], cache.shape[4]
    raise ValueError(f"cache view must be 5-d or 6-d, got {tuple(cache.shape)}")


@triton.jit
def _rows(ptrs, kv_ok, dm, MASKED: tl.constexpr, WHOLE_D: tl.constexpr):
    """A tile of keys' (or values') rows: masked past the keys and the head dimension, or only where needed."""
    if MASKED:
        return tl.load(ptrs, mask=kv_ok[:, None] & dm[None, :], other=0.0)
    elif WHOLE_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=dm[None, :], other=0.0)


@triton.jit
def _key_tile(q, cache, bt, start, hi, qpos, head_off, d, dm, m_i, l_i, acc, s_blk, s_plane, s_slot, U,
              sm_scale_log2, window, PREC: tl.constexpr, WHOLE_D: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr):
    """BLOCK_N keys from ``start`` into a tile's online softmax (m_i, l_i, acc). MASKED: the keys from ``hi`` on
    and past each row's causal (and window) bound are masked; else every key is seen by every row, no mask
    (nor on the head dimension where it is whole)."""
    kpos = start + tl.arange(0, BLOCK_N)
    kv_ok = kpos < hi
    if MASKED:
        blk = tl.load(bt + kpos // U, mask=kv_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt + kpos // U).to(tl.int64)
    off = head_off + blk * s_blk + (kpos % U) * s_slot
    k = _rows(cache + off[:, None] + d[None, :], kv_ok, dm, MASKED, WHOLE_D)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale_log2
    if MASKED:
        ok = kv_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        if window > 0:
            ok = ok & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _rows(cache + s_plane + off[:, None] + d[None, :], kv_ok, dm, MASKED, WHOLE_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _tile_keys(tile_seq, tile_q0, seq_lens, q_lens, q_starts, window, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
               NUM_SPLITS: tl.constexpr, HEAVY_FIRST: tl.constexpr):
    """This program's tile from the step's tables: (its tile, its sequence, first query, the sequence's keys, its
    queries, their first row, the keys [lo, hi) this program walks, the splits that have keys)."""
    tile = tl.program_id(0)
    if HEAVY_FIRST:  # a sequence's later tiles see more keys: started first, none is left running alone at the end
        tile = tl.num_programs(0) - 1 - tile
    split = tl.program_id(2)
    seq = tl.load(tile_seq + tile)
    q0 = tl.load(tile_q0 + tile)
    ctx = tl.load(seq_lens + seq)
    qlen = tl.load(q_lens + seq)
    qrow0 = tl.load(q_starts + seq)
    last = tl.minimum(q0 + BLOCK_Q, qlen)
    hi = ctx - qlen + last  # keys [lo, hi) can matter to this tile
    lo = 0
    if window > 0:
        lo = tl.maximum(ctx - qlen + q0 - window + 1, 0)
    used = 1
    if NUM_SPLITS > 1:
        n_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
        per_tiles = tl.cdiv(n_tiles, NUM_SPLITS)
        per = per_tiles * BLOCK_N
        used = tl.cdiv(n_tiles, tl.maximum(per_tiles, 1))  # splits with keys: the others' partials are empty
        lo = lo + split * per
        hi = tl.minimum(hi, lo + per)
    return tile, seq, q0, ctx, qlen, qrow0, lo, hi, used


@triton.jit
def _ask_key_tile(cache, bt, lo, hi, head_off, s_blk, s_plane, s_slot, U, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  LPR: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for the key and value rows (D elements, LPR lines of LINE) of keys [lo, min(hi, lo + BLOCK_N)) of
    the KV head at ``head_off``."""
    kpos = lo + tl.arange(0, BLOCK_N)
    live = kpos < hi
    blk = tl.load(bt + kpos // U, mask=live, other=0).to(tl.int64)
    off = head_off + blk * s_blk + (kpos % U) * s_slot
    lines = tl.arange(0, LPR) * LINE
    ok = live[:, None] & (lines[None, :] < D)
    l2_lines(cache + off[:, None] + lines[None, :], ok)
    l2_lines(cache + s_plane + off[:, None] + lines[None, :], ok)


@triton.jit
def _attn_kernel(Q, O, cache, block_table, seq_lens, q_starts, q_lens, tile_seq, tile_q0,
                 Part, PartML, Counter,
                 stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                 s_blk, s_plane, s_grp, s_head, s_slot, HG, U,
                 total_rows, num_q_heads, sm_scale_log2, window,
                 PREC: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 HEAVY_FIRST: tl.constexpr, FREE_LOOP: tl.constexpr, FUSED_MERGE: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH_KV: tl.constexpr = False, LPR: tl.constexpr = 1,
                 LINE: tl.constexpr = 64, NEXT_EARLY: tl.constexpr = False):
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    head_off = (kvh // HG) * s_grp + (kvh % HG) * s_head
    if PREFETCH_KV:
        # the step's tables come from the host before the step (no kernel of it writes them), and a prefetch puts
        # no value in a register (L2 holds the one copy of each line, which the store kernel's writes update): so
        # the first key tile's lines are asked of L2 before the wait, while the kernel before this one runs
        tile, seq, q0, ctx, qlen, qrow0, lo, hi, used = _tile_keys(tile_seq, tile_q0, seq_lens, q_lens, q_starts,
                                                                   window, BLOCK_Q, BLOCK_N, NUM_SPLITS, HEAVY_FIRST)
        _ask_key_tile(cache, block_table + seq.to(tl.int64) * stride_bt, lo, hi, head_off, s_blk, s_plane, s_slot,
                      U, D, BLOCK_N, LPR, LINE)
        wait_prior(PDL, NEXT_EARLY)
    else:
        wait_prior(PDL, NEXT_EARLY)
        tile, seq, q0, ctx, qlen, qrow0, lo, hi, used = _tile_keys(tile_seq, tile_q0, seq_lens, q_lens, q_starts,
                                                                   window, BLOCK_Q, BLOCK_N, NUM_SPLITS, HEAVY_FIRST)

    r = tl.arange(0, BLOCK_M)
    tq = r // G
    g = r % G
    row_ok = (r < BLOCK_Q * G) & (q0 + tq < qlen)
    qpos = ctx - qlen + q0 + tq  # absolute position of each row's query
    head = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(Q + (qrow0 + q0 + tq)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & dm[None, :], other=0.0)

    bt = block_table + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys before the tile's first query are seen by every row of it: whole key tiles of them need no mask
    free_end = lo
    if FREE_LOOP and window == 0:
        free_end = lo + tl.maximum(tl.minimum(ctx - qlen + q0 + 1, hi) - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, free_end, BLOCK_N):
        m_i, l_i, acc = _key_tile(q, cache, bt, start, hi, qpos, head_off, d, dm, m_i, l_i, acc, s_blk, s_plane,
                                  s_slot, U, sm_scale_log2, window, PREC, BLOCK_D == D, BLOCK_N, False)
    for start in range(free_end, hi, BLOCK_N):
        m_i, l_i, acc = _key_tile(q, cache, bt, start, hi, qpos, head_off, d, dm, m_i, l_i, acc, s_blk, s_plane,
                                  s_slot, U, sm_scale_log2, window, PREC, BLOCK_D == D, BLOCK_N, True)

    rows = qrow0 + q0 + tq
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(O + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])
    else:
        # partials [splits, rows, heads, D] and (m, l) [splits, rows, heads, 2], fp32
        idx = (split * total_rows + rows) * num_q_heads + head
        tl.store(Part + idx[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & dm[None, :])
        tl.store(PartML + idx * 2, m_i, mask=row_ok)
        tl.store(PartML + idx * 2 + 1, l_i, mask=row_ok)
        if FUSED_MERGE:
            # every thread's stores issued before the one atomic (thread 0's, its result broadcast to all), whose
            # release publishes them and whose acquire, in the last program, makes the others' visible to it
            tl.debug_barrier()
            counter = Counter + tile * tl.num_programs(1) + kvh
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == NUM_SPLITS - 1:  # the tile's last split to finish
                # zero for the next launch (or graph replay): the kernel boundary orders it, no fence needed
                tl.atomic_xchg(counter, 0, sem="relaxed")
                # the splits past `used` hold no keys (m -1e30, l 0, acc 0): each would add an exact +0 to l and to
                # acc (never -0: both start at +0), so leaving them out keeps the merge kernel's bits
                out = _merge_splits(Part, PartML, rows * num_q_heads + head, total_rows * num_q_heads, row_ok, d, dm,
                                    used, D, BLOCK_M, BLOCK_D)
                tl.store(O + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                         out.to(O.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])


@triton.jit
def _merge_splits(Part, PartML, idx, split_stride, ok, d, dm, n, D: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Rows' partials of splits 0 .. n-1 merged, [ROWS, BLOCK_D] fp32: idx are the rows' indices at split 0
    (split s: + s * split_stride). Both merge paths call it, in the same order, so they give the same bits."""
    m = tl.full([ROWS], -1.0e30, tl.float32)
    for s in range(n):
        m = tl.maximum(m, tl.load(PartML + (idx + s * split_stride) * 2, mask=ok, other=-1.0e30))
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for s in range(n):
        i = idx + s * split_stride
        ms = tl.load(PartML + i * 2, mask=ok, other=-1.0e30)
        ls = tl.load(PartML + i * 2 + 1, mask=ok, other=0.0)
        w = tl.exp2(ms - m)
        l += ls * w
        acc += tl.load(Part + i[:, None] * D + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0) * w[:, None]
    return acc / tl.where(l > 0, l, 1.0)[:, None]


@triton.jit
def _merge_kernel(Part, PartML, O, q_starts, tile_seq, stride_ot, stride_oh, total_rows, num_q_heads,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr,
                  NEXT_EARLY: tl.constexpr = False):
    wait_prior(PDL, NEXT_EARLY)
    # one decode tile (its one query row) x one query head
    row = tl.load(q_starts + tl.load(tile_seq + tl.program_id(0)))
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    idx = row * num_q_heads + head + tl.zeros([1], tl.int32)
    out = _merge_splits(Part, PartML, idx, total_rows * num_q_heads, tl.full([1], 1, tl.int1), d, dm, NUM_SPLITS, D, 1,
                        BLOCK_D)
    tl.store(O + row * stride_ot + head * stride_oh + d[None, :], out.to(O.dtype.element_ty), mask=dm[None, :])


def attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
              q_starts: torch.Tensor, q_lens: torch.Tensor, tile_seq: torch.Tensor, tile_q0: torch.Tensor,
              block_q: int, num_splits: int = 1, window: int = 0, out: torch.Tensor | None = None,
              scratch: tuple[torch.Tensor, ...] | None = None,
              config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over each sequence's keys in the pool.

    Per sequence i: its queries are rows q_starts[i] .. + q_lens[i] of q, at positions
    seq_lens[i] - q_lens[i] ..; its keys (new ones already stored) sit at positions
    0 .. seq_lens[i] - 1 in blocks block_table[i]. Tiles (tile_seq, tile_q0) name the
    programs: block_q queries of one sequence each. Returns out [T, Hq, D].

    scratch (decode splits): ``paged.decode_scratch``'s (partials, (m, l), counters), counters zero (the
    kernel leaves them so); a (partials, (m, l)) pair merges in a second launch."""
    T, Hq, D = q.shape
    blk, plane, grp, head, slot, hg, u = _cache_strides(cache)
    kvh = hg * (cache.shape[2] if cache.dim() == 6 else 1)
    G = Hq // kvh
    if out is None:
        out = torch.empty_like(q)
    n_tiles = tile_seq.shape[0]
    if n_tiles == 0 or T == 0:
        return out
    block_m = max(16, triton.next_power_of_2(block_q * G))
    block_d = triton.next_power_of_2(D)
    block_n = 64 if block_q == 1 else (64 if D > 64 else 128)
    fused = False
    if num_splits > 1:
        if block_q != 1:
            raise ValueError("split keys only for one-token (decode) tiles")
        if scratch is None:
            scratch = decode_scratch(num_splits, T, Hq, kvh, D, q.device)
        part, part_ml = scratch[0], scratch[1]
        fused = FUSED_MERGE and len(scratch) > 2
        counters = scratch[2] if fused else part_ml  # unused without the fused merge
        if fused and counters.numel() < n_tiles * kvh:
            raise ValueError(f"{counters.numel()} merge counters for {n_tiles} tiles x {kvh} kv heads")
    else:
        part = part_ml = counters = out  # unused
    warps = 4 if block_m <= 64 else 8
    stages = 3 if block_m >= 256 else 2  # 256 rows: 0.39 against 0.42 ms with 2 (a 4k prefill, 32 heads on 4)
    if q.dtype == torch.float32:
        block_n = 32
    if config is not None:  # (block_n, warps, stages), for tuning
        block_n, warps, stages = config
    ahead: dict = {}
    if PREFETCH_KV and block_q == 1 and prefetch.enabled(q):
        lpr, line = prefetch.row_lines(D, cache.element_size())
        ahead = {"PREFETCH_KV": True, "LPR": lpr, "LINE": line}
    _attn_kernel[(n_tiles, kvh, num_splits)](
        q, out, cache, block_table, seq_lens, q_starts, q_lens, tile_seq, tile_q0, part, part_ml, counters,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        blk, plane, grp, head, slot, hg, u,
        T, Hq, LOG2E / (D ** 0.5), window,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", G=G, D=D, BLOCK_D=block_d, BLOCK_Q=block_q,
        BLOCK_M=block_m, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, HEAVY_FIRST=HEAVY_FIRST, FREE_LOOP=FREE_LOOP, FUSED_MERGE=fused, num_warps=warps,
        num_stages=stages, **ahead, **chain.launch(q, "attn"))
    if num_splits > 1 and not fused:
        _merge_kernel[(n_tiles, Hq)](part, part_ml, out, q_starts, tile_seq, out.stride(0), out.stride(1), T, Hq,
                               D=D, BLOCK_D=block_d, NUM_SPLITS=num_splits, num_warps=1,
                               **chain.launch(q, "merge"))
    return out
