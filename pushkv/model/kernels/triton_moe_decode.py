"""The mixture-of-experts MLP of a decode step (a few tokens) on the GPU (Triton), in three launches
and without grouping the slots by expert. Equals ``pushkv.model.moe.moe_mlp`` (the torch reference);
``triton_moe.moe_mlp`` sends a step of up to ``DECODE_TOKENS`` tokens here.

At one token a layer's bytes are its 8 chosen experts' weights (75 MB in Qwen3-30B-A3B, ~18 us at
the H200's HBM rate), so a launch, a serial phase or an idle SM is as dear as the bytes. The grouped
path (``triton_moe``) pays five launches, one of them a single program that routes and groups
(7.5 us for one token), pads each expert's rows to a 16-row ``tl.dot`` and sums a token's slots in a
sixth step. Here:

- ``_router_kernel``: the router's logits as a GEMV, one program per (block of ``be`` experts,
  token), rounded to the model dtype as the reference's ``F.linear`` rounds them (``be = 0``: torch's
  ``F.linear`` instead; moe_bench sweeps both);
- ``_gate_up_kernel``: one program per (slot, column tile), where slot = (token, k-th choice): it
  routes its token itself (softmax in float32, k rounds of the largest probability, the lowest expert
  on a tie, one reduction a round; renormalised or not) from the token's E logits, a few hundred
  bytes, and keeps its own pick; then ``silu(gate) * up`` for its columns as a GEMV over the one
  token row. The programs of column tile 0 store the routing for the next launch. Programs are
  numbered slot-fastest, so the slots of one column tile run together and a second token that chose
  the same expert finds its tile in L2;
- ``_down_kernel``: one program per (token, column tile of the hidden size): the token's k slots in
  order j = 0..k-1, each its expert's down projection (rounded), times its weight (rounded), summed
  in float32 and rounded once. No atomics and no per-slot buffer: a token's bits depend on its own
  row and the tiles only, never on the run or (with the router's own kernel, ``be > 0``) the batch.

With ``ONE_LAUNCH`` the two run as one launch (``_one_launch_kernel``): the programs take their parts by ticket
in the order they start, and a token's down programs wait on a counter for its gate/up programs. With
``PREFETCH_DOWN`` the gate/up programs ask L2 for their experts' down weights, and with ``PREFETCH_OWN`` each
program asks for its own tile first (kernels/prefetch.py). All three give the same bits and are off until a GPU
has timed them (experiments/moe_decode_probe.py).

Rounding points are the reference's (each projection, the SiLU, each slot times its weight); the sum
of a token's slots runs in float32 where the reference adds in the model dtype, as the grouped path's
torch sum does. Nothing waits for the host: the decode step's CUDA graph captures the three launches.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pushkv.extras import missing

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:  # a CUDA torch build without Triton
    raise missing("triton", "pushkv's CUDA kernels") from e

from pushkv.model.kernels import chain, prefetch
from pushkv.model.kernels.chain import wait_prior
from pushkv.model.kernels.prefetch import l2_rows, l2_share

# Steps of up to this many tokens take these kernels (a decode graph bucket bound, so a step runs
# the same path replayed or eager); longer ones group the slots by expert (triton_moe)
DECODE_TOKENS = 8

# gate/up and down in one launch (``_one_launch_kernel``): a token's down programs wait for its gate/up programs
# on a counter, not at a kernel boundary; the same bits as the two launches. Off until
# experiments/moe_decode_probe.py (variants ``one_launch*``) has timed it on a GPU
ONE_LAUNCH = False
# the gate/up programs ask L2 for their experts' down weights, which the down programs read next
# (kernels/prefetch.py); the same bits. Off until the probe (variants ``*_prefetch``) has timed it
PREFETCH_DOWN = False
# each gate/up program asks L2 for its own rows, and each down program for its rows of all k experts, at once
# before its loads (which otherwise go a BK chunk and an expert at a time: a down program's 3 x k rounds one
# after another); the same bits. Off until the probe (variants ``*_own``) has timed it
PREFETCH_OWN = False

# a waiting down program's pause between two reads of its counter (ns; PTX nanosleep, so the GPU only)
SPIN_NS = 200

_COUNTERS: dict[str, torch.Tensor] = {}


def counters(dev: torch.device, tokens: int = 1) -> torch.Tensor:
    """``_one_launch_kernel``'s counters on ``dev`` for a step of up to ``DECODE_TOKENS`` tokens: zero, and each
    launch leaves them zero, so one buffer serves every layer, step and graph replay. A device's decode steps run
    one at a time (the worker's one stream), so its launches never share the buffer at once. Made on first use;
    the batched forward makes it at its start, so that no graph capture makes it (a memset in the graph)."""
    if tokens > DECODE_TOKENS:
        raise ValueError(f"one launch serves at most {DECODE_TOKENS} tokens, not {tokens}")
    if dev.type == "cuda" and dev.index is None:  # a tensor's device names its index
        dev = torch.device("cuda", torch.cuda.current_device())
    key = str(dev)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(2 + DECODE_TOKENS, dtype=torch.int32, device=dev)
    return _COUNTERS[key]


class DecodeTiles(NamedTuple):
    """A decode launch's tiles: gate/up columns and depth; down columns and depth; router experts a
    program (0: torch's F.linear); warps; stages (kept for the launch, though Triton software-pipelines
    only loads that feed a ``tl.dot``, and these kernels have none)."""

    bn_up: int
    bk_up: int
    bn_down: int
    bk_down: int
    be: int
    warps: int = 4
    stages: int = 3


def decode_tiles_for(tokens: int) -> DecodeTiles:
    """Grids that spread a step's bytes over >= 2 x the H200's 132 SMs at one token (Qwen3-30B-A3B: E =
    128, k = 8, hidden 2048, expert intermediate 768): gate/up 8 slots x 768 / 16 = 384 programs of 2
    x 16 rows x 2048 (128 KB each; 3,072 at eight tokens); down 1 token x 2048 / 4 = 512 programs of 8
    experts x 4 rows x 768 (48 KB each; 4,096 at eight tokens); the router 128 / 2 = 64 programs x
    tokens of 8 KB (0.5 MB: its bytes are 1 % of the step's). moe_bench sweeps the alternatives."""
    return DecodeTiles(16, 256, 4, 256, 2)


@triton.jit
def _router_kernel(H, R, Logits, E, d, stride_h, stride_r, stride_l, BE: tl.constexpr, BK: tl.constexpr,
                   PDL: tl.constexpr):
    wait_prior(PDL)
    t = tl.program_id(1).to(tl.int64)
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    kk = tl.arange(0, BK)
    acc = tl.zeros((BE, BK), dtype=tl.float32)
    for k0 in range(0, d, BK):
        k = k0 + kk
        a = tl.load(H + t * stride_h + k, mask=k < d, other=0.0).to(tl.float32)
        w = tl.load(R + e[:, None].to(tl.int64) * stride_r + k[None, :], mask=(e[:, None] < E) & (k[None, :] < d),
                    other=0.0).to(tl.float32)
        acc += w * a[None, :]
    tl.store(Logits + t * stride_l + e, tl.sum(acc, 1).to(Logits.dtype.element_ty), mask=e < E)


@triton.jit
def _pick(Logits, t, j, E, stride_l, K: tl.constexpr, RENORM: tl.constexpr, EP: tl.constexpr):
    """(expert, weight in float32) of token t's j-th choice: the reference's softmax, top-k (the
    lowest expert on a tie) and renormalisation over the k chosen. Each round is one reduction, over
    keys that order as the probabilities do and then by the lower expert: a probability's float32
    bits (it is >= 0, so they order as it does) above the expert's index counted down."""
    e = tl.arange(0, EP)
    x = tl.load(Logits + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (EP - 1 - e)
    key = tl.where(e < E, key, -1)
    total = 0.0
    mine_e = 0
    mine_p = 0.0
    for r in tl.static_range(K):
        best = tl.max(key, 0)
        pick = EP - 1 - best.to(tl.int32)  # the low 32 bits
        prob = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        key = tl.where(e == pick, -1, key)
        total += prob
        mine_e = tl.where(j == r, pick, mine_e)
        mine_p = tl.where(j == r, prob, mine_p)
    if RENORM:
        mine_p = mine_p / total
    return mine_e, mine_p


@triton.jit
def _gate_up_tile(H, Logits, W, Act, Weights, Experts, D, s, c, E, d, inter, stride_h, stride_l, stride_we, stride_wn,
                  stride_act, stride_de, down_elems, shares, K: tl.constexpr, RENORM: tl.constexpr, EP: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, LINES: tl.constexpr,
                  LINE: tl.constexpr, OWN: tl.constexpr, LPR: tl.constexpr):
    """Slot s's column tile c: its routing (stored by tile 0), ``silu(gate) * up`` for BN columns; with ``OWN``
    its own rows asked of L2 first, with ``PREFETCH`` its share (c of ``shares``) of its expert's down weights."""
    t = s // K
    e, wt = _pick(Logits, t, s % K, E, stride_l, K, RENORM, EP)
    if c == 0:  # the routing, once, for the down projection
        tl.store(Weights + s, wt.to(Weights.dtype.element_ty))
        tl.store(Experts + s, e)
    if OWN:  # its own gate and up rows, every line asked of L2 at once (PREFETCH_OWN)
        own = c * BN + tl.arange(0, BN)
        l2_rows(W + e.to(tl.int64) * stride_we, tl.where(own < inter, own, -1), stride_wn, d, LPR, LINE)
        l2_rows(W + e.to(tl.int64) * stride_we, tl.where(own < inter, own + inter, -1), stride_wn, d, LPR, LINE)
    if PREFETCH:  # for the down projection, which reads it next (kernels/prefetch.py)
        l2_share(D + e.to(tl.int64) * stride_de, down_elems, c, shares, LINES, LINE)
    evict: tl.constexpr = "evict_first" if PREFETCH else ""  # read once: leaves L2 before the down weights
    cols = c * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc_g = tl.zeros((BN, BK), dtype=tl.float32)
    acc_u = tl.zeros((BN, BK), dtype=tl.float32)
    w_base = W + e.to(tl.int64) * stride_we
    h_base = H + t.to(tl.int64) * stride_h
    for k0 in range(0, d, BK):
        k = k0 + kk
        a = tl.load(h_base + k, mask=k < d, other=0.0).to(tl.float32)
        wmask = (cols[:, None] < inter) & (k[None, :] < d)
        wg = tl.load(w_base + cols[:, None] * stride_wn + k[None, :], mask=wmask, other=0.0, eviction_policy=evict)
        wu = tl.load(w_base + (cols[:, None] + inter) * stride_wn + k[None, :], mask=wmask, other=0.0,
                     eviction_policy=evict)
        acc_g += wg.to(tl.float32) * a[None, :]
        acc_u += wu.to(tl.float32) * a[None, :]
    # the reference rounds each projection to the model dtype before SiLU and the product
    g = tl.sum(acc_g, 1).to(Act.dtype.element_ty).to(tl.float32)
    u = tl.sum(acc_u, 1).to(Act.dtype.element_ty).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(Act.dtype.element_ty).to(tl.float32) * u
    tl.store(Act + s.to(tl.int64) * stride_act + cols, act.to(Act.dtype.element_ty), mask=cols < inter)


@triton.jit
def _down_tile(Act, W, Weights, Experts, Out, t, c, d, inter, stride_act, stride_we, stride_wn, stride_out,
               K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, OWN: tl.constexpr, LPR: tl.constexpr,
               LINE: tl.constexpr):
    """Token t's column tile c of the hidden size: its k slots in order, each its expert's down projection
    (rounded) times its weight (rounded), summed in float32 and rounded once. The products are read from L2
    (``.cg``): in one launch (``_one_launch_kernel``) other programs wrote them during this kernel."""
    t = t.to(tl.int64)
    cols = c * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    out = tl.zeros((BN,), dtype=tl.float32)
    if OWN:  # its rows of all k experts asked of L2 at once, not one expert's after the last's (PREFETCH_OWN)
        own = tl.where(cols < d, cols, -1)
        for j in tl.static_range(K):
            e = tl.load(Experts + t * K + j, cache_modifier=".cg").to(tl.int64)
            l2_rows(W + e * stride_we, own, stride_wn, inter, LPR, LINE)
    for j in range(K):  # a token's slots in a fixed order: the sum is the same bits every run
        s = t * K + j
        e = tl.load(Experts + s, cache_modifier=".cg").to(tl.int64)
        wt = tl.load(Weights + s, cache_modifier=".cg").to(tl.float32)
        w_base = W + e * stride_we
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, inter, BK):
            k = k0 + kk
            a = tl.load(Act + s * stride_act + k, mask=k < inter, other=0.0, cache_modifier=".cg").to(tl.float32)
            w = tl.load(w_base + cols[:, None] * stride_wn + k[None, :],
                        mask=(cols[:, None] < d) & (k[None, :] < inter), other=0.0)
            acc += w.to(tl.float32) * a[None, :]
        y = tl.sum(acc, 1).to(Out.dtype.element_ty).to(tl.float32) * wt
        out += y.to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + t * stride_out + cols, out.to(Out.dtype.element_ty), mask=cols < d)


@triton.jit
def _gate_up_kernel(H, Logits, W, Act, Weights, Experts, D, E, d, inter, stride_h, stride_l, stride_we, stride_wn,
                    stride_act, stride_de, down_elems, K: tl.constexpr, RENORM: tl.constexpr, EP: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = False,
                    LINES: tl.constexpr = 1, LINE: tl.constexpr = 64, OWN: tl.constexpr = False,
                    LPR: tl.constexpr = 1):
    wait_prior(PDL)
    _gate_up_tile(H, Logits, W, Act, Weights, Experts, D, tl.program_id(0), tl.program_id(1), E, d, inter, stride_h,
                  stride_l, stride_we, stride_wn, stride_act, stride_de, down_elems, tl.num_programs(1), K, RENORM,
                  EP, BN, BK, PREFETCH, LINES, LINE, OWN, LPR)


@triton.jit
def _down_kernel(Act, W, Weights, Experts, Out, d, inter, stride_act, stride_we, stride_wn, stride_out,
                 K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, OWN: tl.constexpr = False,
                 LPR: tl.constexpr = 1, LINE: tl.constexpr = 64):
    wait_prior(PDL)
    _down_tile(Act, W, Weights, Experts, Out, tl.program_id(0), tl.program_id(1), d, inter, stride_act, stride_we,
               stride_wn, stride_out, K, BN, BK, OWN, LPR, LINE)


@triton.jit
def _pause(x, NS: tl.constexpr):
    """x, after ``nanosleep`` for about NS ns where NS > 0 (PTX: the GPU only; 0 under the interpreter)."""
    if NS > 0:
        x = tl.inline_asm_elementwise(f"nanosleep.u32 {NS}; mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                      is_pure=False, pack=1)
    return x


@triton.jit
def _one_launch_kernel(H, Logits, W, Act, Weights, Experts, D, Out, Counters, T, E, d, inter, stride_h, stride_l,
                       stride_we, stride_wn, stride_act, stride_de, stride_dn, stride_out, down_elems,
                       K: tl.constexpr, RENORM: tl.constexpr, EP: tl.constexpr, BN_UP: tl.constexpr,
                       BK_UP: tl.constexpr, BN_DOWN: tl.constexpr, BK_DOWN: tl.constexpr, PDL: tl.constexpr,
                       PREFETCH: tl.constexpr = False, LINES: tl.constexpr = 1, LINE: tl.constexpr = 64,
                       OWN: tl.constexpr = False, LPR_UP: tl.constexpr = 1, LPR_DOWN: tl.constexpr = 1,
                       SPIN_NS: tl.constexpr = 0):
    """``_gate_up_kernel`` and ``_down_kernel`` in one launch: the first T k x up-tiles programs (in the order
    they start) are gate/up's, the rest down's, and a token's down programs wait for its gate/up ones on a
    counter instead of at a kernel boundary. Counters [2 + T] int32, zero: the ticket (the order programs
    start in), the down programs finished, and each token's gate/up tiles done. The last down program leaves
    them zero for the next launch."""
    wait_prior(PDL)
    # a program's work follows the order programs start in, not its id: a down program waits only for gate/up
    # programs, which took their tickets before it and so are running; no wait can hold an unscheduled program
    ticket = tl.atomic_add(Counters, 1, sem="relaxed")
    up_tiles = tl.cdiv(inter, BN_UP)
    n = T * K
    if ticket < n * up_tiles:
        s = ticket % n  # slot-fastest, as _gate_up_kernel's grid
        _gate_up_tile(H, Logits, W, Act, Weights, Experts, D, s, ticket // n, E, d, inter, stride_h, stride_l,
                      stride_we, stride_wn, stride_act, stride_de, down_elems, up_tiles, K, RENORM, EP, BN_UP,
                      BK_UP, PREFETCH, LINES, LINE, OWN, LPR_UP)
        # every thread's stores issued before the one release that publishes them
        tl.debug_barrier()
        tl.atomic_add(Counters + 2 + s // K, 1, sem="release")
    else:
        i = ticket - n * up_tiles
        t = i % T
        ready = Counters + 2 + t
        seen = 0
        while seen < K * up_tiles:
            # a plain read while waiting (no atomic traffic), each warp's one request to the line, and on the GPU a
            # pause between reads: hundreds of waiting warps would otherwise keep the counter's L2 slice busy while
            # gate/up's weights stream through it
            while _pause(tl.load(ready, volatile=True), SPIN_NS) < K * up_tiles:
                pass
            # then one acquire, which makes the gate/up programs' stores visible from here on (its result is used:
            # Triton drops an atomic whose result is not)
            seen = tl.atomic_add(ready, 0, sem="acquire")
        tl.debug_barrier()
        _down_tile(Act, D, Weights, Experts, Out, t, i // T, d, inter, stride_act, stride_de, stride_dn,
                   stride_out, K, BN_DOWN, BK_DOWN, OWN, LPR_DOWN, LINE)
        down_programs = T * tl.cdiv(d, BN_DOWN)
        if tl.atomic_add(Counters + 1, 1, sem="relaxed") == down_programs - 1:
            # the last: every program took its ticket and every gate/up count is in, so the counters may go back
            # to zero (the kernel boundary orders this for the next launch)
            for z in range(2 + T):
                tl.atomic_xchg(Counters + z, 0, sem="relaxed")


def router_logits(h: torch.Tensor, router: torch.Tensor, be: int, bk: int = 256) -> torch.Tensor:
    """h [T, d], router [E, d] -> logits [T, E] in h's dtype; ``be`` experts a program (0: F.linear)."""
    if be == 0:
        return F.linear(h, router)
    T, d = h.shape
    E = router.shape[0]
    logits = torch.empty((T, E), dtype=h.dtype, device=h.device)
    _router_kernel[(triton.cdiv(E, be), T)](h, router, logits, E, d, h.stride(0), router.stride(0), logits.stride(0),
                                            BE=be, BK=bk, **chain.launch(h))
    return logits


def moe_mlp_decode(h: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int,
                   renorm: bool, tiles: DecodeTiles, logits: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output [T, d], routing weights [T, k] in h's dtype, expert ids [T, k] int32) of the MoE MLP; h
    [T, d] contiguous (normed), router [E, d], gate_up [E, 2 i, d], down [E, d, i], all contiguous;
    ``logits`` the router's [T, E] where the caller has them."""
    T, d = h.shape
    E, two_i, _ = gate_up.shape
    inter = two_i // 2
    n = T * k
    dev = h.device
    if logits is None:
        logits = router_logits(h, router, tiles.be)
    weights = torch.empty((T, k), dtype=h.dtype, device=dev)
    experts = torch.empty((T, k), dtype=torch.int32, device=dev)
    act = torch.empty((n, inter), dtype=h.dtype, device=dev)
    out = torch.empty_like(h)
    up_tiles, down_tiles = triton.cdiv(inter, tiles.bn_up), triton.cdiv(d, tiles.bn_down)
    gpu = prefetch.enabled(h)  # the prefetches and the pause are PTX: the GPU only
    lines, line = prefetch.lines_for(down[0].numel(), up_tiles, down.element_size())
    lpr_up, lpr_down = prefetch.row_lines(d, h.element_size())[0], prefetch.row_lines(inter, h.element_size())[0]
    ahead = {"PREFETCH": True, "LINES": lines, "LINE": line} if PREFETCH_DOWN and gpu else {}
    own = PREFETCH_OWN and gpu
    ep = triton.next_power_of_2(E)
    if ONE_LAUNCH:
        own_both = {"OWN": True, "LPR_UP": lpr_up, "LPR_DOWN": lpr_down, "LINE": line} if own else {}
        _one_launch_kernel[(n * up_tiles + T * down_tiles,)](
            h, logits, gate_up, act, weights, experts, down, out, counters(dev, T), T, E, d, inter, h.stride(0),
            logits.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0), down.stride(0), down.stride(1),
            out.stride(0), down[0].numel(), K=k, RENORM=renorm, EP=ep, BN_UP=tiles.bn_up, BK_UP=tiles.bk_up,
            BN_DOWN=tiles.bn_down, BK_DOWN=tiles.bk_down, num_warps=tiles.warps, num_stages=tiles.stages,
            SPIN_NS=SPIN_NS if gpu else 0, **{**ahead, **own_both}, **chain.launch(h))
        return out, weights, experts
    own_up = {"OWN": True, "LPR": lpr_up, "LINE": line} if own else {}
    _gate_up_kernel[(n, up_tiles)](
        h, logits, gate_up, act, weights, experts, down, E, d, inter, h.stride(0), logits.stride(0),
        gate_up.stride(0), gate_up.stride(1), act.stride(0), down.stride(0), down[0].numel(), K=k, RENORM=renorm,
        EP=ep, BN=tiles.bn_up, BK=tiles.bk_up, num_warps=tiles.warps, num_stages=tiles.stages,
        **{**ahead, **own_up}, **chain.launch(h))
    own_down = {"OWN": True, "LPR": lpr_down, "LINE": line} if own else {}
    _down_kernel[(T, down_tiles)](
        act, down, weights, experts, out, d, inter, act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        K=k, BN=tiles.bn_down, BK=tiles.bk_down, num_warps=tiles.warps, num_stages=tiles.stages, **own_down,
        **chain.launch(act))
    return out, weights, experts
