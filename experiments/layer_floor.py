"""How fast can a one-sequence decode step of Qwen3-30B-A3B be, launches and all? A mock of its layers that
moves exactly the step's bytes and keeps its chain of dependent phases, timed three ways on one GPU in one run.

The batch-1 step is about 2x its bytes bound (docs/results/2026-12-05-moe-roofline): a layer is a chain of about
ten dependent kernels, and the four weight streams between them (qkv 21 MB, o 17 MB, the experts' gate/up 50 MB
and down 25 MB) take 26 us at the copy rate of a layer's ~60. Is a persistent kernel (one launch a layer, grid
barriers between its phases) the way to 1.5x? This mock answers it before anyone writes that kernel.

Each phase of a layer streams its bytes (random bf16 weights, each layer its own, so nothing is served from L2)
split evenly over the programs, sums them, and stores one float32 partial a program. A phase first reads the
total of the phase before it (every program's partial), so each depends on the one before, as the real ones do.
The routing phase takes the top 8 of the router phase's partials, as the real one takes 8 of 128 logits, and the
gate/up phase's programs pick their shares by the first choice, so its addresses depend on the routing.

Modes (every mode moves the same bytes and gives the same bits, checked):
- ``chained``: one kernel a phase, programmatic dependent launch (as the shipped step): norm, qkv, q/k norm and
  RoPE, attention (the K/V at context 512), the merge, o, the add with the norm and the router, the routing,
  gate/up, down; then the LM head;
- ``chained_pre``: the same, each weight stream's first block loaded before its kernel waits (as the shipped
  GEMVs load their tiles);
- ``persistent``: one kernel a layer, its programs resident on every SM, a grid barrier (one atomic counter)
  after each phase whose output the next needs whole: qkv, attention, o, router, gate/up, down (6 a layer); the
  norm, RoPE, merge and routing are done by every program redundantly, where they cost no barrier;
- ``persistent_pre``: the same, each program's first block of the next weight stream loaded before it waits at
  the barrier;
- ``persistent_all``: the whole step's 48 layers in one launch.

Run on a GPU: ``python3 -m experiments.layer_floor --out DIR`` (``layer_floor.json``, ``layer_floor.md``,
``layer_floor.png``). ``--plot JSON`` redraws the plot.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pushkv.model.kernels.chain import wait_prior

# Qwen3-30B-A3B at batch 1, context 512 (bf16 elements): its phases' weights and K/V
HIDDEN = 2048
QKV = HIDDEN * (32 + 2 * 4) * 128
O = 32 * 128 * HIDDEN
ROUTER = 128 * HIDDEN
GATE_UP = 8 * 2 * 768 * HIDDEN
DOWN = 8 * HIDDEN * 768
KV = 512 * 4 * 128 * 2
LM_HEAD = 151936 * HIDDEN
LAYERS = 48
BLOCK = 8192  # elements a program loads a pass (16 KB of bf16)
NP = 512  # room for a phase's partials (programs at most)
ROWS = 12  # a layer's rows of partials


class Phase(NamedTuple):
    name: str
    elems: int  # 0: a small kernel (chained modes only) that passes the total on
    barrier: bool  # the persistent kernel waits for every program after it


PHASES = [Phase("norm", 0, False), Phase("qkv", QKV, True), Phase("rope", 0, False), Phase("attention", KV, True),
          Phase("merge", 0, False), Phase("o", O, True), Phase("router", ROUTER, True), Phase("route", 0, False),
          Phase("gate_up", GATE_UP, True), Phase("down", DOWN, True)]
STREAMS = [p for p in PHASES if p.elems]


def step_bytes(layers: int) -> int:
    return 2 * (layers * sum(p.elems for p in STREAMS) + LM_HEAD)


@triton.jit
def total(Part, row, n, NP: tl.constexpr):
    """The sum of a row's first n partials (the phase before's whole output)."""
    i = tl.arange(0, NP)
    return tl.sum(tl.load(Part + row * NP + i, mask=i < n, other=0.0), 0)

@triton.jit
def first_choice(Part, row, n, NP: tl.constexpr, K: tl.constexpr):
    """The routing: 8 rounds of the largest partial left (the lowest index on a tie); the first chosen."""
    i = tl.arange(0, NP)
    left = tl.load(Part + row * NP + i, mask=i < n, other=float("-inf"))
    first = 0
    for j in tl.static_range(K):
        best = tl.max(left, 0)
        pick = tl.min(tl.where(left == best, i, NP), 0)
        if j == 0:
            first = pick
        left = tl.where(i == pick, float("-inf"), left)
    return first

@triton.jit
def span(nb, s, nshare):
    per = tl.cdiv(nb, nshare)
    lo = s * per
    return lo, tl.minimum(lo + per, nb)

@triton.jit
def head(W, nb, s, nshare, BLOCK: tl.constexpr):
    """Share s's first block, loaded (zeros where the share is empty)."""
    lo, hi = span(nb, s, nshare)
    offs = tl.arange(0, BLOCK)
    return tl.load(W + lo * BLOCK + offs, mask=(offs < BLOCK) & (lo < hi), other=0.0).to(tl.float32)

