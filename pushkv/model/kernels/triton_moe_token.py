"""A one-token step's mixture-of-experts MLP in one persistent launch (Triton): routing, gate/up and down.

At one token a layer's expert bytes (75 MB in Qwen3-30B-A3B, ~18 us at an H200's copy rate) are what the MLP must
cost, but the grouped kernels (``triton_moe``) spend three dependent launches on it: the routing (one program),
gate/up and down, each with its own ramp and drain. Here a fixed grid of programs, all resident at once (a few per
SM), does the whole MLP:

1. every program routes the token itself from its router logits (a few hundred bytes: softmax in float32, k rounds
   of the largest probability, the lowest expert on a tie, renormalised or not), as ``triton_moe`` routes;
2. gate/up: the k x ``inter / BN_UP`` column tiles dealt round-robin over the programs, each ``silu(gate) * up``
   of its columns as a GEMV over the token's row, stored in the slot's row of ``Act``;
3. a grid barrier (one counter: every program's stores published before it, visible after it);
4. down: the k x ``d / BN_DOWN`` column tiles dealt the same way, each its slot's expert's down projection of the
   slot's ``Act`` row, rounded, times the slot's weight, rounded, stored in the slot's row of the output. A
   program's first down tile is loaded before it waits at the barrier, so those bytes stream while the last
   gate/up tiles finish.

The output is the grouped kernels' per-slot [1, k, d] (``triton_fused.add_rms`` sums a token's slots in the next
residual add), rounded where they round: each projection, the SiLU, the product with the weight. The sums inside a
projection run in another order than their ``tl.dot``, so the two agree to rounding, not bit for bit.

The barrier needs every program resident: the grid is the SMs times the programs an SM holds at the kernel's
registers and shared memory (at most ``PER_SM``). Under Triton's interpreter, which runs programs one after
another, the two halves run as two launches instead (``PHASES``).

Off (``triton_moe.PERSISTENT_ONE_TOKEN``): on an H100 Qwen3-30B-A3B's batch-1 step took 3.66 ms with it against
3.38 with the grouped kernels (docs/results/2026-12-05-layer-floor). Its GEMV loads are not software-pipelined, so
each program holds one pass in flight, where the grouped kernels' ``tl.dot`` loads hold 3-5; the launches and the
routing it saves cost less than that. The same page's mock of the step says why a persistent kernel is not the way
to the step's bytes bound: with enough bytes in flight, chained kernels come within 1.5 % of one.
"""
from __future__ import annotations

import functools
import os

import torch

from pushkv.extras import missing

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:  # a CUDA torch build without Triton
    raise missing("triton", "pushkv's CUDA kernels") from e

from pushkv.model.kernels import chain
from pushkv.model.kernels.chain import wait_prior
from pushkv.model.kernels.triton_moe import _chosen_total, _probs, _take

# programs an SM at most (fewer where the kernel's registers or shared memory do not fit them)
PER_SM = 3
BN_UP = 16  # gate/up columns a tile: Qwen3-30B-A3B's 8 x 768 / 16 = 384 tiles
BK_UP = 512  # depth a pass of gate/up (2 x 16 x 512 weights: 32 KB of bf16 in flight a program)
BN_DOWN = 16  # down columns a tile: 8 x 2048 / 16 = 1,024 tiles of 16 x 768
WARPS = 4
RANK_EXPERTS = 128  # experts routed by rank (an [E, E] comparison a program) up to this many; by rounds past it


@triton.jit
def _choices(Logits, E, K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr, EP: tl.constexpr,
             BY_RANK: tl.constexpr):
    """The token's k choices, as ``triton_moe._route_tokens`` makes and stores them: experts [KP] int32 and
    weights [KP] float32 (each rounded to the logits' dtype, as the routing's table holds it).

    ``BY_RANK`` (up to ``RANK_EXPERTS`` experts): by rank, not by k rounds. Each expert's rank is the count of
    those ahead of it (a larger probability, or an equal one at a lower index: the rounds' order), one reduction
    over an [E, E] comparison, and slot j's expert the one of rank j. The rounds take two reductions each, across
    the program's warps, before any program may load a weight. The weights are the rounds' to the bit: the chosen
    probabilities summed in rank order."""
    t = tl.arange(0, 1)
    p, e = _probs(Logits, t, 1, E, 0, EP)
    j = tl.arange(0, KP)
    experts = tl.zeros((KP,), tl.int32)
    weights = tl.zeros((KP,), tl.float32)
    if BY_RANK:
        pr = tl.reshape(p, (EP,))
        ahead = (pr[None, :] > pr[:, None]) | ((pr[None, :] == pr[:, None]) & (e[None, :] < e[:, None]))
        rank = tl.sum(ahead.to(tl.int32), 1)  # [EP]: expert e's place
        hot = rank[None, :] == j[:, None]  # [KP, EP]: slot j's expert
        experts = tl.sum(tl.where(hot, e[None, :], 0), 1).to(tl.int32)
        chosen = tl.sum(tl.where(hot, pr[None, :], 0.0), 1)  # [KP]: slot j's probability
        total = 1.0
        if RENORM:
            total = 0.0
            for jj in tl.static_range(K):
                total += _at(chosen, jj, KP)
        weights = tl.where(j < K, (chosen / total).to(Logits.dtype.element_ty).to(tl.float32), 0.0)
    else:
        total = _chosen_total(p, e, K, RENORM, EP)
        left = p
        for jj in tl.static_range(K):
            best, pick, left = _take(left, e, EP)
            experts = tl.where(j == jj, tl.sum(pick, 0), experts)
            w = (best / total).to(Logits.dtype.element_ty).to(tl.float32)
            weights = tl.where(j == jj, tl.sum(w, 0), weights)
    return experts, weights


