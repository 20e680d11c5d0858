"""Asking L2 for bytes a later phase of a step will read (Triton, sm_80 and later).

At one token an MoE layer's bytes are its chosen experts' weights, and its two projections run one after the
other: gate/up (two thirds of the bytes) and then down. On an H200 the one-token gate/up draws about 70 % of the
HBM rate (docs/results/2026-12-04-moe-decode), so while it runs about a third of the bandwidth is idle, and down
starts from HBM only after it. A ``prefetch.global.L2::evict_last`` names a 128-byte line for L2 to fetch: no
register holds it and nothing waits for it, so the program that asks goes on at once. The gate/up programs ask
for the down weights of their expert (they know it once routed), and the down projection, a launch later or a
phase later, finds them in L2 (50 MB on an H200, against 25 MB of down weights a Qwen3-30B-A3B layer).

The same request serves a step's dense weights: :func:`ahead` is a launch of its own in a chained step
(``kernels/chain.py``) that asks L2 for a weight matrix while the kernels before it run, for a kernel after it.
At one token the attention and its merge move about a megabyte in several microseconds, so the o projection's
17 MB can come in then (``batched.AHEAD``).

A prefetch changes no bits: it moves bytes between memories, never a value. It is PTX, which Triton's
interpreter cannot run, so :func:`enabled` is False there and off the GPU.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pushkv.model.kernels import chain

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
def _l2_evict_last(ptrs, ok):
    """Ask L2 for the lines at ptrs where ok, to be kept ahead of streamed lines (a predicated prefetch: no line
    is asked twice, none past the data)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; } "
                              "mov.u32 $0, 0;", "=r,l,r", [ptrs, ok.to(tl.int32)], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def l2_lines(ptrs, ok):
    """Ask L2 for the lines at ptrs where ok, at the normal priority."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; } mov.u32 $0, 0;",
                              "=r,l,r", [ptrs, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def row_lines(row_elems: int, itemsize: int) -> tuple[int, int]:
    """(LPR, LINE) for :func:`l2_rows`: the lines a row of ``row_elems`` elements spans, rounded up to a power of
    two, and the elements a line holds."""
    line = LINE_BYTES // itemsize
    return triton.next_power_of_2(max(1, -(-row_elems // line))), line


@triton.jit
def l2_rows(Base, rows, stride, row_elems, LPR: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for whole rows of a row-major matrix at ``Base`` (``rows`` a vector of row indices, each of
    ``row_elems`` elements ``stride`` apart), at the normal eviction priority: a program's own tile, asked for all
    at once before its loads go through the pipeline, so that the HBM sees every request of the tile at the start
    instead of a few stages' worth at a time. No line past a row's end is asked for, nor any of a row index < 0
    (a tile's rows past the matrix)."""
    offs = tl.arange(0, LPR).to(tl.int64) * LINE
    ok = (offs[None, :] < row_elems) & (rows[:, None] >= 0)
    l2_lines(Base + tl.maximum(rows, 0)[:, None].to(tl.int64) * stride + offs[None, :], ok)


@triton.jit
def l2_share(Base, elems, share, shares, LINES: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for the ``share``-th of ``shares`` equal parts of the ``elems`` contiguous elements at ``Base``
    (kept there ahead of streamed lines: evict_last). No line past the part's end is asked for."""
    per = tl.cdiv(elems, shares)
    first = share.to(tl.int64) * per
    offs = first + tl.arange(0, LINES).to(tl.int64) * LINE
    _l2_evict_last(Base + offs, offs < tl.minimum(first + per, elems))


@triton.jit
def _ahead_kernel(W, elems, LINES: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr):
    """A share of W's lines asked of L2, in a chained step: the next kernel may be scheduled at once (it waits
    for this one, which waits for the one before, so the chain's order holds), the lines are asked for before
    the wait (W is no kernel's output), and the program ends once the kernel before has."""
    if PDL:
        gdc_launch_dependents()
    l2_share(W, elems, tl.program_id(0), tl.num_programs(0), LINES, LINE)
    if PDL:
        gdc_wait()


# programs of an ahead launch: one an SM (an H200's 132), of 4 warps, each a few prefetches a thread
AHEAD_WARPS = 4


def ahead(w: torch.Tensor, programs: int) -> None:
    """Ask L2 for w (contiguous) in a launch of ``programs`` programs, where it helps: in a chained step on the GPU
    (without chaining it would run alone between two kernels, and only cost). Nothing else changes."""
    if not (enabled(w) and chain.enabled(w.device) and w.is_contiguous()):
        return
    lines, line = lines_for(w.numel(), programs, w.element_size())
    _ahead_kernel[(programs,)](w, w.numel(), LINES=lines, LINE=line, num_warps=AHEAD_WARPS, **chain.launch(w))
