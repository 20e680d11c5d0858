"""The mixture-of-experts MLP on the GPU (Triton): tokens grouped by expert, one grouped GEMM
per projection. Equals ``pushkv.model.moe.moe_mlp`` (the torch reference). A decode step of up to
``DECODE_TOKENS`` tokens takes the three launches of ``triton_moe_decode`` instead (no grouping,
GEMVs, a token's slots summed in the down projection), unless it is handed ``Tiles`` (moe_bench
compares the two).

A step of a few dozen tokens routes each to a few experts: its bytes are the chosen experts'
weights, a few tens of microseconds on an H200, so what a layer costs beyond them is launches.
A layer is four or five, none waiting for the host (so the decode step's CUDA graph captures it):

- the router's logits (one matmul, in the model dtype as the reference rounds them);
- a decode step (up to ``FUSED_ROUTE_TOKENS`` tokens): ``_route_group_kernel``, one program:
  softmax (float32), top-k, renormalisation, then the grouping: each token-slot (token, k-th
  choice) placed in its expert's segment of the slot table, each segment padded to whole blocks of
  ``BM`` rows, and each block's expert named (-1 past the last); by one-hot counts and running sums
  over chunks of slots, no sort;
- a prefill: the same spread over the GPU (``route_group_wide``): ``_route_count_kernel`` routes a
  few tokens a program and adds each expert's count, ``_place_kernel`` takes each program's range
  of its experts' rows by one atomic an expert and places its slots there;
- ``_gate_up_kernel``: for each row block and column tile of the intermediate, gather the
  block's token rows, multiply by the expert's gate and up weights, and store
  ``silu(gate) * up`` in the block's rows (``ROW_ACT``);
- ``_down_kernel``: that product (whole row blocks, no gather) times the expert's down projection,
  scaled by the slot's routing weight, stored per slot;
- the sum of a token's k slots (in the model's next residual add, ``triton_fused.add_rms``, or
  torch; no atomics, so the sum is deterministic).

Only the experts that tokens chose are read, each once per row block. Tiles come from
:func:`tiles_for` (small row blocks for a few slots per expert, so that more programs share the
experts' bytes; experiments/moe_bench.py sweeps them at decode sizes, experiments/moe_prefill_probe.py
at prefill lengths).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from pushkv import envs
from pushkv.extras import missing
from pushkv.model.kernels.triton_moe_decode import DECODE_TOKENS, DecodeTiles, decode_tiles_for, moe_mlp_decode

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:  # a CUDA torch build without Triton
    raise missing("triton", "pushkv's CUDA kernels") from e

from pushkv.model.kernels import chain, prefetch
from pushkv.model.kernels.chain import wait_prior
from pushkv.model.kernels.prefetch import l2_rows, l2_share


@triton.jit
def _probs(Logits, t, T, E, stride_l, EP: tl.constexpr):
    """Tokens ``t``' (a vector) softmax over their E logits, float32 [len(t), EP] (0 past E), and the experts."""
    e = tl.arange(0, EP)
    x = tl.load(Logits + t[:, None].to(tl.int64) * stride_l + e[None, :],
                mask=(t[:, None] < T) & (e[None, :] < E), other=float("-inf")).to(tl.float32)
    x = tl.where(e[None, :] < E, x, float("-inf"))
    p = tl.exp(x - tl.max(x, 1)[:, None])
    return p / tl.sum(p, 1)[:, None], e


@triton.jit
def _take(left, e, EP: tl.constexpr):
    """The largest probability left (the lowest expert on a tie): (it, its expert, the rest)."""
    best = tl.max(left, 1)
    pick = tl.min(tl.where(left == best[:, None], e[None, :], EP), 1)
    return best, pick, tl.where(e[None, :] == pick[:, None], -1.0, left)


@triton.jit
def _chosen_total(p, e, K: tl.constexpr, RENORM: tl.constexpr, EP: tl.constexpr):
    """What each weight is divided by: the sum of the k chosen probabilities when renormalising, else 1."""
    total = tl.full((p.shape[0],), 1.0, tl.float32)
    if RENORM:
        left = p
        total = tl.zeros((p.shape[0],), tl.float32)
        for _ in tl.static_range(K):
            best, _pick, left = _take(left, e, EP)
            total += best
    return total


@triton.jit
def _route_tokens(Logits, Weights, Experts, t, T, E, stride_l, K: tl.constexpr, RENORM: tl.constexpr,
                  EP: tl.constexpr):
    """Tokens ``t`` (a vector): softmax, then k rounds of the largest probability (lowest expert on a
    tie), twice when renormalising (the first to sum the chosen ones); their weights and experts stored."""
    p, e = _probs(Logits, t, T, E, stride_l, EP)
    total = _chosen_total(p, e, K, RENORM, EP)
    left = p
    for j in tl.static_range(K):
        best, pick, left = _take(left, e, EP)
        tl.store(Weights + t * K + j, (best / total).to(Weights.dtype.element_ty), mask=t < T)
        tl.store(Experts + t * K + j, pick, mask=t < T)


@triton.jit
def _one_token_choice(Logits, j, E, K: tl.constexpr, RENORM: tl.constexpr, EP: tl.constexpr):
    """A one-token step's k-th choice ``j``, routed by the program itself from the token's E logits (a few
    hundred bytes): (expert, weight in float32), as ``_route_tokens`` chooses and weighs."""
    t = tl.arange(0, 1)
    p, e = _probs(Logits, t, 1, E, 0, EP)
    total = _chosen_total(p, e, K, RENORM, EP)
    left = p
    expert = tl.zeros((1,), tl.int32)
    weight = tl.zeros((1,), tl.float32)
    for jj in tl.static_range(K):
        best, pick, left = _take(left, e, EP)
        expert = tl.where(jj == j, pick, expert)
        weight = tl.where(jj == j, best / total, weight)
    return tl.sum(expert, 0), tl.sum(weight, 0)


@triton.jit
def _k_rounds(p, e, j, K: tl.constexpr, RENORM: tl.constexpr, EP: tl.constexpr):
    """Each row's k choices from its probabilities ``p`` [rows, EP] over experts ``e``, as ``_route_tokens`` chooses
    them: (experts [rows, KP], probabilities [rows, KP], what each weight is divided by [rows]); past K an expert id
    above every real one (so it ranks after them). Each round one reduction, not two: a probability (>= 0, so its
    bits order as it does) above the expert's place from the top, so the largest key is the largest probability and,
    on a tie, the lowest expert; a chosen expert's key goes to -1, below every other."""
    R: tl.constexpr = p.shape[0]
    KP: tl.constexpr = j.shape[0]
    picks = tl.full((R, KP), EP, tl.int32)
    bests = tl.zeros((R, KP), tl.float32)
    total = tl.zeros((R,), tl.float32)
    left = (p.to(tl.int32, bitcast=True).to(tl.int64) << 16) | (EP - 1 - e[None, :]).to(tl.int64)
    for jj in tl.static_range(K):
        key = tl.max(left, 1)
        pick = (EP - 1 - (key & 0xFFFF)).to(tl.int32)
        best = (key >> 16).to(tl.int32).to(tl.float32, bitcast=True)
        left = tl.where(e[None, :] == pick[:, None], -1, left)
        picks = tl.where(j[None, :] == jj, pick[:, None], picks)
        bests = tl.where(j[None, :] == jj, best[:, None], bests)
        total += best
    if not RENORM:
        total = tl.full((R,), 1.0, tl.float32)
    return picks, bests, total