@triton.jit
def _at(vec, j, KP: tl.constexpr):
    """vec[j] of a [KP] vector."""
    return tl.sum(tl.where(tl.arange(0, KP) == j, vec, 0), 0)


@triton.jit
def _gate_up_tile(H, W, Act, experts, t, up_tiles, d, inter, stride_ge, stride_gn, KP: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr):
    j = t // up_tiles
    e = _at(experts, j, KP).to(tl.int64)
    cols = (t % up_tiles) * BN + tl.arange(0, BN)
    live = cols < inter
    kk = tl.arange(0, BK)
    base = W + e * stride_ge
    acc_g = tl.zeros((BN,), tl.float32)
    acc_u = tl.zeros((BN,), tl.float32)
    for k0 in range(0, d, BK):
        k = k0 + kk
        a = tl.load(H + k, mask=k < d, other=0.0).to(tl.float32)
        m = live[:, None] & (k[None, :] < d)
        wg = tl.load(base + cols[:, None] * stride_gn + k[None, :], mask=m, other=0.0)
        wu = tl.load(base + (cols[:, None] + inter) * stride_gn + k[None, :], mask=m, other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * a[None, :], 1)
        acc_u += tl.sum(wu.to(tl.float32) * a[None, :], 1)
    # the reference rounds each projection to the model dtype before SiLU and the product
    g = acc_g.to(Act.dtype.element_ty).to(tl.float32)
    u = acc_u.to(Act.dtype.element_ty).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(Act.dtype.element_ty).to(tl.float32) * u
    tl.store(Act + j * inter + cols, act.to(Act.dtype.element_ty), mask=live)


@triton.jit
def _down_weights(W, experts, t, d_tiles, d, inter, stride_de, stride_dn, K: tl.constexpr, KP: tl.constexpr,
                  BN: tl.constexpr, KD: tl.constexpr):
    """Down tile t's weights [BN, KD] (zeros past the last tile): no kernel writes them, so they may load early."""
    j = t // d_tiles
    e = _at(experts, j, KP).to(tl.int64)
    cols = (t % d_tiles) * BN + tl.arange(0, BN)
    kk = tl.arange(0, KD)
    live = (cols < d) & (j < K)
    return tl.load(W + e * stride_de + cols[:, None] * stride_dn + kk[None, :],
                   mask=live[:, None] & (kk[None, :] < inter), other=0.0)


@triton.jit
def _down_tile(Act, Out, w, weights, t, d_tiles, d, inter, KP: tl.constexpr, BN: tl.constexpr, KD: tl.constexpr):
    j = t // d_tiles
    cols = (t % d_tiles) * BN + tl.arange(0, BN)
    kk = tl.arange(0, KD)
    # the products are read from L2 (.cg): other programs of this launch wrote them
    a = tl.load(Act + j * inter + kk, mask=kk < inter, other=0.0, cache_modifier=".cg").to(tl.float32)
    y = tl.sum(w.to(tl.float32) * a[None, :], 1)
    # rounded as the grouped down kernel rounds: the projection, then its product with the weight
    y = y.to(Out.dtype.element_ty).to(tl.float32) * _at(weights, j, KP)
    tl.store(Out + j * d + cols, y.to(Out.dtype.element_ty), mask=cols < d)


@triton.jit
def _grid_barrier(Counters, nprog):
    """Every program's stores before it visible to every program after it. Counters [2] int32, zero: arrivals and
    departures; the last to leave zeroes both (the kernel boundary orders that for the next launch)."""
    # every thread's stores issued before the one atomic (thread 0's, its result broadcast), whose release
    # publishes them
    tl.debug_barrier()
    tl.atomic_add(Counters, 1, sem="release")
    seen = tl.atomic_add(Counters, 0, sem="acquire")
    while seen < nprog:
        seen = tl.atomic_add(Counters, 0, sem="acquire")
    tl.debug_barrier()
    if tl.atomic_add(Counters + 1, 1, sem="relaxed") == nprog - 1:
        tl.atomic_xchg(Counters, 0, sem="relaxed")
        tl.atomic_xchg(Counters + 1, 0, sem="relaxed")