@triton.jit
def stream(W, nb, s, nshare, acc, skip, BLOCK: tl.constexpr):
    """acc plus share s's blocks (of nb, split evenly over nshare), from its first + skip."""
    lo, hi = span(nb, s, nshare)
    offs = tl.arange(0, BLOCK)
    for b in range(lo + skip, hi):
        acc += tl.load(W + b * BLOCK + offs).to(tl.float32)
    return acc

@triton.jit
def phase_kernel(W, nb, Part, prev_row, nprev, row, route_row, BLOCK: tl.constexpr, NP: tl.constexpr,
                 PRE: tl.constexpr, ROUTED: tl.constexpr, PASS: tl.constexpr, PDL: tl.constexpr):
    """One phase as its own kernel: wait for the one before, read its total, stream this program's share
    (``PASS``: a small kernel that only passes the total on)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    if PRE:  # the weights load before the wait: no kernel writes them (never a routed phase's)
        acc = head(W, nb, pid, nprog, BLOCK)
    wait_prior(PDL)
    prev = total(Part, prev_row, nprev, NP)
    if PASS:
        tl.store(Part + row * NP + pid, prev)
    else:
        s = pid
        if ROUTED:  # the share by the routing's first choice
            s = (pid + tl.load(Part + route_row * NP).to(tl.int32)) % nprog
        acc = stream(W, nb, s, nprog, acc, 1 if PRE else 0, BLOCK)
        tl.store(Part + row * NP + pid, tl.sum(acc, 0) + prev * 1e-3)

@triton.jit
def route_kernel(Part, prev_row, nprev, row, NP: tl.constexpr, PDL: tl.constexpr):
    """The routing as its own one-program kernel: the first of 8 choices, stored for gate/up."""
    wait_prior(PDL)
    tl.store(Part + row * NP, first_choice(Part, prev_row, nprev, NP, 8).to(tl.float32))

@triton.jit
def barrier(Counter, target):
    """Every program's stores before it visible to every program after it: one atomic a program (thread 0's,
    its release publishing the stores), then a spin on the counter with acquire."""
    tl.debug_barrier()
    tl.atomic_add(Counter, 1, sem="release")
    while tl.atomic_add(Counter, 0, sem="acquire") < target:
        pass
    tl.debug_barrier()

@triton.jit
def layer_kernel(Wqkv, Wkv, Wo, Wr, Wgu, Wd, Part, Counter, in_row, layer0, nlayers, nb_qkv, nb_kv, nb_o, nb_r,
                 nb_gu, nb_d, in_n, BLOCK: tl.constexpr, NP: tl.constexpr, ROWS: tl.constexpr,
                 PRE: tl.constexpr, PDL: tl.constexpr):
    """``nlayers`` layers from ``layer0`` in one launch: 6 grid barriers a layer. Rows of layer l:
    l*ROWS + 1 (qkv), 3 (attention), 5 (o), 6 (router), 8 (gate/up), 9 (down), as the chained kernels'."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    if PRE:
        acc = head(Wqkv + layer0 * nb_qkv * BLOCK, nb_qkv, pid, nprog, BLOCK)
    wait_prior(PDL)
    prev_row = in_row
    nprev = in_n
    for l in range(layer0, layer0 + nlayers):
        base = l * ROWS
        b = (l - layer0) * 6  # the barriers before this layer's
        lw = l  # every offset below 2^31 elements (gate/up: 48 layers of 25M)
        prev = total(Part, prev_row, nprev, NP)
        # qkv (norm folded: every program reads the hidden total)
        acc = stream(Wqkv + lw * nb_qkv * BLOCK, nb_qkv, pid, nprog, acc, 1 if PRE else 0, BLOCK)
        tl.store(Part + (base + 1) * NP + pid, tl.sum(acc, 0) + prev * 1e-3)
        acc = head(Wkv + lw * nb_kv * BLOCK, nb_kv, pid, nprog, BLOCK) if PRE else tl.zeros((BLOCK,), tl.float32)
        b += 1
        barrier(Counter, b * nprog)
        # attention (RoPE folded), over the K/V
        prev = total(Part, base + 1, nprog, NP)
        acc = stream(Wkv + lw * nb_kv * BLOCK, nb_kv, pid, nprog, acc, 1 if PRE else 0, BLOCK)
        tl.store(Part + (base + 3) * NP + pid, tl.sum(acc, 0) + prev * 1e-3)
        acc = head(Wo + lw * nb_o * BLOCK, nb_o, pid, nprog, BLOCK) if PRE else tl.zeros((BLOCK,), tl.float32)
        b += 1
        barrier(Counter, b * nprog)
        # o (the merge folded)
        prev = total(Part, base + 3, nprog, NP)
        acc = stream(Wo + lw * nb_o * BLOCK, nb_o, pid, nprog, acc, 1 if PRE else 0, BLOCK)
        tl.store(Part + (base + 5) * NP + pid, tl.sum(acc, 0) + prev * 1e-3)
        acc = head(Wr + lw * nb_r * BLOCK, nb_r, pid, nprog, BLOCK) if PRE else tl.zeros((BLOCK,), tl.float32)
        b += 1
        barrier(Counter, b * nprog)
        # the router (the add and norm folded)
        prev = total(Part, base + 5, nprog, NP)
        acc = stream(Wr + lw * nb_r * BLOCK, nb_r, pid, nprog, acc, 1 if PRE else 0, BLOCK)
        tl.store(Part + (base + 6) * NP + pid, tl.sum(acc, 0) + prev * 1e-3)
        b += 1
        barrier(Counter, b * nprog)
        # the routing, by every program; gate/up's share by its first choice
        prev = total(Part, base + 6, nprog, NP)
        s = (pid + first_choice(Part, base + 6, nprog, NP, 8)) % nprog
        gu = Wgu + lw * nb_gu * BLOCK
        acc = head(gu, nb_gu, s, nprog, BLOCK) if PRE else tl.zeros((BLOCK,), tl.float32)
        acc = stream(gu, nb_gu, s, nprog, acc, 1 if PRE else 0, BLOCK)
        tl.store(Part + (base + 8) * NP + pid, tl.sum(acc, 0) + prev * 1e-3)
        acc = head(Wd + lw * nb_d * BLOCK, nb_d, pid, nprog, BLOCK) if PRE else tl.zeros((BLOCK,), tl.float32)
        b += 1
        barrier(Counter, b * nprog)
        # down
        prev = total(Part, base + 8, nprog, NP)
        acc = stream(Wd + lw * nb_d * BLOCK, nb_d, pid, nprog, acc, 1 if PRE else 0, BLOCK)
        tl.store(Part + (base + 9) * NP + pid, tl.sum(acc, 0) + prev * 1e-3)
        if l + 1 < layer0 + nlayers:
            acc = (head(Wqkv + (lw + 1) * nb_qkv * BLOCK, nb_qkv, pid, nprog, BLOCK) if PRE
                   else tl.zeros((BLOCK,), tl.float32))
            b += 1
            barrier(Counter, b * nprog)
        prev_row = base + 9
        nprev = nprog


