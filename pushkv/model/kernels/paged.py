"""Paged-attention ops on one layer's pool view, for the batched forward.

``store_kv`` and ``attention`` run the Triton kernels on CUDA tensors and a torch
reference otherwise (the CPU path, and the yardstick the kernel tests compare with).
The reference gathers each sequence's keys, which the kernels never do.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from pushkv.model.masks import causal_mask


def store_kv_ref(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    keep = slots >= 0
    if not bool(keep.all()):
        k, v, slots = k[keep], v[keep], slots[keep]
    u = cache.shape[-2]
    blk, s = slots // u, slots % u
    if cache.dim() == 6:
        g, hg = cache.shape[2], cache.shape[3]
        cache[blk, 0, :, :, s] = k.view(-1, g, hg, k.shape[-1])
        cache[blk, 1, :, :, s] = v.view(-1, g, hg, v.shape[-1])
    else:
        cache[blk, 0, :, s] = k
        cache[blk, 1, :, s] = v


def attention_ref(q, cache, block_table, seq_lens, q_starts, q_lens, window: int = 0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as triton_paged.attention (tiles aside), one sequence at a time."""
    u = cache.shape[-2]
    out = torch.zeros_like(q) if out is None else out
    T, Hq, D = q.shape
    for i in range(seq_lens.shape[0]):
        ctx, n, r0 = int(seq_lens[i]), int(q_lens[i]), int(q_starts[i])
        if n == 0 or ctx == 0:
            continue
        nb = -(-ctx // u)
        blocks = block_table[i, :nb].long()
        kb, vb = cache[blocks, 0], cache[blocks, 1]  # copies: [nb, (groups,) heads, U, D]
        if kb.dim() == 5:
            kb, vb = kb.flatten(1, 2), vb.flatten(1, 2)
        kvh = kb.shape[1]
        keys = kb.permute(1, 0, 2, 3).reshape(kvh, nb * u, D)[:, :ctx]
        vals = vb.permute(1, 0, 2, 3).reshape(kvh, nb * u, D)[:, :ctx]
        qi = q[r0:r0 + n].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qi, keys[None], vals[None], attn_mask=causal_mask(ctx, n, window, q.device),
                                           enable_gqa=Hq != keys.shape[0], scale=1 / math.sqrt(D))
        out[r0:r0 + n] = o[0].transpose(0, 1)
    return out


