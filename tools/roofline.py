"""pushkv roofline: the batched engine's decode and prefill steps against their hardware bounds.

Measures, in the same run on the same GPU: the device copy bandwidth (bytes read +
written per second by a large device-to-device copy) and the bf16 matmul throughput
(8192^3), then times the model's steps and prints each against the bound it would
have at those rates:
- decode, batch B over context C: bound = max(bytes / bandwidth, flops / matmul rate),
  bytes = every weight once (of the embedding, the B rows looked up) + B x C tokens of
  KV (+ the new K/V), flops = 2 x
  non-embedding params x B + attention; for a mixture of experts, of the experts'
  weights only those of the experts the step's routing chose (counted per layer on the
  step's own tokens, one eager step), and each token's FLOPs through its k experts;
- prefill of L tokens: achieved TFLOP/s (matmuls, a token's k experts for a mixture of
  experts, and causal attention) against the measured matmul rate.
Decode runs through the CUDA graphs the worker uses, and eager for comparison; the fused attention's plans
for whole prompts are built first, as the worker does at start-up. ``--set batched.SDPA_PROMPT_TOKENS=0`` holds a
setting of a ``pushkv.model`` module (``module.NAME``; a bare NAME is triton_moe's) for the run: the shipped
tree beside one setting changed.
Cells whose KV does not fit the free memory are skipped (said so, not hidden).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import time

import torch

from pushkv.config import preset
from pushkv.messages import SeqWork
from pushkv.model.build import build_model
from pushkv.model.moe import route


def model_setting(name: str):
    """(module, attribute) a setting names: ``NAME`` of ``pushkv.model.kernels.triton_moe``, or ``module.NAME``
    under ``pushkv.model`` (``batched.SDPA_PROMPT_TOKENS``, ``kernels.paged.FRESH_BACKEND``)."""
    mod, _, attr = name.rpartition(".")
    owner = importlib.import_module(f"pushkv.model.{mod or 'kernels.triton_moe'}")
    if not hasattr(owner, attr):
        raise SystemExit(f"pushkv roofline: {owner.__name__} has no setting {attr}")
    return owner, attr


def setting_value(v: str):
    """An integer where the text is one, else the text."""
    return int(v) if v.lstrip("-").isdigit() else v


def copy_bandwidth(dev, nbytes=4 << 30, reps=10) -> float:
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    return 2 * nbytes / _time(lambda: b.copy_(a), reps)


def matmul_rate(dev, n=8192, reps=10) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    return 2 * n ** 3 / _time(lambda: a @ b, reps)


def _time(fn, reps: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / reps


def model_counts(model) -> dict:
    """Parameter and byte counts of a built model. ``matmul_params``: what every token multiplies
    through (attention, the router, a dense MLP); ``expert_params``: one expert of one layer (0 for a
    dense model), of which a token goes through ``experts_per_token`` a layer."""
    cfg, w = model.cfg, model.w
    dense = sum(t.numel() for lw in w.layers for t in (lw.qkv, lw.o))
    experts = sum(lw.gate_up.numel() + lw.down.numel() for lw in w.layers)
    if cfg.is_moe:
        dense += sum(lw.router.numel() for lw in w.layers)
        expert_params = experts // (cfg.num_experts * len(w.layers))
    else:
        dense += experts
        expert_params = 0
    head = w.lm_head.numel()
    embed = 0 if w.embed is w.lm_head else w.embed.numel()
    item = model.dtype.itemsize
    return dict(matmul_params=dense, head_params=head, embed_params=embed, hidden=cfg.hidden_size,
                expert_params=expert_params,
                moe_layers=len(w.layers) if cfg.is_moe else 0, num_experts=cfg.num_experts,
                experts_per_token=cfg.experts_per_token, itemsize=item,
                weight_bytes=(dense + head + embed + expert_params * cfg.num_experts * len(w.layers)) * item,
                kv_bytes_per_token=cfg.kv_bytes_per_token(),
                attn_width=cfg.num_layers * cfg.num_heads * cfg.head_dim)


def decode_bytes(c: dict, B: int, ctx: int, experts_read: int = 0) -> int:
    """Bytes a decode step reads at least: the weights every token uses, the B rows of the embedding it
    looks up (an untied one: a tied one is read whole as the lm_head), the ``experts_read`` experts
    (summed over layers) its routing chose, the KV."""
    if c["moe_layers"] and experts_read < c["moe_layers"] * c["experts_per_token"]:
        raise ValueError(f"experts_read={experts_read}: a mixture of experts reads at least k = "
                         f"{c['experts_per_token']} experts in each of its {c['moe_layers']} layers")
    rows = B * c["hidden"] if c["embed_params"] else 0
    weights = c["matmul_params"] + c["head_params"] + rows + experts_read * c["expert_params"]
    return weights * c["itemsize"] + B * (ctx + 1) * c["kv_bytes_per_token"]


def token_params(c: dict) -> int:
    """The matmul parameters one token goes through (its k experts a layer, not every expert)."""
    return c["matmul_params"] + c["moe_layers"] * c["experts_per_token"] * c["expert_params"]


def decode_bound(c: dict, B: int, ctx: int, bw: float, rate: float, experts_read: int = 0) -> float:
    flops = 2 * (token_params(c) + c["head_params"]) * B + 4 * B * (ctx + 1) * c["attn_width"]
    return max(decode_bytes(c, B, ctx, experts_read) / bw, flops / rate)


def prefill_flops(c: dict, L: int) -> float:
    return 2 * token_params(c) * L + 2 * c["head_params"] + 2 * L * L * c["attn_width"]


def chosen_experts(model, run) -> list[int]:
    """The experts each MoE layer's routing chose in one step, ``run()`` (eager: a graph replay runs no
    Python), counted as the union over the layer's calls (the per-sequence engine calls it once a
    sequence); one count a layer, in order."""
    chosen: dict[int, set] = {}
    real = model.mlp_delta
    cfg = model.cfg

    def counting(lw, h, summed: bool = True, logits=None):
        if lw.router is not None:
            picked = route(h, lw.router, cfg.experts_per_token, cfg.norm_topk_prob)[1]
            chosen.setdefault(id(lw), set()).update(picked.flatten().tolist())
        return real(lw, h, summed, logits)

    model.mlp_delta = counting
    try:
        run()
    finally:
        del model.mlp_delta  # the class's method again
    return [len(v) for v in chosen.values()]


def plot(json_path: str, out_png: str) -> None:
    """Decode step time against its bound per (batch, context), and prefill TFLOP/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        res = json.load(f)
    dec = [r for r in res["rows"] if r["kind"] == "decode"]
    pre = [r for r in res["rows"] if r["kind"] == "prefill"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ctx in sorted({r["ctx"] for r in dec}):
        rs = [r for r in dec if r["ctx"] == ctx]
        line, = a.plot([r["batch"] for r in rs], [r["graph_s"] * 1e3 for r in rs], "o-", label=f"{ctx} ctx")
        a.plot([r["batch"] for r in rs], [r["bound_s"] * 1e3 for r in rs], "--", color=line.get_color())
    a.set(xscale="log", xlabel="decode batch", ylabel="step ms", title="decode step (solid) vs bound (dashed)")
    a.legend()
    b.bar([str(r["tokens"]) for r in pre], [r["flops"] / r["s"] / 1e12 for r in pre])
    b.axhline(res["matmul_flops"] / 1e12, color="k", ls="--", label="measured bf16 matmul")
    b.set(xlabel="prefill tokens", ylabel="TFLOP/s", title="prefill throughput")
    b.legend()
    fig.suptitle(f"{res['model']} on {res['gpu']}: copy {res['copy_Bps'] / 1e9:.0f} GB/s, "
                 f"matmul {res['matmul_flops'] / 1e12:.0f} TFLOP/s (measured in the same run)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


def load(name: str, max_num_seqs: int, block_size: int = 16, mem_frac: float = 0.85):
    """(config, model, per-layer pool views, blocks) of preset ``name`` with random weights on the GPU and a
    pool of ``mem_frac`` of the memory left, filled with random K/V."""
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    cfg = preset(name)
    model = build_model(cfg, device="cuda", max_num_seqs=max_num_seqs)
    torch.cuda.synchronize()
    print(f"{name}: weights drawn on the device in {time.perf_counter() - t0:.1f}s", flush=True)
    lay = model.kv_layout(1, block_size)
    per_block = block_size * model_counts(model)["kv_bytes_per_token"]
    nblocks = int(torch.cuda.mem_get_info(dev)[0] * mem_frac) // per_block
    pool = torch.empty(nblocks, lay.num_layers, 2, lay.kv_heads, block_size, lay.head_dim, dtype=model.dtype,
                       device=dev)
    pool.normal_()
    return cfg, model, model._layer_pools(pool), nblocks


def decode_seqs(cfg, B: int, ctx: int, u: int) -> list[SeqWork]:
    """A decode step of B sequences of ctx keys each (blocks apart); their tokens apart, so a mixture of
    experts routes the sequences as a batch of users would."""
    nb = -(-(ctx + 1) // u)
    return [SeqWork(i, ((1 + 7 * i) % cfg.vocab_size,), ctx, tuple(range(i * nb, (i + 1) * nb))) for i in range(B)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pushkv roofline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 32, 64])
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 8192, 16384])
    ap.add_argument("--prefills", nargs="+", type=int, default=[1024, 4096, 8192, 16384])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--mem-frac", type=float, default=0.85, help="of free memory the pool may take")
    ap.add_argument("--out", help="JSON results")
    ap.add_argument("--plot", metavar="JSON", help="only plot a saved JSON (to --png) and exit")
    ap.add_argument("--png", default="roofline.png")
    ap.add_argument("--set", nargs="*", default=[], metavar="SETTING=VALUE",
                    help="a pushkv.model module's setting held for the run (batched.SDPA_PROMPT_TOKENS=0)")
    args = ap.parse_args(argv)
    if args.plot:
        plot(args.plot, args.png)
        return 0
    for held in args.set:
        key, value = held.split("=", 1)
        setattr(*model_setting(key), setting_value(value))
        print(f"held: {key} = {value}", flush=True)
    dev = torch.device("cuda")
    bw, rate = copy_bandwidth(dev), matmul_rate(dev)
    print(f"{torch.cuda.get_device_name(dev)}: copy {bw / 1e9:.0f} GB/s (read+write), "
          f"bf16 matmul {rate / 1e12:.0f} TFLOP/s (8192^3), torch {torch.__version__}", flush=True)
    cfg, model, views, nblocks = load(args.model, max(args.batches), args.block_size, args.mem_frac)
    c = model_counts(model)
    u = args.block_size
    fwd = model.batched
    print(f"pool: {nblocks} blocks of {u} tokens ({nblocks * u * c['kv_bytes_per_token'] / 2**30:.0f} GiB); "
          f"warm-up {fwd.warmup(views):.1f}s, graphs {fwd.capture(views):.1f}s for {sorted(fwd.graphs)}, "
          f"fused attention's plans {fwd.warm_fresh(max(args.prefills, default=0)):.1f}s", flush=True)
    rows = []
    print(f"\n{'decode':>8} {'batch':>5} {'ctx':>6} {'graph ms':>9} {'eager ms':>9} {'bound ms':>9} "
          f"{'x bound':>8} {'GB/s':>6}")
    for ctx in args.contexts:
        for B in args.batches:
            nb = -(-(ctx + 1) // u)
            if B * nb > nblocks:
                print(f"{'':>8} {B:>5} {ctx:>6} skipped: needs {B * nb} blocks, pool has {nblocks}")
                continue
            run = functools.partial(fwd.logits, decode_seqs(cfg, B, ctx, u), views)
            fwd.use_graphs = True
            g = _time(run, args.reps)
            fwd.use_graphs = False
            e = _time(run, max(3, args.reps // 3), warm=1)
            read = sum(chosen_experts(model, run)) if cfg.is_moe else 0
            fwd.use_graphs = True
            bound = decode_bound(c, B, ctx, bw, rate, read)
            moved = decode_bytes(c, B, ctx, read)
            rows.append(dict(kind="decode", batch=B, ctx=ctx, graph_s=g, eager_s=e, bound_s=bound, experts_read=read))
            print(f"{'':>8} {B:>5} {ctx:>6} {g * 1e3:>9.2f} {e * 1e3:>9.2f} {bound * 1e3:>9.2f} "
                  f"{g / bound:>8.2f} {moved / g / 1e9:>6.0f}", flush=True)
    print(f"\n{'prefill':>8} {'tokens':>6} {'ms':>9} {'TFLOP/s':>8} {'of matmul':>9}")
    for L in args.prefills:
        nb = -(-L // u)
        if nb > nblocks:
            continue
        seqs = [SeqWork(0, tuple(range(L)), 0, tuple(range(nb)))]
        # ten timed prefills at least: with three, one slow prefill (87 ms among 73s at 4k on an H100) moved the mean
        t = _time(functools.partial(fwd.logits, seqs, views), max(10, args.reps // 3), warm=1)
        fl = prefill_flops(c, L)
        rows.append(dict(kind="prefill", tokens=L, s=t, flops=fl, matmul_rate=rate))
        print(f"{'':>8} {L:>6} {t * 1e3:>9.1f} {fl / t / 1e12:>8.0f} {fl / t / rate:>9.0%}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=args.model, gpu=torch.cuda.get_device_name(dev), copy_Bps=bw, matmul_flops=rate,
                           counts=c, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