class Mock:
    """The step's buffers on one device: each layer's weights, the LM head, the partials and the counters."""

    def __init__(self, dev: torch.device, layers: int, programs: int, scale: float = 1.0):
        g = torch.Generator(device=dev).manual_seed(0)

        def weights(elems: int, n: int = layers) -> torch.Tensor:
            return (torch.rand((n, elems), generator=g, device=dev, dtype=torch.float32) - 0.5).to(torch.bfloat16)

        self.layers, self.programs = layers, programs
        # each stream's blocks: the real bytes, or (scale 0) one block, where only the chain's latency is left
        self.nb = {p.name: max(1, round(scale * p.elems / BLOCK)) for p in STREAMS}
        self.nb["lm_head"] = max(1, round(scale * LM_HEAD / BLOCK))
        self.scale = scale
        self.w = {p.name: weights(self.nb[p.name] * BLOCK) for p in STREAMS}
        self.lm = weights(self.nb["lm_head"] * BLOCK, 1)
        self.tiny = torch.zeros(BLOCK, dtype=torch.bfloat16, device=dev)
        self.part = torch.zeros(((layers + 1) * ROWS, NP), dtype=torch.float32, device=dev)
        self.counter = torch.zeros(layers, dtype=torch.int32, device=dev)

    def result(self) -> torch.Tensor:
        return self.part[self.layers * ROWS].clone()


