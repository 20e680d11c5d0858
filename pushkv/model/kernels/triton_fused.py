"""Fused elementwise kernels of the batched forward (Triton).

A decode step of a small batch is bound by kernel count, not bytes: the torch forward
spends ~50 launches a layer on norms, RoPE and the SwiGLU product. These fuse them to
one launch each:
- ``add_rms``: residual add and the next RMSNorm (HF semantics: normalise in float32,
  round to the model dtype, then scale by the weight); ``add_rms_router`` also the MoE router's
  logits of the normed row (a decode step);
- ``qk_norm_rope_store``: from the fused QKV projection, q/k RMSNorm (Qwen3), RoPE
  (rotate-half) and the K/V store into the paged pool, one program per head of one token (a decode
  step) or of 8 (a prefill);
- ``silu_mul``: SiLU(gate) * up.
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
from pushkv.model.kernels.triton_paged import _cache_strides

# ``add_rms_router``'s programs load their router rows before they wait for the kernel before them (the o
# projection), as the GEMVs load their weights; the same bits. On: on an H100 Qwen3-30B-A3B's batch-1 decode step
# went 3.382 -> 3.356 ms, batch 8 10.625 -> 10.596, and off again 3.357 -> 3.375 (experiments/moe_decode_probe.py,
# variants ``router_early``, ``router_late``; docs/results/2026-12-05-small-kernels)
ROUTER_EARLY = True


@triton.jit
def _add_norm_row(X, Delta, W, row, n_cols, eps, HAS_DELTA: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``row`` of X plus its SLOTS deltas, and that row's RMSNorm times W, both in X's dtype."""
    c = tl.arange(0, BLOCK)
    m = c < n_cols
    x = tl.load(X + row * n_cols + c, mask=m, other=0.0)
    if HAS_DELTA:
        # a row's SLOTS deltas (an MoE token's k experts) summed in float32 and rounded once, as
        # torch's sum over them rounds, then added: one slot is the plain residual add
        d = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SLOTS):
            d += tl.load(Delta + (row * SLOTS + s) * n_cols + c, mask=m, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) + d.to(x.dtype).to(tl.float32)).to(x.dtype)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * r).to(x.dtype).to(tl.float32) * tl.load(W + c, mask=m, other=0.0).to(tl.float32)
    return x, y.to(x.dtype)


@triton.jit
def _add_rms_kernel(X, Delta, W, Xout, H, n_cols, eps, HAS_DELTA: tl.constexpr, SLOTS: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr, NEXT_EARLY: tl.constexpr = False):
    wait_prior(PDL, NEXT_EARLY)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < n_cols
    x, y = _add_norm_row(X, Delta, W, row, n_cols, eps, HAS_DELTA, SLOTS, BLOCK)
    if HAS_DELTA:
        tl.store(Xout + row * n_cols + c, x, mask=m)
    tl.store(H + row * n_cols + c, y, mask=m)