# Counts that change with the batch are not specialised on (Triton compiles a variant per count that
# is 1 or a multiple of 16): one compile serves every decode batch.
@triton.jit(do_not_specialize=["T", "n_rows", "max_blocks"])
def _route_group_kernel(Logits, Weights, Experts, SlotIds, BlockExpert, T, E, stride_l, n_rows, max_blocks,
                        K: tl.constexpr, RENORM: tl.constexpr, BM: tl.constexpr, EP: tl.constexpr,
                        TT: tl.constexpr, SC: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr,
                        NEXT_EARLY: tl.constexpr = False):
    wait_prior(PDL, NEXT_EARLY)
    n = T * K
    e = tl.arange(0, EP)
    # 1. route, TT tokens at a time
    for t0 in range(0, T, TT):
        _route_tokens(Logits, Weights, Experts, t0 + tl.arange(0, TT), T, E, stride_l, K, RENORM, EP)
    # 2. padding everywhere in the slot table, before the slots land
    for r0 in range(0, n_rows, FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(SlotIds + r, tl.full((FILL,), 0, tl.int32) + n, mask=r < n_rows)
    tl.debug_barrier()  # the experts and the fill, stored above, are read below by other threads
    # 3. slots per expert, whole blocks each, their first rows
    counts = tl.zeros((EP,), tl.int32)
    for s0 in range(0, n, SC):
        s = s0 + tl.arange(0, SC)
        ex = tl.load(Experts + s, mask=s < n, other=EP)
        counts += tl.sum((ex[:, None] == e[None, :]).to(tl.int32), 0)
    blocks = (counts + BM - 1) // BM
    ends = tl.cumsum(blocks, 0)
    first_row = (ends - blocks) * BM
    # 4. each slot's row: its expert's first row + the slots of that expert before it
    seen = tl.zeros((EP,), tl.int32)
    for s0 in range(0, n, SC):
        s = s0 + tl.arange(0, SC)
        ex = tl.load(Experts + s, mask=s < n, other=EP)
        hot = (ex[:, None] == e[None, :]).to(tl.int32)
        before = tl.cumsum(hot, 0) - hot + seen[None, :]
        row = tl.sum(hot * (first_row[None, :] + before), 1)
        tl.store(SlotIds + row, s, mask=s < n)
        seen += tl.sum(hot, 0)
    # 5. each block's expert: how many experts' blocks end at or before it
    for b0 in range(0, max_blocks, SC):
        b = b0 + tl.arange(0, SC)
        owner = tl.sum((ends[None, :] <= b[:, None]).to(tl.int32), 1)
        tl.store(BlockExpert + b, tl.where(owner < E, owner, -1), mask=b < max_blocks)


@triton.jit
def _route_one_kernel(Logits, Weights, Experts, SlotIds, BlockExpert, E, n_rows, max_blocks,
                      K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr, BM: tl.constexpr, EP: tl.constexpr,
                      RP: tl.constexpr, BP: tl.constexpr, PDL: tl.constexpr, NEXT_EARLY: tl.constexpr = False):
    """``_route_group_kernel``'s tables for one token (a decode step of one sequence), in registers: the k rounds
    once (their sum is the renormalisation's, in the same order), one reduction a round (a packed key), each choice's
    block its rank among the choices (one slot an expert: the grouping sorts the experts), every other row padding.
    The same bits and tables."""
    wait_prior(PDL, NEXT_EARLY)
    p, e = _probs(Logits, tl.arange(0, 1), 1, E, 0, EP)
    j = tl.arange(0, KP)
    picks, bests, total = _k_rounds(p, e, j, K, RENORM, EP)
    picks = tl.reshape(picks, (KP,))
    bests = tl.reshape(bests, (KP,))
    real = j < K
    tl.store(Weights + j, (bests / total).to(Weights.dtype.element_ty), mask=real)
    tl.store(Experts + j, picks, mask=real)
    rank = tl.sum((picks[None, :] < picks[:, None]).to(tl.int32), 1)  # blocks go by expert id
    # padding everywhere first, then each choice into its block's first row (and its expert into the block)
    r = tl.arange(0, RP)
    tl.store(SlotIds + r, tl.full((RP,), K, tl.int32), mask=r < n_rows)
    b = tl.arange(0, BP)
    tl.store(BlockExpert + b, tl.full((BP,), -1, tl.int32), mask=b < max_blocks)
    tl.debug_barrier()  # the padding, stored by other threads, lands before the choices over it
    tl.store(SlotIds + rank * BM, j, mask=real)
    tl.store(BlockExpert + rank, picks, mask=real)


@triton.jit(do_not_specialize=["T", "n_rows", "max_blocks"])
def _route_few_kernel(Logits, Weights, Experts, SlotIds, BlockExpert, T, E, stride_l, n_rows, max_blocks,
                      K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr, BM: tl.constexpr, EP: tl.constexpr,
                      TP: tl.constexpr, RP: tl.constexpr, BP: tl.constexpr, PDL: tl.constexpr,
                      NEXT_EARLY: tl.constexpr = False):
    """``_route_group_kernel``'s tables for a few tokens (T <= TP, and at most BM: each expert they choose fills
    one block), in registers, as ``_route_one_kernel`` routes one: the k rounds once per token, one reduction a round;
    then each choice (slot ``t K + j``) goes to its expert's block, the rank of that expert among the distinct
    experts chosen, at the row of its rank among the earlier slots of the same expert. The same bits and tables."""
    wait_prior(PDL, NEXT_EARLY)
    t = tl.arange(0, TP)
    p, e = _probs(Logits, t, T, E, stride_l, EP)
    j = tl.arange(0, KP)
    picks, bests, total = _k_rounds(p, e, j, K, RENORM, EP)
    real = (t[:, None] < T) & (j[None, :] < K)
    slot = t[:, None] * K + j[None, :]
    tl.store(Weights + slot, (bests / total[:, None]).to(Weights.dtype.element_ty), mask=real)
    tl.store(Experts + slot, picks, mask=real)
    # the choices in slot order, flat: a choice past T or K picks EP, above every real expert, and ranks after them
    fp = tl.reshape(tl.where(real, picks, EP), (TP * KP,))
    fs = tl.reshape(slot, (TP * KP,))
    f = tl.arange(0, TP * KP)
    same = (fp[:, None] == fp[None, :]) & (fp[:, None] < EP)
    earlier = tl.sum((same & (f[None, :] < f[:, None])).to(tl.int32), 1)  # of the same expert, before it
    first = (earlier == 0) & (fp < EP)  # the first choice of its expert
    block = tl.sum(((fp[None, :] < fp[:, None]) & first[None, :]).to(tl.int32), 1)  # blocks go by expert id
    r = tl.arange(0, RP)
    tl.store(SlotIds + r, tl.full((RP,), 0, tl.int32) + T * K, mask=r < n_rows)
    b = tl.arange(0, BP)
    tl.store(BlockExpert + b, tl.full((BP,), -1, tl.int32), mask=b < max_blocks)
    tl.debug_barrier()  # the padding, stored by other threads, lands before the choices over it
    live = fp < EP
    tl.store(SlotIds + block * BM + earlier, fs, mask=live)
    tl.store(BlockExpert + block, fp, mask=live & first)


@triton.jit(do_not_specialize=["T", "n_rows"])
def _route_count_kernel(Logits, Weights, Experts, Counts, SlotIds, T, E, stride_l, n_rows,
                        K: tl.constexpr, RENORM: tl.constexpr, EP: tl.constexpr, TT: tl.constexpr,
                        SP: tl.constexpr, FILL: tl.constexpr):
    """A prefill's routing, TT tokens a program: their experts and weights, each expert's count of them
    added to ``Counts``, and a share of the slot table filled with padding (``T * K``)."""
    pid = tl.program_id(0)
    n = T * K
    _route_tokens(Logits, Weights, Experts, pid * TT + tl.arange(0, TT), T, E, stride_l, K, RENORM, EP)
    tl.debug_barrier()  # the experts stored above are read below by other threads
    e = tl.arange(0, EP)
    s = pid * TT * K + tl.arange(0, SP)
    ex = tl.load(Experts + s, mask=(s < n) & (s < (pid + 1) * TT * K), other=EP)
    tl.atomic_add(Counts + e, tl.sum((ex[:, None] == e[None, :]).to(tl.int32), 0), mask=e < E)
    for r0 in range(pid * FILL, n_rows, tl.num_programs(0) * FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(SlotIds + r, tl.full((FILL,), 0, tl.int32) + n, mask=r < n_rows)


@triton.jit(do_not_specialize=["n", "max_blocks"])
def _place_kernel(Experts, Counts, Cursor, SlotIds, BlockExpert, n, E, max_blocks,
                  BM: tl.constexpr, EP: tl.constexpr, SC: tl.constexpr):
    """A prefill's grouping, SC slots a program: each expert's first row from the counts (its run padded
    to whole blocks of BM), a range of its rows taken for this program's slots of it (one atomic per
    expert), the slots placed there; and a share of the blocks' experts (-1 past the last)."""
    pid = tl.program_id(0)
    e = tl.arange(0, EP)
    counts = tl.load(Counts + e, mask=e < E, other=0)
    blocks = (counts + BM - 1) // BM
    ends = tl.cumsum(blocks, 0)
    first_row = (ends - blocks) * BM
    s = pid * SC + tl.arange(0, SC)
    ex = tl.load(Experts + s, mask=s < n, other=EP)
    hot = (ex[:, None] == e[None, :]).to(tl.int32)
    base = tl.atomic_add(Cursor + e, tl.sum(hot, 0), mask=e < E)
    before = tl.cumsum(hot, 0) - hot
    row = tl.sum(hot * (first_row[None, :] + base[None, :] + before), 1)
    tl.store(SlotIds + row, s, mask=s < n)
    for b0 in range(pid * SC, max_blocks, tl.num_programs(0) * SC):
        b = b0 + tl.arange(0, SC)
        owner = tl.sum((ends[None, :] <= b[:, None]).to(tl.int32), 1)
        tl.store(BlockExpert + b, tl.where(owner < E, owner, -1), mask=b < max_blocks)


@triton.jit(do_not_specialize=["n_slots"])
def _gate_up_kernel(H, W, Act, SlotIds, BlockExpert, Logits, Weights, D, n_slots, d, inter, k_top, E,
                    stride_h, stride_we, stride_wn, stride_act, stride_de, down_elems,
                    PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    EVEN: tl.constexpr, ROW_ACT: tl.constexpr, PDL: tl.constexpr, SELF_ROUTE: tl.constexpr,
                    K: tl.constexpr, RENORM: tl.constexpr, EP: tl.constexpr,
                    PREFETCH: tl.constexpr = False, LINES: tl.constexpr = 1, LINE: tl.constexpr = 64,
                    OWN: tl.constexpr = False, LPR: tl.constexpr = 1, NEXT_EARLY: tl.constexpr = False,
                    Wd=None, TMA: tl.constexpr = False, COLS_FIRST: tl.constexpr = False):
    wait_prior(PDL, NEXT_EARLY)
    # the grid (row blocks, column tiles), or with COLS_FIRST (column tiles, row blocks): a block's tiles launched
    # one after another, its gathered token rows read from HBM once (GATE_UP_COLS_FIRST_SLOTS)
    pid_m = tl.program_id(1) if COLS_FIRST else tl.program_id(0)
    pid_n = tl.program_id(0) if COLS_FIRST else tl.program_id(1)
    n_tiles = tl.num_programs(0) if COLS_FIRST else tl.num_programs(1)
    rows = pid_m * BM + tl.arange(0, BM)
    if SELF_ROUTE:
        # a one-token step: row block j is the token's j-th choice, routed here from its logits, its first row
        # slot j; the column tile 0 programs write that to the tables the down kernel reads as the grouping's
        choice, wt = _one_token_choice(Logits, pid_m, E, K, RENORM, EP)
        e = choice.to(tl.int64)
        slots = tl.where(tl.arange(0, BM) == 0, pid_m, n_slots)
        if pid_n == 0:
            tl.store(SlotIds + rows, slots)
            tl.store(BlockExpert + pid_m, choice)
            tl.store(Weights + pid_m, wt.to(Weights.dtype.element_ty))
    else:
        e = tl.load(BlockExpert + pid_m).to(tl.int64)
        if e < 0:  # a block past the last expert's segment
            return
        slots = tl.load(SlotIds + rows)
    if OWN:  # its own gate and up rows, every line asked of L2 at once (PREFETCH_OWN_TOKENS)
        own = pid_n * BN + tl.arange(0, BN)
        l2_rows(W + e * stride_we, tl.where(own < inter, own, -1), stride_wn, d, LPR, LINE)
        l2_rows(W + e * stride_we, tl.where(own < inter, own + inter, -1), stride_wn, d, LPR, LINE)
    if PREFETCH:  # this program's share of its expert's down weights, into L2 for the down launch (kernels/prefetch.py)
        l2_share(D + e * stride_de, down_elems, pid_n, n_tiles, LINES, LINE)
    # with the prefetch, the gate/up weights (read once) are to leave L2 first, so the down weights stay. Triton 3.6
    # drops the hint from the pipelined cp.async loads this kernel's dots get on sm_90 (the down lines, asked for
    # evict-last, are kept before normal ones anyway); the ungrouped kernels' plain loads keep it
    evict: tl.constexpr = "evict_first" if PREFETCH else ""
    valid = slots < n_slots  # padding rows of the expert's last block carry n_slots
    # a padding row reads token 0's row (its product is never used), so no load needs a row mask
    tok = tl.where(valid, slots // k_top, 0).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    w_base = W + e * stride_we
    # TMA (TMA_SLOTS): the expert's gate rows and up rows as [BN, BK] boxes of the [E 2 i, d] view (EVEN only)
    gate_row = (e * (2 * inter)).to(tl.int32) + pid_n * BN
    for k0 in range(0, d, BK):
        k = k0 + kk
        if TMA:
            a = tl.load(H + tok[:, None] * stride_h + k[None, :])
            wg = tl.trans(Wd.load([gate_row, k0]))
            wu = tl.trans(Wd.load([gate_row + inter, k0]))
        elif EVEN:  # d a multiple of BK and inter of BN: no mask, so the loads vectorise
            a = tl.load(H + tok[:, None] * stride_h + k[None, :])
            wg = tl.load(w_base + cols[None, :] * stride_wn + k[:, None], eviction_policy=evict)
            wu = tl.load(w_base + (cols[None, :] + inter) * stride_wn + k[:, None], eviction_policy=evict)
        else:
            a = tl.load(H + tok[:, None] * stride_h + k[None, :], mask=k[None, :] < d, other=0.0)
            wmask = (cols[None, :] < inter) & (k[:, None] < d)
            wg = tl.load(w_base + cols[None, :] * stride_wn + k[:, None], mask=wmask, other=0.0,
                         eviction_policy=evict)
            wu = tl.load(w_base + (cols[None, :] + inter) * stride_wn + k[:, None], mask=wmask, other=0.0,
                         eviction_policy=evict)
        acc_g += tl.dot(a, wg, input_precision=PREC)
        acc_u += tl.dot(a, wu, input_precision=PREC)
    # the reference rounds each projection to the model dtype before SiLU and the product
    g = acc_g.to(Act.dtype.element_ty).to(tl.float32)
    u = acc_u.to(Act.dtype.element_ty).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(Act.dtype.element_ty).to(tl.float32) * u
    if ROW_ACT:  # the block's rows as they lie in the slot table, padding too: the down kernel reads them whole
        tl.store(Act + rows[:, None].to(tl.int64) * stride_act + cols[None, :], act.to(Act.dtype.element_ty),
                 mask=cols[None, :] < inter)
    else:
        tl.store(Act + slots[:, None].to(tl.int64) * stride_act + cols[None, :], act.to(Act.dtype.element_ty),
                 mask=valid[:, None] & (cols[None, :] < inter))


@triton.jit(do_not_specialize=["n_slots"])
def _down_kernel(Act, W, Weights, Out, SlotIds, BlockExpert, n_slots, d, inter,
                 stride_act, stride_we, stride_wn, stride_out,
                 PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 EVEN: tl.constexpr, ROW_ACT: tl.constexpr, PDL: tl.constexpr, OWN: tl.constexpr = False,
                 LPR: tl.constexpr = 1, LINE: tl.constexpr = 64, NEXT_EARLY: tl.constexpr = False,
                 COLS_FIRST: tl.constexpr = False, Ad=None, Wd=None, TMA: tl.constexpr = False):
    wait_prior(PDL, NEXT_EARLY)
    # the grid (row blocks, column tiles), or with COLS_FIRST (column tiles, row blocks): a block's tiles launched
    # one after another (DOWN_COLS_FIRST_SLOTS)
    pid_m = tl.program_id(1) if COLS_FIRST else tl.program_id(0)
    pid_n = tl.program_id(0) if COLS_FIRST else tl.program_id(1)
    e = tl.load(BlockExpert + pid_m).to(tl.int64)
    if e < 0:
        return
    if OWN:  # its own rows of the expert's down weights, every line asked of L2 at once (PREFETCH_OWN_TOKENS)
        own = pid_n * BN + tl.arange(0, BN)
        l2_rows(W + e * stride_we, tl.where(own < d, own, -1), stride_wn, inter, LPR, LINE)
    rows = pid_m * BM + tl.arange(0, BM)
    slots = tl.load(SlotIds + rows)
    valid = slots < n_slots
    s64 = slots.to(tl.int64)
    # the product's rows: the block's own (ROW_ACT), or its slots' (a padding row reads slot 0's)
    a_rows = rows.to(tl.int64) if ROW_ACT else tl.where(valid, s64, 0)
    cols = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    w_base = W + e * stride_we
    # TMA (TMA_SLOTS): the block's product rows as a [BM, BK] box, the expert's down rows as [BN, BK] boxes of the
    # [E d, i] view (EVEN and ROW_ACT only)
    down_row = (e * d).to(tl.int32) + pid_n * BN
    for k0 in range(0, inter, BK):
        k = k0 + kk
        if TMA:
            a = Ad.load([pid_m * BM, k0])
            w = tl.trans(Wd.load([down_row, k0]))
        elif EVEN:  # inter a multiple of BK and d of BN
            a = tl.load(Act + a_rows[:, None] * stride_act + k[None, :])
            w = tl.load(w_base + cols[None, :] * stride_wn + k[:, None])
        else:
            a = tl.load(Act + a_rows[:, None] * stride_act + k[None, :], mask=k[None, :] < inter, other=0.0)
            w = tl.load(w_base + cols[None, :] * stride_wn + k[:, None],
                        mask=(cols[None, :] < d) & (k[:, None] < inter), other=0.0)
        acc += tl.dot(a, w, input_precision=PREC)
    wt = tl.load(Weights + slots, mask=valid, other=0.0).to(tl.float32)
    y = acc.to(Out.dtype.element_ty).to(tl.float32) * wt[:, None]
    tl.store(Out + s64[:, None] * stride_out + cols[None, :], y.to(Out.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < d))


@triton.jit(do_not_specialize=["n_slots"])
def _gate_up_rows_kernel(H, W, Act, SlotIds, BlockExpert, n_slots, d, inter, k_top, stride_h, stride_we, stride_wn,
                         stride_act, BM: tl.constexpr, KP: tl.constexpr, R: tl.constexpr, ONE: tl.constexpr,
                         PDL: tl.constexpr, NEXT_EARLY: tl.constexpr = False):
    """A few tokens' ``silu(gate) * up`` as whole-row GEMVs: program (j, c) reads gate rows c R .. c R + R - 1 of row
    block j's expert and the same up rows, each a run of d contiguous weights, once, and for each slot of the block
    (its slots first, padding after) writes that row of the product (``ROW_ACT``'s place, where the down kernels
    read it). ``ONE``, a one-token step: one slot a block, at its first row, straight-line (no slot table read);
    else a loop over the block's live slots (an unrolled loop over as many masked slots as the step has tokens was
    3.7 % slower at two tokens and 38 % at four on an H100:
    docs/results/2026-12-06-moe-gemv-h100)."""
    wait_prior(PDL, NEXT_EARLY)
    j = tl.program_id(0)
    e = tl.load(BlockExpert + j).to(tl.int64)
    if e >= 0:  # (blocks past the last expert's hold none)
        rows = tl.program_id(1) * R + tl.arange(0, R)
        kk = tl.arange(0, KP)
        m = (rows[:, None] < inter) & (kk[None, :] < d)
        base = W + e * stride_we
        wg = tl.load(base + rows[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(base + (rows[:, None] + inter).to(tl.int64) * stride_wn + kk[None, :], mask=m,
                     other=0.0).to(tl.float32)
        if ONE:
            _gate_up_row(H, Act, wg, wu, 0, j * BM, rows, kk, d, inter, stride_h, stride_act)
        else:
            slots = tl.load(SlotIds + j * BM + tl.arange(0, BM))
            for i in range(tl.sum((slots < n_slots).to(tl.int32), 0)):  # (a block's slots first, padding after)
                _gate_up_row(H, Act, wg, wu, _nth(slots, i, BM) // k_top, j * BM + i, rows, kk, d, inter, stride_h,
                             stride_act)


@triton.jit
def _gate_up_row(H, Act, wg, wu, tok, a_row, rows, kk, d, inter, stride_h, stride_act):
    """One slot's ``silu(gate) * up`` by a program's gate rows ``wg`` and up rows ``wu`` (float32): token ``tok``'s
    hidden state against them, stored at product row ``a_row``."""
    x = tl.load(H + tok * stride_h + kk, mask=kk < d, other=0.0).to(tl.float32)
    # each projection a float32 sum over the whole row, rounded to the model dtype, as the grouped kernel's
    g = tl.sum(wg * x[None, :], 1).to(Act.dtype.element_ty).to(tl.float32)
    u = tl.sum(wu * x[None, :], 1).to(Act.dtype.element_ty).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(Act.dtype.element_ty).to(tl.float32) * u
    tl.store(Act + tl.cast(a_row, tl.int64) * stride_act + rows, act.to(Act.dtype.element_ty), mask=rows < inter)


@triton.jit
def _nth(slots, i, BM: tl.constexpr):
    """Row ``i`` of a block's slot ids (a scalar out of the block's vector)."""
    return tl.sum(tl.where(tl.arange(0, BM) == i, slots, 0), 0)


@triton.jit(do_not_specialize=["n_slots"])
def _down_gemv_kernel(Act, W, Weights, Out, SlotIds, BlockExpert, n_slots, d, stride_act, stride_we, stride_wn,
                      stride_out, K: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      ROW_ACT: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr = True, ONE: tl.constexpr = False,
                      NEXT_EARLY: tl.constexpr = False):
    """``_down_kernel``'s products as GEMVs, a row block's BN output columns a program (each a whole row of K weights,
    read once for every slot of the block), for a step of a few tokens. ``EARLY`` (``DOWN_GEMV_TOKENS``): the
    grouping's tables come from the routing launch, which finished before gate/up began, so this kernel may read them,
    and its expert's weights, before it waits for gate/up's products: chained, the weights stream in while gate/up
    runs; the block's slots in a loop. Else (``DOWN_ROWS_ONE_TOKEN``, ``ROWS_TOKENS``) it reads nothing before it
    waits: ``ONE``, a one-token step, a block's one slot at its first row, straight-line; else a loop over the
    block's live slots, as ``_gate_up_rows_kernel``."""
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    kk = tl.arange(0, KP)
    wmask = (cols[:, None] < d) & (kk[None, :] < K)
    if EARLY:
        e = tl.load(BlockExpert + pid_m).to(tl.int64)
        slots = tl.load(SlotIds + pid_m * BM + tl.arange(0, BM))
        w = tl.load(W + tl.maximum(e, 0) * stride_we + cols[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=wmask & (e >= 0), other=0.0)
        wait_prior(PDL, NEXT_EARLY)
        if e >= 0:
            # a block's slots come first, its padding (n_slots) after
            for r in range(tl.sum((slots < n_slots).to(tl.int32), 0)):
                slot = _nth(slots, r, BM).to(tl.int64)
                _down_row(Act, Weights, Out, w, slot, (pid_m * BM + r).to(tl.int64) if ROW_ACT else slot, cols, kk,
                          d, K, stride_act, stride_out, True)
    else:
        wait_prior(PDL, NEXT_EARLY)
        e = tl.load(BlockExpert + pid_m).to(tl.int64)
        if ONE:
            first = tl.load(SlotIds + pid_m * BM)
            if (e >= 0) & (first < n_slots):
                w = tl.load(W + e * stride_we + cols[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=wmask,
                            other=0.0)
                # (ROW_ACT: gate_up_rows writes a block's slots' products at its rows; its one slot, known live)
                _down_row(Act, Weights, Out, w, first.to(tl.int64), (pid_m * BM).to(tl.int64), cols, kk, d, K,
                          stride_act, stride_out, True)
        elif e >= 0:
            slots = tl.load(SlotIds + pid_m * BM + tl.arange(0, BM))
            w = tl.load(W + e * stride_we + cols[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=wmask,
                        other=0.0)
            for r in range(tl.sum((slots < n_slots).to(tl.int32), 0)):
                _down_row(Act, Weights, Out, w, _nth(slots, r, BM).to(tl.int64), (pid_m * BM + r).to(tl.int64), cols,
                          kk, d, K, stride_act, stride_out, True)


@triton.jit
def _down_row(Act, Weights, Out, w, slot, a_row, cols, kk, d, K: tl.constexpr, stride_act, stride_out, live):
    """One slot's down projection by a program's rows ``w``: its product row ``a_row`` against them, rounded as
    ``_down_kernel`` rounds (the projection, then its product with the slot's weight), stored at its slot's columns
    (``live``: a slot, not padding)."""
    a = tl.load(Act + a_row * stride_act + kk, mask=(kk < K) & live, other=0.0).to(tl.float32)
    y = tl.sum(w.to(tl.float32) * a[None, :], 1)
    wt = tl.load(Weights + slot, mask=live, other=0.0).to(tl.float32)
    y = y.to(Out.dtype.element_ty).to(tl.float32) * wt
    tl.store(Out + slot * stride_out + cols, y.to(Out.dtype.element_ty), mask=(cols < d) & live)


def group_slots(experts: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] -> (slot ids [B * bm], block expert [B]): the token-slots (``t * k + j``)
    sorted by expert, each expert's run padded to whole blocks of ``bm`` rows (padding rows hold
    ``T * k``), and each block's expert (-1 past the last). ``B`` is ``block_bound``, so nothing
    here waits for the device. In torch: what ``_route_group_kernel`` computes, the tests' reference."""
    flat = experts.flatten()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.long))  # bincount syncs
    blocks = (counts + bm - 1) // bm
    ends = torch.cumsum(blocks, 0)
    starts = (ends - blocks) * bm  # each expert's first row
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    first_of = torch.cumsum(counts, 0) - counts
    pos = starts[by_expert] + torch.arange(n, device=flat.device) - first_of[by_expert]
    max_blocks = block_bound(n, num_experts, bm)
    slot_ids = torch.full((max_blocks * bm,), n, dtype=torch.int32, device=flat.device)
    slot_ids[pos] = order.to(torch.int32)
    block_expert = torch.searchsorted(ends, torch.arange(max_blocks, device=flat.device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return slot_ids, block_expert


def block_bound(n_slots: int, num_experts: int, bm: int) -> int:
    """Row blocks enough for any routing of n_slots: each expert used pads at most one block, and
    at most min(E, n_slots) experts are used (a decode step of one token: 9 blocks, not 129)."""
    return (n_slots + bm - 1) // bm + min(num_experts, n_slots)


# The product of gate/up kept in the slot table's row order (the down kernel's loads are then whole
# blocks, no gather), and loads without masks where the shapes are whole tiles: experiments/moe_prefill_probe.py
# turns each off to measure what it gives
ROW_ACT = True
EVEN_LOADS = True

# A one-token step (a decode step of one sequence) routed by the gate/up kernel itself, each
# program its own choice from the token's logits, so no routing launch runs between the router and the
# experts: a row block a choice (one token's k experts are distinct, so the grouping too gives each its own
# block), and the gate/up kernel writes the tables the down kernel reads. Off: on an H200 it took Qwen3-30B-A3B's
# chained batch-1 step from 2.88 to 2.87 ms (200 replays; the same logits), as each program's routing lengthens
# gate/up by about what the launch cost (experiments/moe_decode_probe.py, variant ``self_route``;
# docs/results/2026-12-04-decode-launches)
SELF_ROUTE_ONE_TOKEN = False

# The down projections of steps of up to this many tokens as GEMVs that load their experts' weights before they
# wait for gate/up (``_down_gemv_kernel``; the routing that names the experts finished before gate/up began),
# DOWN_GEMV_COLUMNS output columns a program, where an expert's intermediate size is at most TILE_DEPTH (its whole
# row in one program's registers). A graph bucket bound; 0: off. On an H200 they took Qwen3-30B-A3B's chained
# batch-1 step from 2.90 to 2.98 ms at 8 and 16 columns (3.11 at 4): the early weight loads slow gate/up, which
# already draws most of the bandwidth, by about what they save (experiments/moe_decode_probe.py, variants
# ``down_gemv_*``; docs/results/2026-12-04-decode-launches)
DOWN_GEMV_TOKENS = 0
DOWN_GEMV_COLUMNS = 8
TILE_DEPTH = 4096

# Steps of up to this many tokens (at most a row block's BM, so an expert has one row block and one set of
# programs asking for it) have the gate/up programs ask L2 for their experts' down weights, which the down launch
# reads next (kernels/prefetch.py), evict-last. 0: off, until
# experiments/moe_decode_probe.py (variant ``prefetch_down``) has timed it on a GPU
PREFETCH_DOWN_TOKENS = 0

# Steps of up to this many tokens have each grouped gate/up and down program ask L2 for its own weight rows, all
# at once, before its pipelined loads: at one token 96 gate/up programs on 132 SMs draw about 70 % of the HBM
# rate, a few stages of loads in flight a program, and asking for the whole tile up front puts every request
# before the HBM at the start (kernels/prefetch.py). The same bits. 0: off, until experiments/moe_decode_probe.py
# (variants ``own*``) has timed it on a GPU
PREFETCH_OWN_TOKENS = 0

# A one-token step's MoE MLP in one persistent launch (``triton_moe_token``: every program routes the token, then
# gate/up, a grid barrier, down), where it has the router's logits. Off: on an H100 it took Qwen3-30B-A3B's batch-1
# step from 3.38 to 3.66 ms, as its GEMV tiles keep fewer bytes in flight than the grouped kernels' pipelined dots
# (experiments/moe_decode_probe.py, variant ``persistent``; docs/results/2026-12-05-layer-floor)
PERSISTENT_ONE_TOKEN = False

# A one-token step's gate/up (``ROWS_ONE_TOKEN``) and down (``DOWN_ROWS_ONE_TOKEN``) products as whole-row GEMVs
# (``_gate_up_rows_kernel``; ``_down_gemv_kernel`` reading nothing before its wait), a few whole rows a program, where
# the grouped kernels read tiles of a few hundred bytes of each of many rows. Alone on an H100, gate/up over 8 of
# 128 experts read 2.79 TB/s that way against the grouped kernel's 2.38 (18.0 against 21.2 us a layer;
# experiments/expert_stream_probe.py), and Qwen3-30B-A3B's batch-1 step went 3.22 -> 3.02 ms (1.59x -> 1.49x its
# bytes bound; experiments/moe_decode_probe.py, variant ``grouped``; docs/results/2026-12-06-moe-rows-h100). Down at
# one row a program (1.5 KB) was twice as slow as the grouped kernel; at 4 as fast or a little faster. They sum in
# another order than the grouped kernels (rounding, not bits). The switches serve steps of up to ``ROWS_TOKENS``
# tokens (below); longer steps keep the grouped kernels
ROWS_ONE_TOKEN = True
DOWN_ROWS_ONE_TOKEN = True
ROWS, ROWS_WARPS = 1, 2  # gate/up: rows (of each of gate and up) a program, warps
DOWN_ROWS, DOWN_ROWS_WARPS = 4, 4  # down: rows a program, warps
# steps of up to this many tokens take them (a graph bucket bound): each program reads its rows once for every slot
# of its block (a loop over its live slots). On an H100 a two-token step went 5.02 -> 4.92 ms (1.57x -> 1.54x its
# bound; variant ``rows_few_1``: docs/results/2026-12-06-moe-rows-h100; 4.99 -> 4.90 again in
# docs/results/2026-12-06-moe-gemv-h100); at four tokens rows and tiles were as fast
ROWS_TOKENS = 2

# A one-token step's routing and grouping in registers (``_route_one_kernel``: the k rounds once, one reduction a
# round, each choice's block its rank), not through the general kernel's fill, counts and scans. The same tables and
# bits. On an H100 it took Qwen3-30B-A3B's batch-1 step from 3.300 to 3.233 ms and from 3.29 to 3.22 (-2.0 / -2.1 %,
# 1.59x its bytes bound): the routing adds 2.25 us a layer to the chain against 3.49 (experiments/moe_decode_probe.py,
# variant ``route_general``; docs/results/2026-12-06-route-one)
ROUTE_ONE_TOKEN = True
# Steps of 2 up to this many tokens (a graph bucket bound, and at most the decode tiles' row block) route the same
# way in one program (``_route_few_kernel``), on ROUTE_FEW_WARPS[0] warps up to 4 tokens and [1] above. The same
# tables and bits. At two tokens the general kernel added 7.3 us a layer to an H100's chain. On an H100,
# Qwen3-30B-A3B's step (experiments/moe_decode_probe.py, variants ``route_few_N[_W]``;
# docs/results/2026-12-06-moe-gemv-h100): batch 2 4.77 -> 4.53 ms (1.50x -> 1.42x its bytes bound), batch 4 7.17
# -> 6.98, batch 8 10.72 -> 10.48 on 4 warps (11.10 on one)
ROUTE_FEW_TOKENS = 8
ROUTE_FEW_WARPS = (1, 4)

# Steps of up to this many tokens route and group in the one-program kernel (a decode step: one
# launch where torch takes ~15); longer ones in torch, whose launches are spread over the whole GPU
# (a graph bucket bound, so a step routes alike replayed or eager)
FUSED_ROUTE_TOKENS = 128


# A grouped down launch of at least this many slots takes its column tiles as the grid's first axis (``COLS_FIRST``):
# a row block's tiles run one after another, so its product rows are read from HBM once and from L2 by the rest,
# where with the row blocks first every column tile's pass reads all of them again (a 4k prefill's product is 50 MB
# a layer at Qwen3-30B-A3B's shape, read by 8 tiles of 256 columns: 400 MB beside the experts' 403 MB). The same
# tiles and bits, only their order. An H100's down projection took 16.3 ms of a 4k prefill against an H200's 12.6
# (docs/results/2026-12-06-one-copy-h100). On an H100 the down stage at 4k went 0.380 -> 0.257 ms a layer and the
# whole prefill, A/B in one process, 75.6 -> 72.3 ms at 4k, 26.0 -> 24.8 at 1k, 450 -> 443 at 16k, the same bits;
# from 4,096 slots (512 tokens) on, as fast as from 1, so decode steps of fewer than 512 sequences (every decode graph
# at the default --max-num-seqs) launch as before (docs/results/2026-12-06-down-cols-first-h100)
DOWN_COLS_FIRST_SLOTS = 4096

# Launches of at least this many slots load their experts' weights (and the down launch its product rows) through
# Hopper's tensor memory accelerator: a host-made descriptor a weight stack, each tile one bulk copy into shared
# memory in place of a program's address arithmetic and cp.async loads; the gathered token rows of gate/up stay
# pointer loads (Hopper's TMA has no row gather). Whole tiles only (EVEN_LOADS), the same sums in the same order (the
# same logits). Whole qwen3-30b-a3b prefills on an H100, A/B in one process (experiments/prefill_ab.py): 8k tokens
# 167.6 -> 165.3 ms (-1.4 %), 16k 447.6 -> 442.9 (-1.1 %); 4k within its noise (-0.2 to -0.4 %), and 1k 13 % slower
# (25.1 -> 28.3 ms, at its own tiles; not profiled), so from 65,536 slots (8k tokens) on
# (docs/results/2026-12-07-moe-prefill-tma-h100)
TMA_SLOTS = 65536

# The prefill's gate/up launch with its column tiles first, as DOWN_COLS_FIRST_SLOTS's down: a row block's tiles side
# by side, so its gathered token rows are read from HBM once where the prompt's hidden rows outgrow L2 (64 MB at 16k
# tokens of hidden 2048). The same bits. On an H100 (experiments/prefill_ab.py): 16k tokens 447.0 -> 442.4 ms (-1.0 %,
# with TMA_SLOTS on; -1.1 % without), 8k the same (+0.1 %), 4k 1.8 % slower (where the rows fit L2; not profiled), so
# from 131,072 slots (16k tokens) on (docs/results/2026-12-07-moe-prefill-tma-h100)
GATE_UP_COLS_FIRST_SLOTS = 131072


def _tma_ok(depth: int, *ts: torch.Tensor) -> bool:
    """Tensors a descriptor may cover in boxes ``depth`` deep: on a GPU of compute capability 9 or more (or the CPU,
    under Triton's interpreter), rows contiguous, base and row stride 16-byte aligned, a box's row at most 128 bytes
    (one swizzle span: 2-byte types at the prefill's depth 64)."""
    return all(t.stride(-1) == 1 and depth * t.element_size() <= 128 and t.data_ptr() % 16 == 0
               and t.stride(-2) * t.element_size() % 16 == 0
               and (t.device.type == "cpu" or torch.cuda.get_device_capability(t.device)[0] >= 9) for t in ts)


def _box(t: torch.Tensor, rows: int, cols: int):
    """A descriptor of t as a 2-D [all but the last dim, last dim] view, in boxes of [rows, cols]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = t.view(-1, t.shape[-1])
    return TensorDescriptor(flat, shape=list(flat.shape), strides=list(flat.stride()), block_shape=[rows, cols])


class Tiles(NamedTuple):
    """A launch's tile: rows per expert block; gate/up columns; down columns; depth; warps; stages; and
    the down kernel's own depth, warps and stages where they differ (0: the same as gate/up's)."""

    bm: int
    bn_up: int
    bn_down: int
    bk: int
    warps: int = 4
    stages: int = 3
    bk_down: int = 0
    down_warps: int = 0
    down_stages: int = 0


# a one-token step's tiles where they are not those of the steps up to 8 tokens (None: the same); the decode probe
# sets it to time a card's own sweep against them (experiments/moe_decode_probe.py --sweep-tokens 1 --then-time)
ONE_TOKEN_TILES: Optional[Tiles] = None


def tiles_for(tokens: int) -> Union[Tiles, DecodeTiles]:
    """A decode step's tiles up to ``DECODE_TOKENS``: the grouped kernels' (measured on an H200), or
    with ``PUSHKV_MOE_DECODE=ungrouped`` ``DecodeTiles`` (the three-launch GEMV kernels: on an H200 equal
    at one token and 1.5x slower at eight, docs/results/2026-12-02-moe-kernel); then small row blocks for
    a few slots per expert (less padding), larger rows for a prefill's many slots. Chosen by tokens at
    bounds that are decode graph buckets (pushkv/model/batched.py), so a step sums in the same order
    replayed or eager."""
    if tokens <= DECODE_TOKENS and envs.PUSHKV_MOE_DECODE == "ungrouped":
        return decode_tiles_for(tokens)
    # decode steps: the best of experiments/moe_decode_probe.py's sweep (--sweep-tokens 1,2,8,16,64, each kernel
    # alone over the 48 layers through a CUDA graph) on an H200, summed over the counts each serves; the tiles
    # change no bits. One token: gate/up 16.7 us a layer against 22.3 with (32, 128, 4, 3); 64 tokens: 185.1
    # against 200.9, down 97.6 against 103.3 (docs/results/2026-12-04-moe-decode)
    if tokens == 1 and ONE_TOKEN_TILES is not None:
        return ONE_TOKEN_TILES
    # one token: the down tile of depth 256 on 4 warps, the best of the one-token sweep on an H100 (10.68 us a layer
    # against 10.75 for the next, 11.29 as below) and within 0.1 % of the best on an H200 (8.97 against 8.96); the
    # step 3.210 -> 3.165 ms on the H100, the same bits (docs/results/2026-12-06-moe-tiles-h100)
    if tokens == 1:
        return Tiles(16, 64, 64, 128, 4, 5, 256, 4, 3)
    if tokens <= 8:
        return Tiles(16, 64, 64, 128, 4, 5, 128, 2, 3)
    if tokens <= 128:
        return Tiles(16, 128, 64, 128, 4, 3, 128, 2, 4)
    if tokens < 2048:  # the best of experiments/moe_prefill_probe.py's sweep at 1k tokens on an H200: a layer
        # 0.42 ms against 0.51 with (64, 64, 64, 64, 4, 3)
        return Tiles(64, 128, 256, 64, 8, 5, 64, 8, 4)
    # a long prefill (>= 16 slots an expert at 8 of 128): the best of experiments/moe_prefill_probe.py's sweep
    # at 4k tokens on an H200 (gate/up and down swept apart): gate/up 0.466 ms and down 0.285 ms a layer,
    # against 0.508 and 0.377 with (128, 128, 128, 64, 8, 3) for both
    return Tiles(128, 128, 256, 64, 8, 4, 64, 8, 4)


# an H200's (and H100's) shared memory a block: 227 KB
SHARED_BYTES = 232448


def shared_bytes(bm: int, bn: int, bk: int, stages: int, itemsize: int, mats: int) -> int:
    """Shared memory of a grouped kernel's pipeline as Triton 3.6 lays it out on sm_90: a buffer a stage where
    the dot takes wgmma (16-bit operands, row blocks of 64 and more), else stages - 1 buffers; each buffer a row
    block's slice of A [bm, bk] and ``mats`` weight slices [bk, bn] (gate/up two, down one)."""
    buffers = stages if itemsize < 4 and bm >= 64 else max(1, stages - 1)
    return buffers * (bm * bk + mats * bk * bn) * itemsize


def fit_tiles(tiles: Tiles, itemsize: int) -> Tiles:
    """Tiles for a dtype of ``itemsize`` bytes: float32 tiles take twice the shared memory a stage, so at
    most 3 stages (2 buffers) each, and the depth halved until both kernels fit ``SHARED_BYTES`` (a decode
    step's 128-column gate/up tile at depth 128 would take 272 KB)."""
    if itemsize < 4:
        return tiles
    stages, down_stages = min(tiles.stages, 3), min(tiles.down_stages or tiles.stages, 3)

    def depth(bn: int, bk: int, stages: int, mats: int) -> int:
        while bk > 16 and shared_bytes(tiles.bm, bn, bk, stages, itemsize, mats) > SHARED_BYTES:
            bk //= 2
        return bk

    return tiles._replace(stages=stages, down_stages=down_stages, bk=depth(tiles.bn_up, tiles.bk, stages, 2),
                          bk_down=depth(tiles.bn_down, tiles.bk_down or tiles.bk, down_stages, 1))


class RouteLaunch(NamedTuple):
    """The routing kernel's launch: tokens a pass, slots a pass, warps."""

    tt: int
    sc: int
    warps: int


def route_launch_for(tokens: int, ep: int) -> RouteLaunch:
    """The routing kernel's tile for ``tokens`` over ``ep`` (a power of two) experts: up to 4k
    elements a token pass and 8k a slot pass, on 8 warps; one token (a decode step of one sequence)
    on one warp, one token and 16 slots a pass, its reductions within the warp (3.6 us a layer against
    7.8 on an H200 at Qwen3-30B-A3B's 128 experts, experiments/moe_route_sweep.py; at 8 tokens no
    launch of the sweep was more than 3 % faster than this one)."""
    if tokens == 1:
        return RouteLaunch(1, 16, 1)
    return RouteLaunch(max(1, min(16, 4096 // ep)), max(16, min(64, 8192 // ep)), 8)


def route_group(h: torch.Tensor, router: torch.Tensor, k: int, renorm: bool, bm: int):
    """(weights [T k], experts [T k] int32, slot ids, block expert) of ``route`` + ``group_slots``,
    in two launches: the router's matmul and ``_route_group_kernel``."""
    return group_logits(F.linear(h, router), k, renorm, bm)


def _routing_buffers(logits: torch.Tensor, k: int, bm: int, blocks: int = 0):
    """(weights, experts, slot ids, block expert) for a routing of logits [T, E], unfilled; ``blocks`` row
    blocks (default: ``block_bound``'s)."""
    T, E = logits.shape
    max_blocks = blocks or block_bound(T * k, E, bm)
    dev = logits.device
    return (torch.empty(T * k, dtype=logits.dtype, device=dev), torch.empty(T * k, dtype=torch.int32, device=dev),
            torch.empty(max_blocks * bm, dtype=torch.int32, device=dev),
            torch.empty(max_blocks, dtype=torch.int32, device=dev))


def group_logits(logits: torch.Tensor, k: int, renorm: bool, bm: int, launch: Optional[RouteLaunch] = None):
    """``route_group`` from the router's logits [T, E]: ``_route_group_kernel`` alone (``launch``: its
    tile and warps, default ``route_launch_for``)."""
    T, E = logits.shape
    weights, experts, slot_ids, block_expert = _routing_buffers(logits, k, bm)
    max_blocks = block_expert.numel()
    ep = triton.next_power_of_2(E)
    if T == 1 and ROUTE_ONE_TOKEN and launch is None:
        _route_one_kernel[(1,)](logits, weights, experts, slot_ids, block_expert, E, max_blocks * bm, max_blocks,
                                K=k, KP=triton.next_power_of_2(k), RENORM=renorm, BM=bm, EP=ep,
                                RP=triton.next_power_of_2(max_blocks * bm), BP=triton.next_power_of_2(max_blocks),
                                num_warps=1, **chain.launch(logits, "route"))
        return weights, experts, slot_ids, block_expert
    if 1 < T <= min(ROUTE_FEW_TOKENS, bm) and launch is None:
        _route_few_kernel[(1,)](logits, weights, experts, slot_ids, block_expert, T, E, logits.stride(0),
                                max_blocks * bm, max_blocks, K=k, KP=triton.next_power_of_2(k), RENORM=renorm, BM=bm,
                                EP=ep, TP=triton.next_power_of_2(T), RP=triton.next_power_of_2(max_blocks * bm),
                                BP=triton.next_power_of_2(max_blocks), num_warps=ROUTE_FEW_WARPS[T > 4],
                                **chain.launch(logits, "route"))
        return weights, experts, slot_ids, block_expert
    rl = launch or route_launch_for(T, ep)
    _route_group_kernel[(1,)](logits, weights, experts, slot_ids, block_expert, T, E, logits.stride(0),
                              max_blocks * bm, max_blocks, K=k, RENORM=renorm, BM=bm, EP=ep,
                              TT=rl.tt, SC=rl.sc, FILL=1024, num_warps=rl.warps,
                              **chain.launch(logits, "route"))
    return weights, experts, slot_ids, block_expert


def route_group_wide(h: torch.Tensor, router: torch.Tensor, k: int, renorm: bool, bm: int):
    """``route_group`` for a prefill's many tokens, spread over the GPU: the router's matmul, the counters
    zeroed, ``_route_count_kernel`` (TT tokens a program) and ``_place_kernel`` (SC slots a program); four
    launches, none waiting for the host (torch's sort-based grouping takes about twenty). Within an
    expert's rows the slots lie in the order the programs took their ranges, which may change run to run;
    a slot's products are its own row's, so the layer's output does not."""
    logits = F.linear(h, router)
    T, E = logits.shape
    n = T * k
    weights, experts, slot_ids, block_expert = _routing_buffers(logits, k, bm)
    max_blocks = block_expert.numel()
    dev = logits.device
    counters = torch.zeros((2, E), dtype=torch.int32, device=dev)  # each expert's slots; its rows taken
    ep = triton.next_power_of_2(E)
    tt = max(1, min(16, 4096 // ep))
    _route_count_kernel[(triton.cdiv(T, tt),)](logits, weights, experts, counters[0], slot_ids, T, E,
                                               logits.stride(0), max_blocks * bm, K=k, RENORM=renorm, EP=ep,
                                               TT=tt, SP=triton.next_power_of_2(tt * k), FILL=1024, num_warps=4)
    sc = max(16, min(64, 8192 // ep))
    _place_kernel[(triton.cdiv(n, sc),)](experts, counters[0], counters[1], slot_ids, block_expert, n, E,
                                         max_blocks, BM=bm, EP=ep, SC=sc, num_warps=4)
    return weights, experts, slot_ids, block_expert


class SelfRoute(NamedTuple):
    """A one-token step routed by the gate/up kernel itself (``SELF_ROUTE_ONE_TOKEN``): the token's router
    logits [1, E], its k and whether the chosen weights are renormalised."""

    logits: torch.Tensor
    k: int
    renorm: bool


def gate_up_product(h: torch.Tensor, gate_up: torch.Tensor, slot_ids: torch.Tensor, block_expert: torch.Tensor,
                    k: int, tiles: Tiles, route: Optional[SelfRoute] = None,
                    weights: Optional[torch.Tensor] = None, down: Optional[torch.Tensor] = None,
                    own: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` of each slot's token row through its expert, [rows, i]: in the slot table's row
    order (``ROW_ACT``: padding rows too), else in slot order. One launch (``_gate_up_kernel``). ``route``:
    a one-token step's routing, made by the kernel (row block j the token's j-th choice), which writes the
    slot table, the blocks' experts and ``weights`` as the grouping would have (k row blocks of tiles.bm).
    ``down`` [E, d, i] (contiguous): the programs of each row block also ask L2 for its expert's down weights,
    a share each (``PREFETCH_DOWN_TOKENS``). ``own``: each program asks L2 for its own weight rows first
    (``PREFETCH_OWN_TOKENS``)."""
    T, d = h.shape
    inter = gate_up.shape[1] // 2
    n = T * k
    if route is None:
        blocks, E, logits, routing = block_expert.numel(), 1, h, {"SELF_ROUTE": False, "K": 1, "RENORM": False,
                                                                  "EP": 1}
    else:
        E = route.logits.shape[1]
        blocks, logits = route.k, route.logits
        routing = {"SELF_ROUTE": True, "K": route.k, "RENORM": route.renorm, "EP": triton.next_power_of_2(E)}
    act = torch.empty((blocks * tiles.bm if ROW_ACT else n, inter), dtype=h.dtype, device=h.device)
    grid = (blocks, triton.cdiv(inter, tiles.bn_up))
    ahead: dict = {}
    if down is not None and prefetch.enabled(h):
        lines, line = prefetch.lines_for(down[0].numel(), grid[1], down.element_size())
        ahead = {"PREFETCH": True, "LINES": lines, "LINE": line}
    if own and prefetch.enabled(h):
        lpr, line = prefetch.row_lines(d, gate_up.element_size())
        ahead.update(OWN=True, LPR=lpr, LINE=line)
    even = EVEN_LOADS and d % tiles.bk == 0 and inter % tiles.bn_up == 0
    if even and 0 < TMA_SLOTS <= n and route is None and gate_up.is_contiguous() and _tma_ok(tiles.bk, gate_up):
        ahead.update(Wd=_box(gate_up, tiles.bn_up, tiles.bk), TMA=True)
    # (a grid's second axis is at most 65,535)
    cols_first = 0 < GATE_UP_COLS_FIRST_SLOTS <= n and route is None and grid[0] < 65536
    _gate_up_kernel[grid[::-1] if cols_first else grid](
        h, gate_up, act, slot_ids, block_expert, logits, h if weights is None else weights,
        h if down is None else down, n, d, inter, k, E,
        h.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        0 if down is None else down.stride(0), 0 if down is None else down[0].numel(),
        PREC=_precision(h), BM=tiles.bm, BN=tiles.bn_up, BK=tiles.bk, EVEN=even, ROW_ACT=ROW_ACT,
        num_warps=tiles.warps, num_stages=tiles.stages, COLS_FIRST=cols_first, **routing, **ahead,
        **chain.launch(h, "gate_up"))
    return act


def down_per_slot(act: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, slot_ids: torch.Tensor,
                  block_expert: torch.Tensor, n: int, tiles: Tiles, own: bool = False) -> torch.Tensor:
    """Each slot's product through its expert's down projection times its routing weight, [n, d], in
    slot order (token t's k slots at rows t k .. t k + k - 1). One launch (``_down_kernel``). ``own``: each
    program asks L2 for its own weight rows first (``PREFETCH_OWN_TOKENS``)."""
    d, inter = down.shape[1], down.shape[2]
    bk, warps, stages = tiles.bk_down or tiles.bk, tiles.down_warps or tiles.warps, tiles.down_stages or tiles.stages
    per_slot = torch.empty((n, d), dtype=act.dtype, device=act.device)
    ahead: dict = {}
    if own and prefetch.enabled(act):
        lpr, line = prefetch.row_lines(inter, down.element_size())
        ahead = {"OWN": True, "LPR": lpr, "LINE": line}
    grid = (block_expert.numel(), triton.cdiv(d, tiles.bn_down))
    cols_first = 0 < DOWN_COLS_FIRST_SLOTS <= n and grid[0] < 65536  # (a grid's second axis is at most 65,535)
    even = EVEN_LOADS and inter % bk == 0 and d % tiles.bn_down == 0
    if (even and ROW_ACT and 0 < TMA_SLOTS <= n and down.is_contiguous() and act.is_contiguous()
            and _tma_ok(bk, down, act)):
        ahead.update(Ad=_box(act, tiles.bm, bk), Wd=_box(down, tiles.bn_down, bk), TMA=True)
    _down_kernel[grid[::-1] if cols_first else grid](
        act, down, weights, per_slot, slot_ids, block_expert, n, d, inter,
        act.stride(0), down.stride(0), down.stride(1), per_slot.stride(0),
        PREC=_precision(act), BM=tiles.bm, BN=tiles.bn_down, BK=bk,
        EVEN=even, ROW_ACT=ROW_ACT, num_warps=warps, num_stages=stages, COLS_FIRST=cols_first, **ahead,
        **chain.launch(act, "down"))
    return per_slot


def gate_up_rows(h: torch.Tensor, gate_up: torch.Tensor, slot_ids: torch.Tensor, block_expert: torch.Tensor, k: int,
                 bm: int) -> torch.Tensor:
    """``gate_up_product`` of a step of a few tokens by ``_gate_up_rows_kernel``: [blocks bm, i] in the slot table's
    row order (``ROW_ACT``), each block's slots' rows written (the padding's not: the down kernels never store them)."""
    T, d = h.shape
    inter = gate_up.shape[1] // 2
    blocks = block_expert.numel()
    act = torch.empty((blocks * bm, inter), dtype=h.dtype, device=h.device)
    _gate_up_rows_kernel[(blocks, triton.cdiv(inter, ROWS))](
        h, gate_up, act, slot_ids, block_expert, T * k, d, inter, k, h.stride(0), gate_up.stride(0), gate_up.stride(1),
        act.stride(0), BM=bm, KP=triton.next_power_of_2(d), R=ROWS, ONE=T == 1, num_warps=ROWS_WARPS,
        **chain.launch(h, "gate_up"))
    return act


def down_rows(act: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, slot_ids: torch.Tensor,
              block_expert: torch.Tensor, n: int, bm: int, tokens: int) -> torch.Tensor:
    """``down_per_slot`` of a step of a few tokens by ``_down_gemv_kernel`` reading nothing before it waits
    (``DOWN_ROWS`` whole rows a program): [n, d] in slot order (``tokens``: the step's; one takes the kernel's
    straight-line form)."""
    d, inter = down.shape[1], down.shape[2]
    per_slot = torch.empty((n, d), dtype=act.dtype, device=act.device)
    _down_gemv_kernel[(block_expert.numel(), triton.cdiv(d, DOWN_ROWS))](
        act, down, weights, per_slot, slot_ids, block_expert, n, d, act.stride(0), down.stride(0), down.stride(1),
        per_slot.stride(0), K=inter, KP=triton.next_power_of_2(inter), BM=bm, BN=DOWN_ROWS, ROW_ACT=True, EARLY=False,
        ONE=tokens == 1, num_warps=DOWN_ROWS_WARPS, **chain.launch(act, "down"))
    return per_slot


def down_gemv(act: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, slot_ids: torch.Tensor,
              block_expert: torch.Tensor, n: int, bm: int) -> torch.Tensor:
    """``down_per_slot`` by ``_down_gemv_kernel``: [n, d], each slot's product through its expert's down
    projection times its weight, ``DOWN_GEMV_COLUMNS`` output columns a program."""
    from pushkv.model.kernels.triton_gemv import TILE_ELEMENTS, WARPS

    d, inter = down.shape[1], down.shape[2]
    kp = triton.next_power_of_2(inter)
    bn = max(1, min(DOWN_GEMV_COLUMNS, TILE_ELEMENTS // kp))
    per_slot = torch.empty((n, d), dtype=act.dtype, device=act.device)
    grid = (block_expert.numel(), triton.cdiv(d, bn))
    _down_gemv_kernel[grid](act, down, weights, per_slot, slot_ids, block_expert, n, d, act.stride(0),
                            down.stride(0), down.stride(1), per_slot.stride(0), K=inter, KP=kp, BM=bm, BN=bn,
                            ROW_ACT=ROW_ACT, num_warps=WARPS, **chain.launch(act))
    return per_slot


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def moe_mlp(h: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            k: int, renorm: bool, tiles: Union[Tiles, DecodeTiles, None] = None, summed: bool = True,
            logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As ``pushkv.model.moe.moe_mlp``: h [T, d] (normed), router [E, d], gate_up [E, 2 i, d],
    down [E, d, i] -> [T, d]. ``tiles``: the launch's tiles (default: ``tiles_for``); ``DecodeTiles``
    (up to ``DECODE_TOKENS`` tokens) take the ungrouped decode kernels. ``summed`` False: the grouped
    kernels' [T, k, d] (each token's k experts, weighted, not yet summed) for the caller to sum in its
    next launch (``triton_fused.add_rms``); the decode kernels sum in theirs ([T, d] either way). ``logits``:
    the router's logits of h [T, E] where the caller has them (``triton_fused.add_rms_router``, a decode
    step of up to ``FUSED_ROUTE_TOKENS``), so the router's matmul is not run again."""
    T, d = h.shape
    n = T * k
    tl_ = tiles or tiles_for(T)
    h = h.contiguous()
    if isinstance(tl_, DecodeTiles):
        if T > DECODE_TOKENS:
            raise ValueError(f"DecodeTiles serve at most {DECODE_TOKENS} tokens, not {T}")
        return moe_mlp_decode(h, router.contiguous(), gate_up.contiguous(), down.contiguous(), k, renorm, tl_,
                              logits)[0]
    if T == 1 and PERSISTENT_ONE_TOKEN and tiles is None:
        from pushkv.model.kernels.triton_moe_token import moe_token  # (it builds on this module's routing)

        per_slot = moe_token(h, F.linear(h, router) if logits is None else logits.contiguous(),
                             gate_up.contiguous(), down.contiguous(), k, renorm)
        return per_slot.sum(dim=1) if summed else per_slot
    tl_ = fit_tiles(tl_, h.element_size())
    route = None
    if T == 1 and SELF_ROUTE_ONE_TOKEN:  # no routing launch: the gate/up kernel routes the token itself
        route = SelfRoute(F.linear(h, router) if logits is None else logits, k, renorm)
        weights, _, slot_ids, block_expert = _routing_buffers(route.logits, k, tl_.bm, blocks=k)
    # a prefill's many slots across the GPU; a decode step's few in one program (the one-program kernel
    # would walk a prefill's alone)
    elif logits is not None:
        if T > FUSED_ROUTE_TOKENS:
            raise ValueError(f"router logits are taken for up to {FUSED_ROUTE_TOKENS} tokens, not {T}")
        weights, _, slot_ids, block_expert = group_logits(logits, k, renorm, tl_.bm)
    else:
        grouping = route_group if T <= FUSED_ROUTE_TOKENS else route_group_wide
        weights, _, slot_ids, block_expert = grouping(h, router, k, renorm, tl_.bm)
    down = down.contiguous()
    own = T <= PREFETCH_OWN_TOKENS
    rows = T <= ROWS_TOKENS and route is None and ROW_ACT and tiles is None  # (tiles given: the grouped kernels')
    if rows and ROWS_ONE_TOKEN:
        act = gate_up_rows(h, gate_up.contiguous(), slot_ids, block_expert, k, tl_.bm)
    else:
        act = gate_up_product(h, gate_up.contiguous(), slot_ids, block_expert, k, tl_, route, weights,
                              down if T <= PREFETCH_DOWN_TOKENS else None, own)
    if rows and DOWN_ROWS_ONE_TOKEN:
        per_slot = down_rows(act, down, weights, slot_ids, block_expert, n, tl_.bm, T)
    # the down GEMVs read the tables before they wait: only a routing launch's, never those gate/up writes
    elif route is None and T <= DOWN_GEMV_TOKENS and down.shape[2] <= TILE_DEPTH:
        per_slot = down_gemv(act, down, weights, slot_ids, block_expert, n, tl_.bm)
    else:
        per_slot = down_per_slot(act, down, weights, slot_ids, block_expert, n, tl_, own)
    per_token = per_slot.view(T, k, d)
    return per_token.sum(dim=1) if summed else per_token


def moe_routed(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """The grouped kernels for a routing already made (DeepSeek's, ``moe.route_grouped``): h [T, d] (normed),
    weights and experts [T, k] -> [T, d], as ``moe.routed_experts``. The slots are grouped in torch
    (``group_slots``: nothing waits for the host), then gate/up and down as ``moe_mlp``'s."""
    T, d = h.shape
    k = experts.shape[1]
    chosen = tiles_for(T)
    # (the ungrouped decode kernels route themselves: the grouped ones here)
    grouped = chosen if isinstance(chosen, Tiles) else tiles_for(DECODE_TOKENS + 1)
    assert isinstance(grouped, Tiles)
    tl_ = fit_tiles(grouped, h.element_size())
    h = h.contiguous()
    slot_ids, block_expert = group_slots(experts, gate_up.shape[0], tl_.bm)
    w = weights.to(h.dtype).contiguous().view(-1)
    act = gate_up_product(h, gate_up.contiguous(), slot_ids, block_expert, k, tl_)
    return down_per_slot(act, down.contiguous(), w, slot_ids, block_expert, T * k, tl_).view(T, k, d).sum(dim=1)