def run_chained(mock: Mock, pre: bool) -> None:
    from pushkv.model.kernels import chain

    n = mock.programs
    pdl = chain.launch(mock.part)
    mock.part.zero_()
    prev_row, nprev = ROWS * mock.layers + 1, 1  # an empty row: the step's input
    for layer in range(mock.layers):
        base = layer * ROWS
        for i, p in enumerate(PHASES):
            row = base + i
            if p.name == "route":
                route_kernel[(1,)](mock.part, prev_row, nprev, row, NP=NP, num_warps=1, **pdl)
                continue  # gate/up reads the router's total, as the persistent kernel does
            routed = p.name == "gate_up"
            if p.elems:
                w, nb, grid = mock.w[p.name][layer], mock.nb[p.name], n
            else:  # a small kernel of one program that reads the total and passes it on
                w, nb, grid = mock.tiny, 0, 1
            phase_kernel[(grid,)](w, nb, mock.part, base + 6 if routed else prev_row, n if routed else nprev, row,
                                  base + 7, BLOCK=BLOCK, NP=NP, PRE=pre and nb > 0 and not routed, ROUTED=routed,
                                  PASS=nb == 0, num_warps=4, **pdl)
            prev_row, nprev = row, grid
    lm_head(mock, prev_row, nprev, pre, pdl)


def lm_head(mock: Mock, prev_row: int, nprev: int, pre: bool, pdl: dict) -> None:
    phase_kernel[(mock.programs,)](mock.lm[0], mock.nb["lm_head"], mock.part, prev_row, nprev, mock.layers * ROWS, 0,
                                   BLOCK=BLOCK, NP=NP, PRE=pre, ROUTED=False, PASS=False, num_warps=4, **pdl)


def run_persistent(mock: Mock, pre: bool, per_launch: int) -> None:
    from pushkv.model.kernels import chain

    pdl = chain.launch(mock.part)
    mock.part.zero_()
    mock.counter.zero_()
    prev_row, nprev = ROWS * mock.layers + 1, 1
    nb = mock.nb
    for i, layer0 in enumerate(range(0, mock.layers, per_launch)):
        w = mock.w
        layer_kernel[(mock.programs,)](w["qkv"], w["attention"], w["o"], w["router"], w["gate_up"], w["down"],
                                       mock.part, mock.counter[i:], prev_row, layer0, per_launch, nb["qkv"],
                                       nb["attention"], nb["o"], nb["router"], nb["gate_up"], nb["down"], nprev,
                                       BLOCK=BLOCK, NP=NP, ROWS=ROWS, PRE=pre, num_warps=4, **pdl)
        prev_row, nprev = (layer0 + per_launch - 1) * ROWS + 9, mock.programs
    lm_head(mock, prev_row, nprev, pre, pdl)


MODES = {"chained": lambda m: run_chained(m, False), "chained_pre": lambda m: run_chained(m, True),
         "persistent": lambda m: run_persistent(m, False, 1), "persistent_pre": lambda m: run_persistent(m, True, 1),
         "persistent_all": lambda m: run_persistent(m, True, m.layers)}


