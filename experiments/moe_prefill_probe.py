"""Qwen3-30B-A3B's prefill on a GPU: where a long prefill's MoE layer and attention spend their time, what the
grouped kernels' options and tiles give, and the whole model's prefill against the matmul rate, in one command:

1. **attention**: the prefill's paged attention alone at --attention-tokens (32 query heads on 4 KV heads, head
   128, a shuffled block table), per block_q and config, with the heavy-tiles-first order and the mask-free loop
   (``triton_paged.HEAVY_FIRST``, ``FREE_LOOP``) each on and off; checked against the torch reference;
2. **tiles** (``--sweep-tokens``, none by default): gate/up and down swept apart (each kernel timed alone) for
   each row block; the best pair against ``tiles_for``'s;
3. **layer**: one MoE layer (128 experts, 8 a token, hidden 2048, expert intermediate 768, bf16, random weights)
   at each of --tokens: the routing and grouping (``route_group_wide``, and torch's sort-based grouping beside
   it), gate/up, down and the sum of a token's slots, each timed alone by CUDA events; the layer as it was before
   (torch's grouping, the product in slot order, masked loads, the tiles before the sweep) and as shipped;
   against the layer's FLOPs at the rate one 8k bf16 matmul reaches in the same run; and the down stage and the
   layer with the down launch's row blocks first (as before ``triton_moe.DOWN_COLS_FIRST_SLOTS``), bits checked;
4. **model**: the ``qwen3-30b-a3b`` preset's prefill of one sequence (as ``pushkv roofline`` times it) at
   --model-tokens: the tree before (``tree``), the MoE changes alone (attention, its query rows a tile and the
   q/k norm-RoPE-store as before), as shipped, and with the down launch's row blocks first; and a profile
   of the first length's prefill as shipped: kernels by GPU time.

    python3 -m experiments.moe_prefill_probe --out DIR    (from the checkout's root; ~4 min on an H200)

writes DIR/moe_prefill.json (every figure) and DIR/moe_prefill.md (the tables).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time

import torch

from pushkv.model.kernels import triton_fused, triton_moe, triton_paged
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


def torch_grouping(h, router, k, renorm, bm):
    """The grouping before route_group_wide: torch's routing and its sort-based grouping (group_slots)."""
    w, experts = route(h, router, k, renorm)
    slot_ids, block_expert = triton_moe.group_slots(experts, router.shape[0], bm)
    return w.flatten().contiguous(), experts, slot_ids, block_expert


def old_tiles(tokens: int):
    """tiles_for before the sweep of gate/up and down apart."""
    return Tiles(128, 128, 128, 64, 8, 3) if tokens >= 2048 else SHIPPED_TILES(tokens)


SHIPPED_TILES, SHIPPED_GROUPING = triton_moe.tiles_for, triton_moe.route_group_wide
SHIPPED_ROPE = triton_fused.qk_norm_rope_store
SHIPPED_COLS_FIRST = triton_moe.DOWN_COLS_FIRST_SLOTS


