"""MLA's decode attention in the latent's space, as one Triton kernel (and the split merge of triton_paged).

A decode row of an MLA model (``pushkv.model.mla``) attends with every query head to the same cached rows
``[c, k_rope]`` (``kv_lora_rank`` + ``qk_rope_dim`` wide, one row per token): absorbed, a head's query is
``[q_nope W_uk, q_rope]`` and its output the softmax-weighted sum of the rows' ``c``, which the value
up-projection then takes to the head's width (``batched._mla_decode_rows`` does both projections). So it is
multi-query attention with one key head whose values are the first ``kv_lora_rank`` dims of its keys: a program
takes one decode row, ``BLOCK_H`` of its query heads and one split of its keys, and reads each key tile once for
all of them (the scores as two dots, the latent's and the RoPE part's; the values from the same tile), with an
online softmax in float32 over the rows through the block table. Splits of the keys (flash-decoding) leave
float32 partials that ``triton_paged``'s merge kernel merges, as the other decode attention's do.

The torch path (``paged.mla_decode_ref``) gathers every row's latent rows padded to the table's width; this kernel
reads them in place, the keys past a row's length never. A row with no keys (a CUDA graph's padding row) gives
0. Rounding: the scores and softmax in float32 as the torch path, the weighted sum accumulated in float32 and
rounded once (the torch path rounds the probabilities to the model dtype first).
"""
from __future__ import annotations

import torch

from pushkv.extras import missing

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:  # a CUDA torch build without Triton
    raise missing("triton", "pushkv's CUDA kernels") from e

from pushkv.model.kernels import chain
from pushkv.model.kernels.chain import wait_prior
from pushkv.model.kernels.paged import mla_kernel_fits
from pushkv.model.kernels.triton_paged import LOG2E, _merge_kernel


@triton.jit
def _mla_decode_kernel(Q, O, cache, block_table, seq_lens, tile_seq, Part, PartML,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, s_blk, s_slot, U,
                       num_tiles, num_heads, sm_scale_log2,
                       R: tl.constexpr, RD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    tile = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq + tile)
    ctx = tl.load(seq_lens + seq)
    lo = 0
    hi = ctx
    if NUM_SPLITS > 1:  # the key tiles shared out over the splits, whole tiles each
        per = tl.cdiv(tl.cdiv(ctx, BLOCK_N), NUM_SPLITS) * BLOCK_N
        lo = split * per
        hi = tl.minimum(ctx, lo + per)

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    c = tl.arange(0, R)
    e = tl.arange(0, RD)
    q_row = Q + tile.to(tl.int64) * stride_qt + h[:, None] * stride_qh
    q_c = tl.load(q_row + c[None, :], mask=h_ok[:, None], other=0.0)
    q_r = tl.load(q_row + R + e[None, :], mask=h_ok[:, None], other=0.0)

    bt = block_table + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        ok = kpos < hi
        blk = tl.load(bt + kpos // U, mask=ok, other=0).to(tl.int64)
        row = cache + blk * s_blk + (kpos % U) * s_slot
        lat = tl.load(row[:, None] + c[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_N, R]: keys and values
        rope = tl.load(row[:, None] + R + e[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q_c, tl.trans(lat), input_precision=PREC)
        if RD >= 16:
            s += tl.dot(q_r, tl.trans(rope), input_precision=PREC)
        else:  # too narrow for a dot: the products summed
            s += tl.sum(q_r.to(tl.float32)[:, None, :] * rope.to(tl.float32)[None, :, :], 2)
        s = tl.where(ok[None, :], s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=PREC)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(O + tile.to(tl.int64) * stride_ot + h[:, None] * stride_oh + c[None, :], out.to(O.dtype.element_ty),
                 mask=h_ok[:, None])
    else:  # partials [splits, tiles, heads, R] and (m, l) [splits, tiles, heads, 2], as triton_paged's merge reads
        idx = (split * num_tiles + tile) * num_heads + h
        tl.store(Part + idx[:, None] * R + c[None, :], acc, mask=h_ok[:, None])
        tl.store(PartML + idx * 2, m_i, mask=h_ok)
        tl.store(PartML + idx * 2 + 1, l_i, mask=h_ok)


def scratch(splits: int, tiles: int, heads: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split partials for up to ``tiles`` decode rows: float32 [splits, tiles, heads, rank] and their (m, l)."""
    return (torch.empty(splits * tiles * heads * rank, device=device, dtype=torch.float32),
            torch.empty(splits * tiles * heads * 2, device=device, dtype=torch.float32))


def mla_decode(q_abs: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               tile_seq: torch.Tensor, rank: int, scale: float, num_splits: int = 1,
               part: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode row t's heads q_abs [B, H, rank + rope] (tile_seq[t]: its sequence) over that sequence's
    ``seq_lens`` latent rows of cache [blocks, 1, 1, U, rank + rope] (block_table's row): the softmax (``scale``
    on the scores) weighted sum of the rows' first ``rank`` dims, [B, H, rank] in q_abs's dtype."""
    B, H, width = q_abs.shape
    rd = width - rank
    if not mla_kernel_fits(rank, rd):
        raise ValueError(f"kv_lora_rank {rank} and qk_rope_dim {rd}: each must be a power of two, the first >= 16")
    if cache.dim() != 5 or cache.shape[1:3] != (1, 1) or cache.shape[4] != width or cache.stride(4) != 1:
        raise ValueError(f"latent cache must be [blocks, 1, 1, U, {width}] with contiguous rows, got "
                         f"{tuple(cache.shape)}")
    if q_abs.stride(2) != 1:
        raise ValueError("q_abs rows must be contiguous")
    if out is None:
        out = torch.empty(B, H, rank, device=q_abs.device, dtype=q_abs.dtype)
    if B == 0:
        return out
    block_h = 16 if H <= 16 else 32
    block_n = 32 if rank >= 256 else 64
    if q_abs.dtype == torch.float32:
        block_h, block_n = 16, 16
    if num_splits > 1 and part is None:
        part = scratch(num_splits, B, H, rank, q_abs.device)
    p, pml = part if num_splits > 1 and part is not None else (out, out)
    grid = (B, triton.cdiv(H, block_h), num_splits)
    _mla_decode_kernel[grid](
        q_abs, out, cache, block_table, seq_lens, tile_seq, p, pml,
        q_abs.stride(0), q_abs.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        cache.stride(0), cache.stride(3), cache.shape[3], B, H, scale * LOG2E,
        R=rank, RD=rd, BLOCK_H=block_h, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        PREC="ieee" if q_abs.dtype == torch.float32 else "tf32", num_warps=8 if block_h * rank >= 16384 else 4,
        num_stages=2, **chain.launch(q_abs))
    if num_splits > 1:
        rows = torch.arange(B, device=q_abs.device, dtype=torch.int32)  # the merge's rows: tile t at row t
        _merge_kernel[(B, H)](p, pml, out, rows, rows, out.stride(0), out.stride(1), B, H, D=rank, BLOCK_D=rank,
                              NUM_SPLITS=num_splits, num_warps=4, **chain.launch(q_abs))
    return out