def graph_ms(fn, reps: int) -> list[float]:
    """Each replay's milliseconds of ``fn`` captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--per-sm", default="1,2", help="programs an SM, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--scales", default="1,0", help="the streams' bytes times this (0: one block each, the chain's "
                    "latency alone), comma-separated")
    ap.add_argument("--plot", metavar="JSON", nargs="+", help="only draw DIR/layer_floor.png from saved "
                    "layer_floor.json files (their rows together)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.plot:
        reps = []
        for path in args.plot:
            with open(path) as f:
                reps.append(json.load(f))
        plot(dict(reps[0], rows=[r for rep in reps for r in rep["rows"]]), os.path.join(args.out, "layer_floor.png"))
        return 0
    from tools.roofline import copy_bandwidth

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bw = copy_bandwidth(dev)
    bound_ms = step_bytes(LAYERS) / bw * 1e3
    print(f"{torch.cuda.get_device_name(dev)}: {sms} SMs, copy {bw / 1e9:.0f} GB/s; the step's bytes "
          f"{step_bytes(LAYERS) / 1e9:.2f} GB, bound {bound_ms:.3f} ms", flush=True)
    rows = []
    for scale in [float(x) for x in args.scales.split(",")]:
        for per_sm in [int(x) for x in args.per_sm.split(",")]:
            mock = Mock(dev, LAYERS, sms * per_sm, scale)
            ref = None
            for name in args.modes.split(","):
                times = graph_ms(lambda name=name, mock=mock: MODES[name](mock), args.reps)
                got = mock.result()
                ref = got if ref is None else ref
                same = bool(torch.equal(got, ref))
                ms = statistics.median(times)
                lm_ms = 2 * mock.nb["lm_head"] * BLOCK / bw * 1e3
                rows.append(dict(mode=name, scale=scale, programs=mock.programs, per_sm=per_sm, ms=ms,
                                 min_ms=min(times), x_bound=ms / bound_ms if scale == 1 else None,
                                 us_a_layer=(ms - lm_ms) * 1e3 / LAYERS, same_bits=same))
                print(f"scale {scale:g} {name:15s} {mock.programs:4d} programs: {ms:.3f} ms "
                      f"({rows[-1]['us_a_layer']:.1f} us a layer) same bits: {same}", flush=True)
            mock = None
            torch.cuda.empty_cache()
    rep = dict(gpu=torch.cuda.get_device_name(dev), sms=sms, copy_Bps=bw, bound_ms=bound_ms,
               step_bytes=step_bytes(LAYERS), layers=LAYERS, block=BLOCK, rows=rows)
    with open(os.path.join(args.out, "layer_floor.json"), "w") as f:
        json.dump(rep, f, indent=1)
    with open(os.path.join(args.out, "layer_floor.md"), "w") as f:
        f.write(markdown(rep))
    plot(rep, os.path.join(args.out, "layer_floor.png"))
    print(markdown(rep))
    return 0


def markdown(rep: dict) -> str:
    out = [f"{rep['gpu']}, copy {rep['copy_Bps'] / 1e9:.0f} GB/s, bound {rep['bound_ms']:.3f} ms", "",
           "| bytes | mode | programs | step ms | x bound | us a layer | same bits |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rep["rows"]:
        xb = f"{r['x_bound']:.2f}" if r["x_bound"] is not None else "-"
        out.append(f"| {'the step' if r['scale'] == 1 else 'one block a stream' if r['scale'] == 0 else r['scale']} "
                   f"| {r['mode']} | {r['programs']} | {r['ms']:.3f} | {xb} | {r['us_a_layer']:.1f} | "
                   f"{r['same_bits']} |")
    return "\n".join(out) + "\n"


def plot(rep: dict, path: str) -> None:
    """Each mode's step against its bytes bound over the programs an SM (one line a mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rep["rows"] if r["scale"] == 1]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r["per_sm"], r["x_bound"]) for r in rows if r["mode"] == mode)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", linestyle="--" if "chained" in mode else "-",
                label=mode)
    ax.axhline(1.5, color="k", linestyle=":", linewidth=0.8)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(sorted({r["per_sm"] for r in rows}))
    ax.set_xlabel("programs an SM")
    ax.set_ylabel("step time / bytes bound")
    ax.set_ylim(bottom=0.9)
    ax.legend(fontsize=8)
    ax.set_title(f"a mock Qwen3-30B-A3B batch-1 step (its bytes, its phases), {rep['gpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