def decode_scratch(splits: int, tokens: int, q_heads: int, kv_heads: int, head_dim: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What split decode attention leaves between its programs, for up to ``tokens`` decode rows: fp32 partials
    [splits, tokens, q_heads, head_dim] and their (m, l), and one int32 counter a (tile, kv head) for the merge in
    the kernel, zero (each launch leaves them zero, so one scratch serves every layer and graph replay)."""
    return (torch.empty(splits * tokens * q_heads * head_dim, device=device, dtype=torch.float32),
            torch.empty(splits * tokens * q_heads * 2, device=device, dtype=torch.float32),
            torch.zeros(tokens * kv_heads, device=device, dtype=torch.int32))


def store_kv(cache, k, v, slots) -> None:
    if cache.is_cuda:
        from pushkv.model.kernels import triton_paged

        triton_paged.store_kv(cache, k, v, slots)
    else:
        store_kv_ref(cache, k, v, slots)


def store_latent(cache, lat, slots) -> None:
    """MLA's latent rows [T, D] into cache [blocks, 1, 1, U, D] at flat slots (< 0: skip); on CUDA one kernel that
    reads the slots on the device, so a decode graph captures it."""
    if cache.is_cuda:
        from pushkv.model.kernels import triton_paged

        triton_paged.store_latent(cache, lat, slots)
        return
    keep = slots >= 0
    u = cache.shape[-2]
    cache[slots[keep] // u, 0, 0, slots[keep] % u] = lat[keep]


def attention(q, cache, meta, window: int = 0, out=None, decode_splits: int = 1, scratch=None):
    """Attention of every sequence of a step (meta: pushkv.model.step.StepTensors)."""
    if not cache.is_cuda:
        return attention_ref(q, cache, meta.block_table, meta.seq_lens, meta.q_starts, meta.q_lens,
                             window, out)
    from pushkv.model.kernels import triton_paged

    out = torch.empty_like(q) if out is None else out
    if meta.decode_tiles.shape[0]:
        triton_paged.attention(q, cache, meta.block_table, meta.seq_lens, meta.q_starts, meta.q_lens,
                               meta.decode_tiles, meta.decode_q0, 1, decode_splits, window, out, scratch)
    if meta.prefill_tiles.shape[0]:
        triton_paged.attention(q, cache, meta.block_table, meta.seq_lens, meta.q_starts, meta.q_lens,
                               meta.prefill_tiles, meta.prefill_q0, meta.block_q, 1, window, out)
    return out


# The fused attention ``fresh_attention`` asks torch for first (``torch.nn.attention.SDPBackend``'s names, lower
# case), then flash, memory-efficient and math as torch finds them fit. FRESH_PAD, FRESH_STEPS: each prompt's rows
# are read padded (``fresh_padded``) to a multiple of FRESH_PAD, or past 4,096 rows (with 128 and 16) of 1/16 of
# its power-of-two octave, FRESH_STEPS lengths per doubling (the rows after a prompt's are the next prompt's or
# zero, keys no query of the prompt sees under the causal mask, and their outputs are dropped). cuDNN builds a plan
# for each length it meets (60 ms on an H100, torch 2.11, cuDNN 9.19) and ran a 4,097-row prompt in 0.49 ms
# against 0.27 ms for 4,096 (experiments/attn_sdpa_probe.py); the worker makes them all at start-up, 81 up to 65,536
# tokens in 3.9 s where multiples of 128 alone took 497 plans and 32.4 s, the attention as fast within noise at
# 2k-60k tokens (experiments/fresh_plans_probe.py). FRESH_REPEAT: each key head repeated for its query heads (a
# copy) rather than the groups given to the backend (``enable_gqa``)
FRESH_BACKEND = "cudnn_attention"
FRESH_PAD = 128
FRESH_STEPS = 16
FRESH_REPEAT = False


def fresh_padded(n: int) -> int:
    """The rows ``fresh_attention`` reads for an n-token prompt: n rounded up to a multiple of FRESH_PAD, or of
    1/FRESH_STEPS of the octave n falls in (``(2**(k-1), 2**k]``) where that is coarser."""
    step = max(FRESH_PAD, (1 << max(n - 1, 1).bit_length()) // (2 * FRESH_STEPS))
    return -(-n // step) * step


def fresh_lengths(lo: int, hi: int) -> list[int]:
    """Every padded length (``fresh_padded``) of the prompts of lo to hi tokens, in order: one cuDNN plan each."""
    out, n = [], fresh_padded(max(lo, 1))
    while n <= fresh_padded(hi):
        out.append(n)
        n = fresh_padded(n + 1)
    return out


def fresh_rows(whole: tuple[tuple[int, int], ...]) -> int:
    """Rows ``fresh_attention`` reads for these prompts (each prompt's rows padded: ``fresh_padded``)."""
    return max(r0 + fresh_padded(n) for r0, n in whole)


def fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, whole: tuple[tuple[int, int], ...],
                    out: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention of whole prompts over their own keys, as they are, through torch's fused attention (no
    pool read): q [R, Hq, D], k and v [R, Hk, D] (token-major, finite; R at least ``fresh_rows(whole)``, the rows
    past the step's zero); ``whole`` the (first row, length) of each prompt (``StepTensors.whole``). Returns ``out``
    with the prompts' rows written, or for one prompt the first rows of the backend's own output (no copy)."""
    hq, hk = q.shape[1], k.shape[1]
    if q.shape[0] < fresh_rows(whole):
        raise ValueError(f"fresh_attention: {q.shape[0]} rows for prompts {whole}, "
                         f"which read {fresh_rows(whole)} padded")
    if FRESH_REPEAT and hq != hk:
        k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    with _backends(q):
        for r0, n in whole:
            rows = slice(r0, r0 + fresh_padded(n))
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None],
                is_causal=True, enable_gqa=hq != k.shape[1], scale=scale)[0].transpose(0, 1)[:n]
            if len(whole) == 1 and o.is_contiguous() and o.shape == out.shape:
                return o
            out[r0:r0 + n] = o
    return out


def _backends(q: torch.Tensor):
    """The context that puts ``FRESH_BACKEND`` first among torch's fused attentions (CUDA only)."""
    if not q.is_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    first = getattr(SDPBackend, FRESH_BACKEND.upper())
    return sdpa_kernel([first] + [b for b in order if b != first], set_priority=True)


def mla_kernel_fits(rank: int, rope_dim: int) -> bool:
    """Whether ``triton_mla.mla_decode`` takes these shapes: the latent and its RoPE part each a power of two, the
    latent at least 16 wide (DeepSeek's 512 and 64)."""
    return rank >= 16 and rope_dim >= 1 and not rank & (rank - 1) and not rope_dim & (rope_dim - 1)


def mla_decode_ref(q_abs: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   tile_seq: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """MLA's absorbed decode attention in torch ops (``triton_mla.mla_decode``'s contract): decode row t's heads
    q_abs [B, H, rank + rope] over its sequence's (tile_seq[t]) latent rows, each row's gathered through its block
    table (padded to the table's width, masked past its length) -> [B, H, rank]; no loop, no host read."""
    seqs = tile_seq.long()
    table = block_table.long()[seqs]
    width = cache.shape[-1]
    lat = cache[table, 0, 0].reshape(table.shape[0], -1, width)  # [B, W * U, width]
    keys = torch.arange(lat.shape[1], device=lat.device)[None, :] < seq_lens.long()[seqs][:, None]
    lat = lat.masked_fill(~keys[..., None], 0)  # slots past a sequence's length: never written, maybe NaN
    scores = torch.einsum("bhc,bsc->bhs", q_abs, lat).float() * scale
    p = scores.masked_fill(~keys[:, None, :], float("-inf")).softmax(-1).to(lat.dtype)
    p = torch.where(keys.any(-1)[:, None, None], p, 0)  # a graph's padding row has no keys: 0, not NaN
    return torch.einsum("bhs,bsr->bhr", p, lat[..., :rank])
