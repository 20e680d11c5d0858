"""Programmatic dependent launch (Hopper and later) for the Triton kernels of a step.

A decode step of one sequence is ~10 launches a layer of a few microseconds each, and between two of
them the GPU idles while the first drains and the second is scheduled. Launched with
``launch_pdl``, a kernel's programs may be scheduled once every program of the kernel before it has
started (``gdc_launch_dependents``); each program first waits in ``gdc_wait`` until that kernel has
finished and its writes are visible, so no load or store of it runs early. The overlap is the
launch and scheduling, not the work. A kernel after a launch without the option (cuBLAS) waits for
it as before, and a graph capture keeps the option as a programmatic edge.

Each kernel takes ``PDL`` (a constexpr) and calls ``wait_prior(PDL)`` first; its caller passes
``**chain.launch(tensor)``. Off under Triton's interpreter, off the GPU, below compute capability 9,
and while ``ON`` is False. On by default: on an H200 a Qwen3-30B-A3B decode step of one sequence took
3.79 ms unchained and 3.66 chained, the same bits (experiments/moe_decode_probe.py,
docs/results/2026-12-04-moe-decode). Only that probe turns it off, to time the step without it.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ON = True
# the kernels (by the names their callers give ``launch``) that let the next kernel's programs be scheduled as
# soon as their own have all started, before they wait, not after: the next kernel's programs then do what they do
# before their own wait (a GEMV loads its weights, the decode attention asks for its first key tile) while this
# kernel still waits and runs, not only while it runs. The next kernel still waits for this one to finish (its
# ``gdc_wait`` waits for the whole grid before it and its writes), so no value changes: only when programs are
# scheduled. The decode attention and its merge: on an H100 Qwen3-30B-A3B's batch-1 decode step went 3.336 ->
# 3.259 ms (-2.3 %; 3.346 -> 3.276 in a first run) and batch 8 stayed (10.61), the same bits, as the o GEMV's
# weights load during the attention. The layer's first norm so (for the qkv GEMV, whose weights then load during
# the experts' down projection) was 0.5 % slower, every kernel so 1.1-1.6 % faster than none, 0.7 % slower than
# these two (experiments/moe_decode_probe.py, variants ``early_*``; docs/results/2026-12-05-early-next)
EARLY_NEXT: frozenset[str] = frozenset({"attn", "merge"})
# the names ``launch`` takes, one a kernel of a step's chain
NAMES = frozenset({"add_rms", "rope", "attn", "merge", "gemv", "norm_router", "route", "gate_up", "down"})


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    return (ON and device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and _capable(device.index if device.index is not None else torch.cuda.current_device()))


def launch(t: torch.Tensor, name: str = "") -> dict:
    """A kernel's launch arguments for a step on t's device: ``PDL`` and, where on, ``launch_pdl``, and
    ``NEXT_EARLY`` where ``name`` (one of ``NAMES``; a kernel that takes it) is in ``EARLY_NEXT``."""
    if name and name not in NAMES:
        raise ValueError(f"chain.launch: unknown kernel name {name!r} (one of {sorted(NAMES)})")
    if not enabled(t.device):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True, **({"NEXT_EARLY": True} if name in EARLY_NEXT else {})}


@triton.jit
def wait_prior(PDL: tl.constexpr, NEXT_EARLY: tl.constexpr = False):
    """Wait for the kernel before this one (its writes visible), then let the next one be scheduled; with
    ``NEXT_EARLY`` let it be scheduled first, then wait."""
    if PDL:
        if NEXT_EARLY:
            gdc_launch_dependents()
            gdc_wait()
        else:
            gdc_wait()
            gdc_launch_dependents()
