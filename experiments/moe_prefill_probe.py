"""Qwen3-30B-A3B's MoE prefill on a GPU: where a long prefill's MoE layer spends its time, what the grouped
kernels' options and tiles give, and the whole model's prefill against the matmul rate, in one command:

1. **stages**: one MoE layer (128 experts, 8 a token, hidden 2048, expert intermediate 768, bf16, random weights)
   at each of --tokens: the torch routing, the grouping by expert, gate/up, down and the sum of a token's
   slots, each timed alone by CUDA events, with ``tiles_for``'s tiles; against the layer's FLOPs at the rate
   one 8k bf16 matmul reaches in the same run;
2. **options**: the layer as a prefill runs it, with the gate/up product kept in the slot table's row order
   (``triton_moe.ROW_ACT``) and unmasked loads (``triton_moe.EVEN_LOADS``), each on and off;
3. **tiles**: gate/up and down swept apart (each kernel timed alone) for each row block, at the first length
   of --sweep-tokens; the best pair, and then it against ``tiles_for``'s at every length;
4. **model**: the ``qwen3-30b-a3b`` preset's prefill of one sequence (as ``pushkv roofline`` times it) at
   --model-tokens, with what ships, with both options off, and with the sweep's best tiles; and a profile of
   the first length's prefill: kernels by GPU time.

    python3 experiments/moe_prefill_probe.py --out DIR    (from the checkout's root; ~6 min on an H200)

writes DIR/moe_prefill.json (every figure) and DIR/moe_prefill.md (the tables).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

from pushkv.model.kernels import triton_moe
from pushkv.model.kernels.triton_moe import Tiles
from pushkv.model.moe import moe_mlp, route
from tools.roofline import _time, matmul_rate

E, K, D, INTER = 128, 8, 2048, 768
UP_SWEEP = [(bn, bk, w, st) for bn in (64, 128) for bk, w, st in
            ((64, 4, 3), (64, 4, 4), (64, 8, 3), (64, 8, 4), (64, 8, 5), (32, 4, 4), (32, 8, 4))]
DOWN_SWEEP = [(bn, bk, w, st) for bn in (64, 128, 256) for bk, w, st in
              ((64, 4, 3), (64, 8, 3), (64, 8, 4), (128, 8, 3))]


def ms(fn, reps: int = 20) -> float:
    """Milliseconds a call (tools.roofline's timer: CUDA events around reps calls after a warm-up)."""
    return _time(fn, reps) * 1e3


def weights_of_layer(gen_seed: int):
    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    return (torch.randn(E, D, device="cuda", dtype=torch.bfloat16, generator=g) / D ** 0.5,
            torch.randn(E, 2 * INTER, D, device="cuda", dtype=torch.bfloat16, generator=g) / D ** 0.5,
            torch.randn(E, D, INTER, device="cuda", dtype=torch.bfloat16, generator=g) / INTER ** 0.5)


def flops_ms(T: int, peak: float) -> float:
    return 2 * T * K * 3 * D * INTER / peak * 1e3


def options(row_act: bool, even: bool) -> None:
    triton_moe.ROW_ACT, triton_moe.EVEN_LOADS = row_act, even


def stages(h, layer, tiles: Tiles) -> dict:
    """Each step of the layer alone, in ms."""
    router, gate_up, down = layer
    T = h.shape[0]
    w, experts = route(h, router, K, True)
    weights = w.flatten().contiguous()
    slot_ids, block_expert = triton_moe.group_slots(experts, E, tiles.bm)
    act = triton_moe.gate_up_product(h, gate_up, slot_ids, block_expert, K, tiles)
    per_slot = triton_moe.down_per_slot(act, down, weights, slot_ids, block_expert, T * K, tiles)
    used_rows = int((slot_ids < T * K).sum())
    blocks_used = int((block_expert >= 0).sum())
    return {"route": ms(lambda: route(h, router, K, True)),
            "group": ms(lambda: triton_moe.group_slots(experts, E, tiles.bm)),
            "gate_up": ms(lambda: triton_moe.gate_up_product(h, gate_up, slot_ids, block_expert, K, tiles)),
            "down": ms(lambda: triton_moe.down_per_slot(act, down, weights, slot_ids, block_expert, T * K, tiles)),
            "sum": ms(lambda: per_slot.view(T, K, D).sum(dim=1)),
            "rows_padded_pct": round(100 * (blocks_used * tiles.bm - used_rows) / used_rows, 1)}


def sweep(h, layer, peak: float) -> tuple[dict, list]:
    """gate/up and down tiles apart, per row block; (best Tiles per bm, every record)."""
    router, gate_up, down = layer
    T = h.shape[0]
    w, experts = route(h, router, K, True)
    weights = w.flatten().contiguous()
    recs, best = [], {}
    for bm in (64, 128):
        slot_ids, block_expert = triton_moe.group_slots(experts, E, bm)
        up_t, down_t = {}, {}
        for bn, bk, wp, st in UP_SWEEP:
            t = Tiles(bm, bn, 64, bk, wp, st)
            try:
                up_t[(bn, bk, wp, st)] = ms(functools.partial(triton_moe.gate_up_product, h, gate_up, slot_ids,
                                                              block_expert, K, t))
            except Exception as e:  # a tile the device cannot run (shared memory): said, not hidden
                print(f"gate/up {t} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
        act = triton_moe.gate_up_product(h, gate_up, slot_ids, block_expert, K, Tiles(bm, 64, 64, 64))
        for bn, bk, wp, st in DOWN_SWEEP:
            t = Tiles(bm, 64, bn, 64, 4, 3, bk, wp, st)
            try:
                down_t[(bn, bk, wp, st)] = ms(functools.partial(triton_moe.down_per_slot, act, down, weights,
                                                                slot_ids, block_expert, T * K, t))
            except Exception as e:
                print(f"down {t} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
        recs += [{"bm": bm, "kernel": "gate_up", "tile": list(k), "ms": round(v, 4)} for k, v in up_t.items()]
        recs += [{"bm": bm, "kernel": "down", "tile": list(k), "ms": round(v, 4)} for k, v in down_t.items()]
        bu = min(up_t, key=up_t.__getitem__)
        bd = min(down_t, key=down_t.__getitem__)
        best[bm] = Tiles(bm, bu[0], bd[0], bu[1], bu[2], bu[3], bd[1], bd[2], bd[3])
        print(f"tokens {T} bm {bm}: gate/up best {bu} {up_t[bu]:.3f} ms, down best {bd} {down_t[bd]:.3f} ms "
              f"(the layer's FLOPs bound {flops_ms(T, peak):.3f} ms)", flush=True)
    return best, recs


def layer_ms(h, layer, tiles=None) -> float:
    router, gate_up, down = layer
    return ms(lambda: triton_moe.moe_mlp(h, router, gate_up, down, K, True, tiles, summed=False))


def bench_model(args, peak: float, best: Tiles) -> dict:
    """The qwen3-30b-a3b prefill (one sequence), as pushkv roofline times it: shipped, options off, best tiles."""
    from torch.profiler import ProfilerActivity, profile

    from pushkv.config import preset
    from pushkv.messages import SeqWork
    from pushkv.model.build import build_model
    from tools.roofline import model_counts, prefill_flops

    t0 = time.perf_counter()
    cfg = preset("qwen3-30b-a3b")
    model = build_model(cfg, device="cuda", max_num_seqs=1)
    torch.cuda.synchronize()
    print(f"qwen3-30b-a3b: weights drawn in {time.perf_counter() - t0:.1f} s", flush=True)
    c = model_counts(model)
    fwd, u = model.batched, 16
    lengths = [int(x) for x in args.model_tokens.split(",")]
    nb = -(-max(lengths) // u)
    lay = model.kv_layout(1, u)
    pool = torch.empty(nb, lay.num_layers, 2, lay.kv_heads, u, lay.head_dim, dtype=model.dtype,
                       device="cuda").normal_()
    views = model._layer_pools(pool)
    shipped = triton_moe.tiles_for
    out: dict = {"rows": []}
    for L in lengths:
        seqs = [SeqWork(0, tuple(range(L)), 0, tuple(range(-(-L // u))))]
        run = functools.partial(fwd.logits, seqs, views)
        fl = prefill_flops(c, L)
        row = {"tokens": L, "flops": fl}
        for name in ("shipped", "options_off", "best_tiles"):
            options(name != "options_off", name != "options_off")
            triton_moe.tiles_for = (lambda n: best if n > triton_moe.FUSED_ROUTE_TOKENS else shipped(n)) \
                if name == "best_tiles" else shipped
            t = _time(run, 3, warm=1)
            row[name] = {"ms": round(t * 1e3, 2), "of_matmul": round(fl / t / peak, 3)}
        options(True, True)
        triton_moe.tiles_for = shipped
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    L = lengths[0]
    seqs = [SeqWork(0, tuple(range(L)), 0, tuple(range(-(-L // u))))]
    fwd.logits(seqs, views)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd.logits(seqs, views)
        torch.cuda.synchronize()
    by: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            by.setdefault(ev.name[:90], []).append(ev.device_time_total / 1e3)
    rows = sorted(((sum(v), len(v), k) for k, v in by.items()), reverse=True)
    out["profile"] = [{"ms": round(a, 3), "count": n, "kernel": k} for a, n, k in rows[:30]]
    return out


def markdown(rep: dict) -> str:
    lines = [f"matmul rate {rep['matmul_tflops']:.0f} TFLOP/s (8k bf16), {rep['gpu']}", "",
             "| tokens | FLOPs bound | route | group | gate/up | down | sum | padded rows | layer (shipped) | "
             "options off | ROW_ACT only | EVEN only | best tiles |", "| --- " * 13 + "|"]
    for r in rep["layer"]:
        s = r["stages"]
        lines.append(f"| {r['tokens']} | {r['bound_ms']:.3f} | {s['route']:.3f} | {s['group']:.3f} | "
                     f"{s['gate_up']:.3f} | {s['down']:.3f} | {s['sum']:.3f} | {s['rows_padded_pct']} % | "
                     f"{r['shipped']:.3f} | {r['off']:.3f} | {r['row_act_only']:.3f} | {r['even_only']:.3f} | "
                     f"{r['best']:.3f} |")
    if rep.get("model"):
        lines += ["", "| prefill tokens | shipped ms (of matmul) | options off | best tiles |", "| --- " * 4 + "|"]
        for r in rep["model"]["rows"]:
            lines.append(f"| {r['tokens']} | " + " | ".join(f"{r[k]['ms']} ({r[k]['of_matmul']:.0%})"
                                                             for k in ("shipped", "options_off", "best_tiles")) + " |")
        lines += ["", "kernels of the first length's prefill (ms, count):"]
        lines += [f"- {p['ms']:.3f} x{p['count']} {p['kernel']}" for p in rep["model"]["profile"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--tokens", default="1024,4096,16384", help="layer: prefill lengths")
    ap.add_argument("--sweep-tokens", default="4096", help="the length the tiles are swept at")
    ap.add_argument("--model-tokens", default="4096,1024,16384", help="whole model: prefill lengths (first profiled)")
    ap.add_argument("--no-model", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    peak = matmul_rate(torch.device("cuda"))
    rep: dict = {"gpu": torch.cuda.get_device_name(), "matmul_tflops": peak / 1e12, "layer": []}
    layer = weights_of_layer(1)
    sweep_T = int(args.sweep_tokens)
    h = torch.randn(sweep_T, D, device="cuda", dtype=torch.bfloat16)
    best_by_bm, rep["sweep"] = sweep(h, layer, peak)
    best_layer = {bm: layer_ms(h, layer, t) for bm, t in best_by_bm.items()}
    best = best_by_bm[min(best_layer, key=best_layer.__getitem__)]
    rep["best_tiles"] = list(best)
    print(f"best tiles at {sweep_T}: {best} ({best_layer})", flush=True)
    for T in [int(t) for t in args.tokens.split(",")]:
        h = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        router, gate_up, down = layer
        ref = moe_mlp(h, router, gate_up, down, K, True).float()
        got = triton_moe.moe_mlp(h, router, gate_up, down, K, True, best).float()
        row = {"tokens": T, "bound_ms": flops_ms(T, peak), "stages": stages(h, layer, triton_moe.tiles_for(T)),
               "best_stages": stages(h, layer, best),
               "best_max_rel_err": float((ref - got).abs().max() / ref.abs().max())}
        for name, ra, ev in (("off", False, False), ("row_act_only", True, False), ("even_only", False, True),
                             ("shipped", True, True)):
            options(ra, ev)
            row[name] = layer_ms(h, layer)
        row["best"] = layer_ms(h, layer, best)
        rep["layer"].append(row)
        print(json.dumps(row), flush=True)
    if not args.no_model:
        del layer
        torch.cuda.empty_cache()
        rep["model"] = bench_model(args, peak, best)
    with open(os.path.join(args.out, "moe_prefill.json"), "w") as f:
        json.dump(rep, f, indent=1)
    text = markdown(rep)
    with open(os.path.join(args.out, "moe_prefill.md"), "w") as f:
        f.write(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
