"""Qwen3-30B-A3B's MoE (128 experts, 8 a token, hidden 2048, expert intermediate 768, bf16) on a GPU
against its bounds, in one command of a few minutes on an H200:

1. **layer**: one MoE MLP layer, the grouped Triton kernels (pushkv/model/kernels/triton_moe.py) eager
   and captured in a CUDA graph (as the decode step runs them), against the torch reference
   (pushkv/model/moe.py) and against the bound: the bytes of the experts the batch chose (each read
   once) at the HBM rate a plain device copy reaches here, or the routed tokens' FLOPs at the rate
   one 8k bf16 matmul reaches, whichever is larger. The graph runs LAYERS layers, each with its own
   weights, so no expert is still in L2 from the layer before (a layer's time is the graph's / LAYERS);
2. **tiles**: the same graph per decode batch for a sweep of tile shapes (``triton_moe.Tiles``, and up
   to ``DECODE_TOKENS`` tokens the ungrouped decode kernels' ``DecodeTiles`` beside the grouped ones),
   and the best of each batch against ``tiles_for``'s choice;
3. **model**: a whole decode step of the qwen3-30b-a3b preset (48 layers, random weights drawn on the
   device, a context of --ctx tokens a sequence), CUDA graphs on, with ``tiles_for``'s tiles and with
   the sweep's best, against its bytes bound: every non-expert weight once, the experts each layer's
   routing actually chose (counted on the step's own tokens), and the KV read.

    python3 experiments/moe_bench.py --out DIR    (from the checkout's root)

writes DIR/moe_bench.json (every figure), DIR/moe_bench.md (the tables) and DIR/moe_bench.png (against the bound).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from pushkv.model.kernels import triton_moe
from pushkv.model.kernels.triton_moe import Tiles
from pushkv.model.kernels.triton_moe_decode import DECODE_TOKENS, DecodeTiles
from pushkv.model.moe import moe_mlp, route
from tools.roofline import chosen_experts

E, K, D, INTER = 128, 8, 2048, 768
LAYERS = 8  # layers (own weights each) in the layer graph: 8 x 1.2 GB, far past L2
SWEPT = (1, 8, 32, 64, 4096)  # the decode batches swept (and the whole model's), and a 4k prefill
SWEEP = [Tiles(16, bu, bd, bk, 4, st) for bu, bd, bk in
         ((16, 32, 128), (16, 64, 256), (32, 64, 128), (32, 64, 64), (32, 128, 128), (64, 64, 64), (64, 128, 128))
         for st in (3, 4)]
# the decode kernels around decode_tiles_for's choice, one knob at a time, and a few together; at one token
# bn_up 32 and bn_down 8 fall under 2 x 132 programs (192, 256), to show what the rule costs
_DECODE = DecodeTiles(16, 256, 4, 256, 2, 4, 3)
DECODE_SWEEP = [_DECODE] + [_DECODE._replace(**{knob: v}) for knob, values in
                            (("bn_up", (8, 32)), ("bk_up", (128, 512)), ("bn_down", (2, 8, 16)),
                             ("bk_down", (128, 512)), ("be", (0, 1, 4)), ("warps", (2, 8)))
                            for v in values] + [
    DecodeTiles(8, 512, 2, 256, 2, 4, 3), DecodeTiles(32, 128, 8, 128, 4, 8, 4), DecodeTiles(8, 256, 8, 256, 1, 2, 3)]
PREFILL_SWEEP = [Tiles(bm, bu, bd, bk, w, st) for bm, bu, bd in ((64, 64, 64), (64, 128, 128), (128, 64, 64),
                                                                 (128, 128, 128), (128, 128, 64))
                 for bk, w, st in ((32, 4, 4), (64, 4, 3), (64, 8, 3), (64, 8, 4))]


def timed(fn, reps: int = 20) -> float:
    """Median ms of ``fn`` over ``reps`` runs after a warm-up, by CUDA events."""
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def device_rates() -> tuple[float, float]:
    """(HBM bytes/s by a 2 GiB device copy, bf16 FLOP/s by an 8k matmul), measured now."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), 10)
    hbm = 2 * src.numel() * 2 / (ms / 1e3)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = timed(lambda: a @ a, 10)
    return hbm, 2 * 8192 ** 3 / (ms / 1e3)


