"""Asking L2 for bytes a later phase of a step will read (Triton, sm_80 and later).

At one token an MoE layer's bytes are its chosen experts' weights, and its two projections run one after the
other: gate/up (two thirds of the bytes) and then down. On an H200 the one-token gate/up draws about 70 % of the
HBM rate (docs/results/2026-12-04-moe-decode), so while it runs about a third of the bandwidth is idle, and down
starts from HBM only after it. A ``prefetch.global.L2::evict_last`` names a 128-byte line for L2 to fetch: no
register holds it and nothing waits for it, so the program that asks goes on at once. The gate/up programs ask
for the down weights of their expert (they know it once routed), and the down projection, a launch later or a
phase later, finds them in L2 (50 MB on an H200, against 25 MB of down weights a Qwen3-30B-A3B layer).

A prefetch changes no bits: it moves bytes between memories, never a value. It is PTX, which Triton's
interpreter cannot run, so :func:`enabled` is False there and off the GPU.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# a line of L2: what one prefetch asks for
LINE_BYTES = 128


def enabled(t: torch.Tensor) -> bool:
    """Whether a kernel on t's device may prefetch: a CUDA tensor, outside Triton's interpreter."""
    return t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def lines_for(elems: int, shares: int, itemsize: int) -> tuple[int, int]:
    """(LINES, LINE) for :func:`l2_share`: the lines one of ``shares`` equal parts of ``elems`` elements spans,
    rounded up to a power of two, and the elements a line holds."""
    line = LINE_BYTES // itemsize
    per = -(-elems // shares)
    return triton.next_power_of_2(max(1, -(-per // line))), line


@triton.jit
def _l2_evict_last(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_share(Base, elems, share, shares, LINES: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for the ``share``-th of ``shares`` equal parts of the ``elems`` contiguous elements at ``Base``
    (kept there ahead of streamed lines: evict_last). Lines past the part's end ask for its last one again."""
    per = tl.cdiv(elems, shares)
    first = share.to(tl.int64) * per
    last = tl.minimum(first + per, elems) - 1
    _l2_evict_last(Base + tl.minimum(first + tl.arange(0, LINES).to(tl.int64) * LINE, last))