def tree(before: bool, attention_before: bool = False, fwd=None) -> None:
    """The kernels as they were before this probe's changes (True), or as shipped: the MoE layer's grouping,
    options, tiles and down launch order; attention's order, loop and (given the model's ``fwd``) query rows a tile;
    the q/k norm-RoPE-store's one token a program."""
    options(not before, not before)
    triton_moe.DOWN_COLS_FIRST_SLOTS = 0 if before else SHIPPED_COLS_FIRST
    triton_moe.tiles_for = old_tiles if before else SHIPPED_TILES
    triton_moe.route_group_wide = torch_grouping if before else SHIPPED_GROUPING
    old_attention = before or attention_before
    triton_paged.HEAVY_FIRST = triton_paged.FREE_LOOP = not old_attention
    triton_fused.qk_norm_rope_store = functools.partial(SHIPPED_ROPE, tokens_a_program=1) if old_attention \
        else SHIPPED_ROPE
    if fwd is not None:
        fwd.block_q = max(1, (128 if old_attention else 256 if fwd.group >= 8 else 128) // fwd.group)


def stages(h, layer, tiles: Tiles) -> dict:
    """Each step of the layer alone, in ms."""
    router, gate_up, down = layer
    T = h.shape[0]
    weights, _, slot_ids, block_expert = triton_moe.route_group_wide(h, router, K, True, tiles.bm)
    act = triton_moe.gate_up_product(h, gate_up, slot_ids, block_expert, K, tiles)
    per_slot = triton_moe.down_per_slot(act, down, weights, slot_ids, block_expert, T * K, tiles)
    used_rows = int((slot_ids < T * K).sum())
    blocks_used = int((block_expert >= 0).sum())

    def down_stage():
        return triton_moe.down_per_slot(act, down, weights, slot_ids, block_expert, T * K, tiles)

    with rows_first():  # the down launch with its row blocks first (as before triton_moe.DOWN_COLS_FIRST_SLOTS)
        down_rows_first = ms(down_stage)
    return {"route_group": ms(lambda: triton_moe.route_group_wide(h, router, K, True, tiles.bm)),
            "torch_route_group": ms(lambda: torch_grouping(h, router, K, True, tiles.bm)),
            "gate_up": ms(lambda: triton_moe.gate_up_product(h, gate_up, slot_ids, block_expert, K, tiles)),
            "down": ms(down_stage), "down_rows_first": down_rows_first,
            "sum": ms(lambda: per_slot.view(T, K, D).sum(dim=1)),
            "rows_padded_pct": round(100 * (blocks_used * tiles.bm - used_rows) / used_rows, 1)}


def attention(L: int, peak: float) -> list:
    """The prefill's attention alone at the model's shape (32 query heads on 4 KV heads, head 128, blocks of 16
    through a shuffled table), as shipped and with the heavy-first order and mask-free loop off, per block_q and
    config (block_n, warps, stages); each output checked against the torch reference."""
    import random

    from pushkv.messages import SeqWork
    from pushkv.model.kernels import paged
    from pushkv.model.step import StepTensors, plan_step

    kvh, G, hd, u = 4, 8, 128, 16
    nb = -(-L // u)
    table = list(range(nb))
    random.Random(0).shuffle(table)
    cache = torch.randn(nb, 2, kvh, u, hd, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(L, kvh * G, hd, dtype=torch.bfloat16, device="cuda")
    flops = 2 * L * L * kvh * G * hd
    rows = []
    for bq in (16, 8, 32):
        plan = plan_step([SeqWork(0, tuple(range(L)), 0, tuple(table))], u, bq)
        meta = StepTensors.upload(plan, torch.device("cuda"))
        want = paged.attention_ref(q.float(), cache.float(), meta.block_table, meta.seq_lens, meta.q_starts,
                                   meta.q_lens) if bq == 16 else None
        # (32, 8, 3): at 256 rows the one that does not spill on sm_90 (python3 -m tools.kernel_sass)
        for cfg in (None, (64, 8, 3), (128, 8, 2), (64, 4, 2), (32, 4, 3), (32, 8, 3)):
            for opts in ((True, True), (False, False), (True, False), (False, True)):
                if cfg is not None and opts != (True, True):
                    continue
                triton_paged.HEAVY_FIRST, triton_paged.FREE_LOOP = opts
                run = functools.partial(triton_paged.attention, q, cache, meta.block_table, meta.seq_lens,
                                        meta.q_starts, meta.q_lens, meta.prefill_tiles, meta.prefill_q0, bq,
                                        config=cfg)
                try:
                    t = _time(run, 5, warm=2)
                except Exception as e:  # out of shared memory etc.: said, not hidden
                    print(f"attention block_q {bq} config {cfg}: {type(e).__name__}", flush=True)
                    continue
                err = float((run().float() - want).abs().max()) if want is not None else None
                row = {"block_q": bq, "config": cfg, "heavy_first": opts[0], "free_loop": opts[1],
                       "ms": round(t * 1e3, 3), "tflops": round(flops / t / 1e12, 1),
                       "of_matmul": round(flops / t / peak, 3), "max_err": err}
                rows.append(row)
                print(json.dumps(row), flush=True)
    triton_paged.HEAVY_FIRST = triton_paged.FREE_LOOP = True
    return rows


def sweep(h, layer, peak: float) -> tuple[dict, list]:
    """gate/up and down tiles apart, per row block; (best Tiles per bm, every record)."""
    router, gate_up, down = layer
    T = h.shape[0]
    recs, best = [], {}
    for bm in ((64, 128) if T >= 2048 else (64,)):
        weights, _, slot_ids, block_expert = triton_moe.route_group_wide(h, router, K, True, bm)
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


@contextlib.contextmanager
def rows_first():
    """``triton_moe.DOWN_COLS_FIRST_SLOTS`` off (every grouped down launch's row blocks first) for the block, then as
    shipped."""
    shipped = triton_moe.DOWN_COLS_FIRST_SLOTS
    triton_moe.DOWN_COLS_FIRST_SLOTS = 0
    try:
        yield
    finally:
        triton_moe.DOWN_COLS_FIRST_SLOTS = shipped


def layer_ms(h, layer, tiles=None) -> float:
    router, gate_up, down = layer
    return ms(lambda: triton_moe.moe_mlp(h, router, gate_up, down, K, True, tiles, summed=False))


def bench_model(args, peak: float) -> dict:
    """The qwen3-30b-a3b prefill (one sequence), as pushkv roofline times it: the tree before this probe's
    changes, the MoE changes alone (attention as before), and as shipped; a profile of the first length."""
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
    out: dict = {"rows": []}
    for L in lengths:
        seqs = [SeqWork(0, tuple(range(L)), 0, tuple(range(-(-L // u))))]
        run = functools.partial(fwd.logits, seqs, views)
        fl = prefill_flops(c, L)
        row = {"tokens": L, "flops": fl}
        for name, before, attention_before in (("before", True, False), ("moe_only", False, True),
                                               ("shipped", False, False)):
            tree(before, attention_before, fwd)
            t = _time(run, 3, warm=1)
            row[name] = {"ms": round(t * 1e3, 2), "of_matmul": round(fl / t / peak, 3)}
        tree(False, fwd=fwd)
        with rows_first():
            t = _time(run, 3, warm=1)
        row["rows_first"] = {"ms": round(t * 1e3, 2), "of_matmul": round(fl / t / peak, 3)}
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
             "| tokens | FLOPs bound | route+group | (torch's) | gate/up | down | sum | padded rows | layer before | "
             "layer shipped | max rel. err | down, rows first | layer, rows first | same bits |", "| --- " * 14 + "|"]
    for r in rep["layer"]:
        s, cf = r["stages"], r.get("rows_first", {})
        lines.append(f"| {r['tokens']} | {r['bound_ms']:.3f} | {s['route_group']:.3f} | {s['torch_route_group']:.3f} | "
                     f"{s['gate_up']:.3f} | {s['down']:.3f} | {s['sum']:.3f} | {s['rows_padded_pct']} % | "
                     f"{r['before']:.3f} | {r['shipped']:.3f} | {r['max_rel_err']:.4f} | "
                     f"{s.get('down_rows_first', 0):.3f} | {cf.get('layer', 0):.3f} | {cf.get('same_bits', '')} |")
    lines += ["", "| attention block_q | config | heavy first | free loop | ms | TFLOP/s | of matmul |",
              "| --- " * 7 + "|"]
    lines += [f"| {a['block_q']} | {a['config'] or 'default'} | {a['heavy_first']} | {a['free_loop']} | {a['ms']} | "
              f"{a['tflops']} | {a['of_matmul']:.0%} |" for a in rep["attention"]]
    if rep.get("model"):
        lines += ["", "| prefill tokens | before ms (of matmul) | MoE changes only | shipped | down rows first |",
                  "| --- " * 5 + "|"]
        for r in rep["model"]["rows"]:
            lines.append(f"| {r['tokens']} | " + " | ".join(f"{r[k]['ms']} ({r[k]['of_matmul']:.0%})" if k in r else ""
                                                             for k in ("before", "moe_only", "shipped", "rows_first"))
                         + " |")
        lines += ["", "kernels of the first length's prefill, shipped (ms, count):"]
        lines += [f"- {p['ms']:.3f} x{p['count']} {p['kernel']}" for p in rep["model"]["profile"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--tokens", default="1024,4096,16384", help="layer: prefill lengths")
    ap.add_argument("--sweep-tokens", default="", help="lengths the tiles are swept at (none by default)")
    ap.add_argument("--attention-tokens", type=int, default=4096)
    ap.add_argument("--model-tokens", default="4096,1024,16384", help="whole model: prefill lengths (first profiled)")
    ap.add_argument("--no-model", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    peak = matmul_rate(torch.device("cuda"))
    rep: dict = {"gpu": torch.cuda.get_device_name(), "matmul_tflops": peak / 1e12, "layer": [], "sweep": [],
                 "best_tiles": {}}
    rep["attention"] = attention(args.attention_tokens, peak)
    layer = weights_of_layer(1)
    for T in [int(t) for t in args.sweep_tokens.split(",") if t]:
        h = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        best_by_bm, recs = sweep(h, layer, peak)
        rep["sweep"] += [{"tokens": T, **r} for r in recs]
        best_layer = {bm: layer_ms(h, layer, t) for bm, t in best_by_bm.items()}
        rep["best_tiles"][T] = list(best_by_bm[min(best_layer, key=best_layer.__getitem__)])
        print(f"best tiles at {T}: {rep['best_tiles'][T]} ({best_layer}; shipped {layer_ms(h, layer):.3f})",
              flush=True)
    for T in [int(t) for t in args.tokens.split(",")]:
        h = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        router, gate_up, down = layer
        ref = moe_mlp(h, router, gate_up, down, K, True).float()
        got = triton_moe.moe_mlp(h, router, gate_up, down, K, True)
        row = {"tokens": T, "bound_ms": flops_ms(T, peak), "stages": stages(h, layer, triton_moe.tiles_for(T)),
               "max_rel_err": float((ref - got.float()).abs().max() / ref.abs().max())}
        for name, before in (("before", True), ("shipped", False)):
            tree(before)
            row[name] = layer_ms(h, layer)
        tree(False)
        # the layer with the down launch's row blocks first (as before triton_moe.DOWN_COLS_FIRST_SLOTS; the down
        # stage alone is in the stages), and the same bits
        with rows_first():
            row["rows_first"] = {"layer": layer_ms(h, layer),
                                 "same_bits": bool(torch.equal(triton_moe.moe_mlp(h, router, gate_up, down, K, True),
                                                               got))}
        rep["layer"].append(row)
        print(json.dumps(row), flush=True)
    if not args.no_model:
        del layer
        torch.cuda.empty_cache()
        rep["model"] = bench_model(args, peak)
    with open(os.path.join(args.out, "moe_prefill.json"), "w") as f:
        json.dump(rep, f, indent=1)
    text = markdown(rep)
    with open(os.path.join(args.out, "moe_prefill.md"), "w") as f:
        f.write(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