def graphed(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph, after a warm-up (compiles) on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def layer_graph_ms(h, layers, tiles=None) -> float:
    """ms per layer of LAYERS layers in one CUDA graph (each layer on the previous one's output)."""
    def run():
        x = h
        for router, gate_up, down in layers:
            x = triton_moe.moe_mlp(x, router, gate_up, down, K, True, tiles)
    g = graphed(run)
    return timed(g.replay) / len(layers)


def tile_record(t) -> list:
    """A tile as the JSON keeps it: its kind (Tiles: grouped; DecodeTiles: the decode kernels), then its fields."""
    return [type(t).__name__, *t]


def bench_layers(args, hbm: float, flops: float) -> tuple[list, list, dict]:
    """(rows, every swept time, the best tiles of each swept token count)."""
    layers = [(torch.randn(E, D, dtype=torch.bfloat16, device="cuda") / D ** 0.5,
               torch.randn(E, 2 * INTER, D, dtype=torch.bfloat16, device="cuda") / D ** 0.5,
               torch.randn(E, D, INTER, dtype=torch.bfloat16, device="cuda") / INTER ** 0.5) for _ in range(LAYERS)]
    router, gate_up, down = layers[0]
    expert_bytes = 3 * D * INTER * 2
    rows, sweep = [], []
    best_of: dict = {}
    for T in [int(t) for t in args.tokens.split(",")]:
        h = torch.randn(T, D, dtype=torch.bfloat16, device="cuda")
        _, experts = route(h, router, K, True)
        chosen = int(experts.unique().numel())
        ref = moe_mlp(h, router, gate_up, down, K, True)
        got = triton_moe.moe_mlp(h, router, gate_up, down, K, True)
        err = float((ref.float() - got.float()).abs().max() / ref.float().abs().max())
        ms_k = timed(lambda h=h: triton_moe.moe_mlp(h, router, gate_up, down, K, True))
        ms_g = layer_graph_ms(h, layers)
        ms_t = timed(lambda h=h: moe_mlp(h, router, gate_up, down, K, True), 5 if T > 64 else 10)
        bytes_ms = chosen * expert_bytes / hbm * 1e3
        flop_ms = 2 * 3 * D * INTER * T * K / flops * 1e3
        bound = max(bytes_ms, flop_ms)
        row = {"tokens": T, "experts_chosen": chosen, "graph_ms": round(ms_g, 4), "eager_ms": round(ms_k, 4),
               "torch_ms": round(ms_t, 4), "bound_ms": round(bound, 4),
               "bound": "bytes" if bytes_ms >= flop_ms else "flops", "x_bound": round(ms_g / bound, 2),
               "max_rel_err": round(err, 5), "tiles": tile_record(triton_moe.tiles_for(T))}
        if T in SWEPT:
            times = {}
            swept = PREFILL_SWEEP if T > triton_moe.FUSED_ROUTE_TOKENS else SWEEP
            for t in (DECODE_SWEEP + swept if T <= DECODE_TOKENS else swept):
                try:
                    times[t] = layer_graph_ms(h, layers, t)
                except Exception as e:  # a tile the device cannot run (shared memory): said, not hidden
                    print(f"tokens {T}: tiles {tuple(t)} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            best = min(times, key=times.__getitem__) if times else triton_moe.tiles_for(T)
            times.setdefault(best, ms_g)
            best_of[T] = best
            row.update(best_tiles=tile_record(best), best_ms=round(times[best], 4),
                       best_x_bound=round(times[best] / bound, 2))
            sweep += [{"tokens": T, "tiles": tile_record(t), "ms": round(ms, 4)} for t, ms in times.items()]
        rows.append(row)
        print(json.dumps(row), flush=True)
    del layers
    torch.cuda.empty_cache()
    return rows, sweep, best_of


def bench_model(args, hbm: float, best: dict) -> list:
    """Whole decode steps of the qwen3-30b-a3b preset with graphs on, against the bytes bound."""
    from pushkv.config import preset
    from pushkv.messages import SeqWork
    from pushkv.model.build import build_model

    t0 = time.perf_counter()
    cfg = preset("qwen3-30b-a3b")
    batches = [int(b) for b in args.batches.split(",")]
    model = build_model(cfg, device="cuda", max_num_seqs=max(batches))
    torch.cuda.synchronize()
    print(f"qwen3-30b-a3b: weights drawn on the device in {time.perf_counter() - t0:.1f} s", flush=True)
    w, fwd = model.w, model.batched
    assert fwd.use_graphs, "CUDA graphs are off for the MoE model (PUSHKV_CUDA_GRAPHS=0?)"
    item = model.dtype.itemsize
    # read once a step: every layer's tensors but the experts, the final norm, the lm_head (the
    # embedding only in the B rows looked up, left out)
    dense = sum(t.numel() for lw in w.layers for name, t in vars(lw).items()
                if isinstance(t, torch.Tensor) and name not in ("gate_up", "down"))
    dense += w.final_norm.numel() + w.lm_head.numel()
    expert_bytes = 3 * cfg.hidden_size * cfg.intermediate_size * item
    u, ctx = 16, args.ctx
    nb = -(-(ctx + 1) // u)
    lay = model.kv_layout(1, u)
    pool = torch.empty(max(batches) * nb, lay.num_layers, 2, lay.kv_heads, u, lay.head_dim, dtype=model.dtype,
                       device="cuda").normal_()
    views = model._layer_pools(pool)
    rows = []
    for B in batches:
        seqs = [SeqWork(i, (1 + 7 * i,), ctx, tuple(range(i * nb, (i + 1) * nb))) for i in range(B)]
        chosen = _chosen_experts(fwd, seqs, views)
        nbytes = dense * item + sum(chosen) * expert_bytes \
            + B * (ctx + 1) * cfg.kv_bytes_per_token()
        bound_ms = nbytes / hbm * 1e3
        row = {"batch": B, "ctx": ctx, "experts_chosen_per_layer": round(sum(chosen) / len(chosen), 1),
               "bound_ms": round(bound_ms, 3), "bytes_GB": round(nbytes / 1e9, 2)}
        for name, tiles in (("default", None), ("best", best.get(B))):
            if name == "best" and tiles is None:
                continue
            _use_tiles(fwd, tiles)
            fwd.use_graphs = False
            eager = timed(lambda seqs=seqs: fwd.logits(seqs, views), 3)
            fwd.use_graphs = True
            graph = timed(lambda seqs=seqs: fwd.logits(seqs, views), 10)
            assert B in fwd.graphs, f"batch {B} did not replay a graph"
            row.update({f"{name}_graph_ms": round(graph, 3), f"{name}_eager_ms": round(eager, 3),
                        f"{name}_x_bound": round(graph / bound_ms, 2)})
        _use_tiles(fwd, None)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def profile_step(args) -> None:
    """Where a graphed decode step's time goes: kernels by name (GPU time, count) from torch's profiler
    over 10 replays, and the gap (the step's wall time less its kernels': launch and idle)."""
    from torch.profiler import ProfilerActivity, profile

    from pushkv.config import preset
    from pushkv.messages import SeqWork
    from pushkv.model.build import build_model

    B, ctx, u = args.profile, args.ctx, 16
    model = build_model(preset("qwen3-30b-a3b"), device="cuda", max_num_seqs=B)
    fwd = model.batched
    nb = -(-(ctx + 1) // u)
    lay = model.kv_layout(1, u)
    pool = torch.empty(B * nb, lay.num_layers, 2, lay.kv_heads, u, lay.head_dim, dtype=model.dtype,
                       device="cuda").normal_()
    views = model._layer_pools(pool)
    seqs = [SeqWork(i, (1 + 7 * i,), ctx, tuple(range(i * nb, (i + 1) * nb))) for i in range(B)]
    step = timed(lambda: fwd.logits(seqs, views), 10)
    reps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fwd.logits(seqs, views)
        torch.cuda.synchronize()
    by: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            by.setdefault(ev.name[:90], []).append(ev.device_time_total / 1e3)
    rows = sorted(((sum(v) / reps, len(v) // reps, k) for k, v in by.items()), reverse=True)
    busy = sum(r[0] for r in rows)
    lines = [f"qwen3-30b-a3b decode step, batch {B}, context {ctx}, graphs {fwd.use_graphs}: {step:.3f} ms a step, "
             f"kernels {busy:.3f} ms, {sum(r[1] for r in rows)} launches, gap {step - busy:.3f} ms",
             "ms/step  count/step  kernel"]
    lines += [f"{ms:8.3f}  {n:10d}  {name}" for ms, n, name in rows[:40]]
    text = "\n".join(lines)
    print(text, flush=True)
    with open(os.path.join(args.out, "moe_profile.txt"), "w") as f:
        f.write(text + "\n")


def _chosen_experts(fwd, seqs, views) -> list[int]:
    """Experts each layer's routing chooses for this step's tokens (one eager step, counted as pushkv
    roofline counts them)."""
    fwd.use_graphs = False
    try:
        return chosen_experts(fwd.m, lambda: fwd.logits(seqs, views))
    finally:
        fwd.use_graphs = True


_TILES_FOR = triton_moe.tiles_for


def _use_tiles(fwd, tiles) -> None:
    """Make every MoE launch take these tiles (None: tiles_for's), and drop the graphs captured so far."""
    def fixed(tokens: int):  # decode tiles serve only a decode step's few tokens
        return tiles if not isinstance(tiles, DecodeTiles) or tokens <= DECODE_TOKENS else _TILES_FOR(tokens)

    triton_moe.tiles_for = _TILES_FOR if tiles is None else fixed
    fwd.drop_graphs()


def markdown(report: dict) -> str:
    out = [f"# MoE bench: {report['device']}, copy {report['hbm_GBps']} GB/s, matmul {report['bf16_TFLOPs']} TFLOP/s",
           "", "## One layer (graph: per layer, within a graph of 8 layers with their own weights)", "",
           "| tokens | experts read | graph ms | eager ms | torch ms | bound ms (kind) | graph / bound | "
           "best swept tiles | best ms | best / bound | max rel err |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["layer"]:
        out.append(f"| {r['tokens']} | {r['experts_chosen']} | {r['graph_ms']} | {r['eager_ms']} | {r['torch_ms']} | "
                   f"{r['bound_ms']} ({r['bound']}) | {r['x_bound']} | {r.get('best_tiles', '')} | "
                   f"{r.get('best_ms', '')} | {r.get('best_x_bound', '')} | {r['max_rel_err']} |")
    out += ["", f"## Whole decode step, qwen3-30b-a3b, context {report['model'][0]['ctx'] if report['model'] else ''}, "
            "CUDA graphs on", "",
            "| batch | experts / layer | bytes GB | bound ms | graph ms | x bound | eager ms | best-tiles graph ms | "
            "x bound |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["model"]:
        out.append(f"| {r['batch']} | {r['experts_chosen_per_layer']} | {r['bytes_GB']} | {r['bound_ms']} | "
                   f"{r['default_graph_ms']} | {r['default_x_bound']} | {r['default_eager_ms']} | "
                   f"{r.get('best_graph_ms', '')} | {r.get('best_x_bound', '')} |")
    return "\n".join(out) + "\n"


def plot(report: dict, path: str) -> None:
    """Each measure against its bound: the layer (in a graph, per tokens a step) and the whole decode
    step (per batch); 1 is the bound, below 1 faster than a plain copy moves the bytes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    layer = [r for r in report["layer"] if r["bound"] == "bytes"]
    axes[0].plot([r["tokens"] for r in layer], [r["x_bound"] for r in layer], "o-", label="MoE layer, CUDA graph")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("tokens a step")
    if report["model"]:
        axes[1].plot([r["batch"] for r in report["model"]], [r["default_x_bound"] for r in report["model"]], "o-",
                     label="qwen3-30b-a3b decode step, graphs on")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("decode batch")
    for ax in axes:
        ax.axhline(1.0, color="grey", lw=1)
        ax.axhline(1.5, color="grey", lw=1, ls="--")  # issue 30's goal
        ax.set_ylabel("time / bytes bound")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"MoE on {report['device']}: time over the bytes bound (copy {report['hbm_GBps']} GB/s); "
                 "dashed: 1.5x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,4096", help="layer: tokens a step")
    ap.add_argument("--batches", default="1,8,32,64", help="whole model: decode batches (graph buckets)")
    ap.add_argument("--ctx", type=int, default=512, help="whole model: context of each sequence")
    ap.add_argument("--no-model", action="store_true", help="the layer and the sweep only")
    ap.add_argument("--profile", type=int, default=0, metavar="B",
                    help="only profile the whole model's decode step at batch B (graph replay): each kernel's GPU "
                         "time, summed by name, against the step's wall time; writes DIR/moe_profile.txt")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    if args.profile:
        profile_step(args)
        return
    t0 = time.perf_counter()
    hbm, flops = device_rates()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm_GBps": round(hbm / 1e9),
              "bf16_TFLOPs": round(flops / 1e12), "shape": {"experts": E, "k": K, "hidden": D, "intermediate": INTER}}
    report["layer"], report["sweep"], best = bench_layers(args, hbm, flops)
    print(f"layer and sweep: {time.perf_counter() - t0:.0f} s", flush=True)
    report["model"] = [] if args.no_model else bench_model(args, hbm, best)
    report["seconds"] = round(time.perf_counter() - t0)
    with open(os.path.join(args.out, "moe_bench.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = markdown(report)
    with open(os.path.join(args.out, "moe_bench.md"), "w") as f:
        f.write(md)
    print(md)
    plot(report, os.path.join(args.out, "moe_bench.png"))
    print(f"done in {report['seconds']} s")


if __name__ == "__main__":
    main()