def add_rms(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta) * w); x [N, d] contiguous. delta None: just the norm; delta
    [N, S, d] (an MoE layer's k experts a token, unsummed): x + their sum, in one launch."""
    N, d = x.shape
    h = torch.empty_like(x)
    xo = torch.empty_like(x) if delta is not None else x
    slots = 1
    if delta is not None:
        if delta.dim() == 3:
            slots = delta.shape[1]
        if delta.shape[0] != N or delta.shape[-1] != d or not delta.is_contiguous():
            raise ValueError(f"add_rms: delta {tuple(delta.shape)} is not a contiguous [{N}, ({{S}},) {d}]")
    if N:
        blk = triton.next_power_of_2(d)
        _add_rms_kernel[(N,)](x, delta if delta is not None else x, w, xo, h, d, eps,
                              HAS_DELTA=delta is not None, SLOTS=slots, BLOCK=blk,
                              num_warps=min(16, max(1, blk // 256)), **chain.launch(x, "add_rms"))
    return xo, h


@triton.jit
def _add_rms_router_kernel(X, Delta, W, Xout, H, R, Logits, n_cols, E, eps, BE: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr, EARLY: tl.constexpr = False,
                           NEXT_EARLY: tl.constexpr = False):
    # one token's row (every program of the row normalises it; the first stores it) and BE experts' logits
    c = tl.arange(0, BLOCK)
    m = c < n_cols
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    rows = R + e[:, None].to(tl.int64) * n_cols + c[None, :]
    if EARLY:  # the router's rows are no kernel's output: loaded while the kernel before this one runs
        w = tl.load(rows, mask=(e[:, None] < E) & m[None, :], other=0.0)
    wait_prior(PDL, NEXT_EARLY)
    row = tl.program_id(1).to(tl.int64)
    x, y = _add_norm_row(X, Delta, W, row, n_cols, eps, True, 1, BLOCK)
    if tl.program_id(0) == 0:
        tl.store(Xout + row * n_cols + c, x, mask=m)
        tl.store(H + row * n_cols + c, y, mask=m)
    if not EARLY:
        w = tl.load(rows, mask=(e[:, None] < E) & m[None, :], other=0.0)
    logit = tl.sum(w.to(tl.float32) * y.to(tl.float32)[None, :], 1)
    tl.store(Logits + row * E + e, logit.to(Logits.dtype.element_ty), mask=e < E)


def add_rms_router(x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float, router: torch.Tensor,
                   experts_a_program: int = 2):
    """(x + delta, h = rms_norm(x + delta) * w, the router's logits of h) in one launch, for an MoE layer of
    a decode step: x, delta [N, d] contiguous, router [E, d] contiguous -> logits [N, E] in x's dtype, each
    a float32 dot of h (rounded) and the expert's row, rounded once (as ``F.linear`` rounds). One program a
    token and ``experts_a_program`` experts (64 programs of 8 KB at Qwen3-30B-A3B's 128): the router's
    matmul as its own launch took 5.0 us of an ~80 us layer at one token on an H200
    (docs/results/2026-12-03-moe-decode-launches). Taken where ``batched.ROUTER_IN_NORM_TOKENS`` says."""
    N, d = x.shape
    E = router.shape[0]
    if delta.shape != x.shape or not delta.is_contiguous() or router.shape[1] != d or not router.is_contiguous():
        raise ValueError(f"add_rms_router: x {tuple(x.shape)}, delta {tuple(delta.shape)}, router "
                         f"{tuple(router.shape)} (contiguous [N, d], [N, d], [E, d])")
    h = torch.empty_like(x)
    xo = torch.empty_like(x)
    logits = torch.empty((N, E), dtype=x.dtype, device=x.device)
    if N:
        blk = triton.next_power_of_2(d)
        _add_rms_router_kernel[(triton.cdiv(E, experts_a_program), N)](
            x, delta, w, xo, h, router, logits, d, E, eps, BE=experts_a_program, BLOCK=blk,
            num_warps=min(16, max(1, blk // 256)), EARLY=ROUTER_EARLY, **chain.launch(x, "norm_router"))
    return xo, h, logits


@triton.jit
def _qk_rope_store_kernel(QKV, QN, KN, Cos, Sin, Pos, Slots, Qout, Kout, Vout, cache, T,
                          stride_row, stride_cos, s_blk, s_plane, s_grp, s_head, s_slot, HG, U, eps,
                          HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr,
                          TB: tl.constexpr, PDL: tl.constexpr, NEXT_EARLY: tl.constexpr = False,
                          KV_OUT: tl.constexpr = False):
    wait_prior(PDL, NEXT_EARLY)
    # one head of TB tokens a program
    t = (tl.program_id(0) * TB + tl.arange(0, TB)).to(tl.int64)
    live = t < T
    h = tl.program_id(1)
    half: tl.constexpr = D // 2
    i = tl.arange(0, half)
    base = QKV + t[:, None] * stride_row + h * D + i[None, :]
    x1 = tl.load(base, mask=live[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=live[:, None], other=0.0).to(tl.float32)
    is_q = h < HQ
    if HAS_NORM:
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)
        if is_q:
            w1 = tl.load(QN + i).to(tl.float32)
            w2 = tl.load(QN + half + i).to(tl.float32)
        else:
            w1 = tl.load(KN + i).to(tl.float32)
            w2 = tl.load(KN + half + i).to(tl.float32)
        dt = QKV.dtype.element_ty
        x1 = (x1 * r[:, None]).to(dt).to(tl.float32) * w1[None, :]
        x2 = (x2 * r[:, None]).to(dt).to(tl.float32) * w2[None, :]
        x1 = x1.to(dt).to(tl.float32)
        x2 = x2.to(dt).to(tl.float32)
    pos = tl.load(Pos + t, mask=live, other=0).to(tl.int64)
    c = tl.load(Cos + pos[:, None] * stride_cos + i[None, :]).to(tl.float32)
    s = tl.load(Sin + pos[:, None] * stride_cos + i[None, :]).to(tl.float32)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    if is_q:
        qo = Qout + (t[:, None] * HQ + h) * D + i[None, :]
        tl.store(qo, o1.to(Qout.dtype.element_ty), mask=live[:, None])
        tl.store(qo + half, o2.to(Qout.dtype.element_ty), mask=live[:, None])
    else:
        slot = tl.load(Slots + t, mask=live, other=-1).to(tl.int64)
        keep = (slot >= 0)[:, None]
        kh = h - HQ
        row = (slot // U) * s_blk + (kh // HG) * s_grp + (kh % HG) * s_head + (slot % U) * s_slot
        off = tl.where(keep, row[:, None] + i[None, :], 0)
        tl.store(cache + off, o1.to(cache.dtype.element_ty), mask=keep)
        tl.store(cache + off + half, o2.to(cache.dtype.element_ty), mask=keep)
        vb = QKV + t[:, None] * stride_row + (HQ + HK + kh) * D + i[None, :]
        v1 = tl.load(vb, mask=live[:, None], other=0.0)  # a kept row is a live one
        v2 = tl.load(vb + half, mask=live[:, None], other=0.0)
        tl.store(cache + s_plane + off, v1, mask=keep)
        tl.store(cache + s_plane + off + half, v2, mask=keep)
        if KV_OUT:  # the keys and values as stored, token-major [T, HK, D] each
            ko = (t[:, None] * HK + kh) * D + i[None, :]
            tl.store(Kout + ko, o1.to(cache.dtype.element_ty), mask=live[:, None])
            tl.store(Kout + ko + half, o2.to(cache.dtype.element_ty), mask=live[:, None])
            tl.store(Vout + ko, v1, mask=live[:, None])
            tl.store(Vout + ko + half, v2, mask=live[:, None])


def qk_norm_rope_store(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int,
                       q_norm, k_norm, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       positions: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
                       tokens_a_program: int = 0, rows_out: int = 0):
    """qkv [T, (Hq + 2 Hk) * D] -> q [T, Hq, D] (normed, rotated); K (normed, rotated) and V
    stored into cache at slots. cos/sin [positions, D] tables. ``tokens_a_program``: one head of that
    many tokens a program (0: one below 64 tokens, where a decode step's few rows want every program
    it can get, 8 from 64 up, where a prefill's one-warp programs of one row each cost more to
    schedule than their bytes: 4.35 ms of a 4k prefill of Qwen3-30B-A3B on an H200).

    ``rows_out`` (>= T): returns (q, k, v), each [rows_out, heads, D] and contiguous, k and v the keys and values
    as stored, the rows past T zero, for an attention that takes a whole prompt's new keys as they are
    (``paged.fresh_attention``, which pads a prompt's rows: ``paged.fresh_padded``)."""
    T = qkv.shape[0]
    n = max(rows_out, T)
    q = torch.empty(n, q_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    kv = torch.empty(2, n, kv_heads, head_dim, device=qkv.device, dtype=cache.dtype) if rows_out else q[:0]
    if rows_out and n > T:
        q[T:].zero_()
        kv[:, T:].zero_()
    if T == 0:
        return (q, kv[0], kv[1]) if rows_out else q
    if head_dim & (head_dim - 1):
        raise ValueError(f"fused RoPE needs a power-of-two head_dim, not {head_dim}")
    blk, plane, grp, head, slot, hg, u = _cache_strides(cache)
    has_norm = q_norm is not None
    tb = tokens_a_program or (1 if T < 64 else 8)
    _qk_rope_store_kernel[(triton.cdiv(T, tb), q_heads + kv_heads)](
        qkv, q_norm if has_norm else qkv, k_norm if has_norm else qkv, cos, sin, positions, slots, q,
        kv[0] if rows_out else q, kv[1] if rows_out else q, cache, T,
        qkv.stride(0), cos.stride(0), blk, plane, grp, head, slot, hg, u, eps,
        HQ=q_heads, HK=kv_heads, D=head_dim, HAS_NORM=has_norm, TB=tb, num_warps=1 if tb == 1 else 4,
        KV_OUT=bool(rows_out), **chain.launch(qkv, "rope"))
    return (q, kv[0], kv[1]) if rows_out else q


@triton.jit
def _silu_mul_kernel(GU, Out, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < n_cols
    g = tl.load(GU + row * 2 * n_cols + c, mask=m, other=0.0)
    u = tl.load(GU + row * 2 * n_cols + n_cols + c, mask=m, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(Out + row * n_cols + c, (a * u).to(g.dtype), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    N, two = gate_up.shape
    n = two // 2
    out = torch.empty(N, n, device=gate_up.device, dtype=gate_up.dtype)
    if N:
        _silu_mul_kernel[(N, triton.cdiv(n, 1024))](gate_up, out, n, BLOCK=1024, num_warps=4, **chain.launch(gate_up))
    return out