@triton.jit
def _moe_token_kernel(H, Logits, Wgu, Wd, Act, Out, Counters, E, d, inter, stride_ge, stride_gn, stride_de,
                      stride_dn, K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr, EP: tl.constexpr,
                      BN_UP: tl.constexpr, BK_UP: tl.constexpr, BN_DOWN: tl.constexpr, KD: tl.constexpr,
                      BY_RANK: tl.constexpr, PHASES: tl.constexpr, PDL: tl.constexpr):
    """PHASES 3: the whole MLP with a grid barrier between gate/up and down; 1 or 2: one half (the interpreter's
    two launches)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    wait_prior(PDL)
    experts, weights = _choices(Logits, E, K, KP, RENORM, EP, BY_RANK)
    if PHASES % 2 == 1:
        up_tiles = tl.cdiv(inter, BN_UP)
        for t in range(pid, K * up_tiles, nprog):
            _gate_up_tile(H, Wgu, Act, experts, t, up_tiles, d, inter, stride_ge, stride_gn, KP, BN_UP, BK_UP)
    if PHASES >= 2:
        d_tiles = tl.cdiv(d, BN_DOWN)
        n = K * d_tiles
        w = _down_weights(Wd, experts, pid, d_tiles, d, inter, stride_de, stride_dn, K, KP, BN_DOWN, KD)
        if PHASES == 3:
            _grid_barrier(Counters, nprog)
        for t in range(pid, n, nprog):
            _down_tile(Act, Out, w, weights, t, d_tiles, d, inter, KP, BN_DOWN, KD)
            w = _down_weights(Wd, experts, t + nprog, d_tiles, d, inter, stride_de, stride_dn, K, KP, BN_DOWN,
                              KD)


_COUNTERS: dict[str, torch.Tensor] = {}


def counters(dev: torch.device) -> torch.Tensor:
    """The barrier's counters on ``dev``: zero, and each launch leaves them zero, so one buffer serves every layer,
    step and graph replay (a device's steps run one at a time, on the worker's one stream). The batched forward
    makes them before any graph capture (so no capture holds a memset of them)."""
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = str(dev)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=dev)
    return _COUNTERS[key]


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def resident(n_regs: int, shared: int, warps: int, index: int) -> int:
    """Programs of a kernel an SM holds at once, from its registers a thread and shared memory a program."""
    props = torch.cuda.get_device_properties(index)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_regs = regs // max(1, n_regs * 32 * warps)
    by_smem = smem // shared if shared else PER_SM
    return max(1, min(PER_SM, by_regs, by_smem))


_GRID: dict[tuple, int] = {}


def moe_token(h: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int,
              renorm: bool, programs: int = 0) -> torch.Tensor:
    """One token's MoE MLP per slot, [1, k, d] (its k experts' outputs, weighted, not summed): h [1, d] (normed,
    contiguous), logits [1, E] (the router's), gate_up [E, 2 i, d], down [E, d, i], contiguous. ``programs``: the
    grid (default: every SM's resident programs; under the interpreter, 4)."""
    T, d = h.shape
    if T != 1:
        raise ValueError(f"moe_token serves one token, not {T}")
    E, two_i, _ = gate_up.shape
    inter = two_i // 2
    act = torch.empty((k, inter), dtype=h.dtype, device=h.device)
    out = torch.empty((1, k, d), dtype=h.dtype, device=h.device)
    kp = triton.next_power_of_2(k)
    args = (h, logits, gate_up, down, act, out, None, E, d, inter, gate_up.stride(0), gate_up.stride(1),
            down.stride(0), down.stride(1))
    ep = triton.next_power_of_2(E)
    meta = dict(K=k, KP=kp, RENORM=renorm, EP=ep, BY_RANK=ep <= RANK_EXPERTS, BN_UP=BN_UP, BK_UP=BK_UP,
                BN_DOWN=BN_DOWN, KD=triton.next_power_of_2(inter), num_warps=WARPS)
    if _interpreted() or h.device.type != "cuda":
        grid = (programs or 4,)
        for phases in (1, 2):  # the interpreter runs programs one after another: no barrier can wait for the rest
            _moe_token_kernel[grid](*args[:6], out, *args[7:], PHASES=phases, PDL=False, **meta)
        return out
    index = h.device.index if h.device.index is not None else torch.cuda.current_device()
    launch = chain.launch(h)
    key = (index, h.dtype, k, kp, E, d, inter, renorm)
    if not programs:
        programs = _GRID.get(key, 0)
    if not programs:  # compiled once for its registers and shared memory, then the grid they allow
        compiled = _moe_token_kernel.warmup(*args[:6], counters(h.device), *args[7:], PHASES=3, grid=(1,),
                                            **meta, **launch)
        compiled._init_handles()  # (Triton 3.6 reads the registers a thread at the binary's load)
        programs = _sms(index) * resident(getattr(compiled, "n_regs", 0) or 255, compiled.metadata.shared, WARPS,
                                          index)
        _GRID[key] = programs
    _moe_token_kernel[(programs,)](*args[:6], counters(h.device), *args[7:], PHASES=3, **meta, **launch)
    return out
