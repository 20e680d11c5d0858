"""A head's q/k RMS norm (Qwen3) and rotate-half RoPE on halves of its rows, as one Triton function that the
RoPE-and-store kernel (``triton_fused.qk_norm_rope_store``) and the decode attention that does the same itself
(``triton_paged``, ``ROPE_IN_ATTENTION``) both call, so the two give the same bits: the same operations in the same
order, rounded where the reference rounds."""
from __future__ import annotations

from pushkv.extras import missing

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:  # a CUDA torch build without Triton
    raise missing("triton", "pushkv's CUDA kernels") from e


@triton.jit
def norm_rope(x1, x2, w1, w2, c, s, eps, P, HAS_NORM: tl.constexpr, D: tl.constexpr):
    """(o1, o2) float32 [R, D/2]: rows' first and second halves x1, x2 (float32, [R, D/2]) normed (with
    ``HAS_NORM``: RMS over the D of each row, rounded to P's element type, times the weight halves w1, w2 [D/2]
    float32, rounded again) and rotated by c, s [R, D/2] (float32): x1 c - x2 s and x2 c + x1 s."""
    if HAS_NORM:
        dt = P.dtype.element_ty
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)
        x1 = (x1 * r[:, None]).to(dt).to(tl.float32) * w1[None, :]
        x2 = (x2 * r[:, None]).to(dt).to(tl.float32) * w2[None, :]
        x1 = x1.to(dt).to(tl.float32)
        x2 = x2.to(dt).to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s
