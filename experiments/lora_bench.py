"""What a LoRA adapter costs a step on the GPU, measured side by side in one run: decode steps of a preset shape
(random weights on the device) with every sequence through a rank-R adapter on all seven projections, half of them
through it, and none, each replayed from its CUDA graph and run eagerly, and a prefill with and without it; then the
adapted steps again with their deltas in torch's three launches a projection instead of the two Triton kernels
(``lora.KERNELS`` off: kernels/triton_lora.py), side by side.

    python3 -m experiments.lora_bench --model qwen3-8b --rank 16 --batches 1 8 32 --out DIR

Prints one line per batch (ms, and each against the base model's eager and graph steps) and writes DIR/lora.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import typing

import msgspec
import torch

from pushkv.config import LoraConfig, LoraModule, preset
from pushkv.kinds import MaxLoraRank
from pushkv.messages import SeqWork
from pushkv.model import lora
from pushkv.model.build import build_model
from pushkv.model.lora_files import mlp_width
from tools.roofline import _time, decode_seqs, model_counts

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(cfg, path: str, rank: int) -> str:
    """A random rank-``rank`` PEFT adapter of ``cfg``'s every projection at ``path``."""
    from safetensors.torch import save_file

    d, hd, inter = cfg.hidden_size, cfg.head_dim, mlp_width(cfg)
    shapes = {"q_proj": (d, cfg.num_heads * hd), "k_proj": (d, cfg.num_kv_heads * hd),
              "v_proj": (d, cfg.num_kv_heads * hd), "o_proj": (cfg.num_heads * hd, d),
              "gate_proj": (d, inter), "up_proj": (d, inter), "down_proj": (inter, d)}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg.num_layers):
        for mod in MODULES if not cfg.is_moe else MODULES[:4]:
            block = "self_attn" if mod in MODULES[:4] else "mlp"
            fan_in, fan_out = shapes[mod]
            key = f"base_model.model.model.layers.{layer}.{block}.{mod}"
            tensors[key + ".lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * 0.01).bfloat16()
            tensors[key + ".lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).bfloat16()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none"}, f)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--rank", type=int, default=16, choices=typing.get_args(MaxLoraRank))  # --max-lora-rank's
    ap.add_argument("--adapters", type=int, default=1, help="adapters the bank holds (copies of the one written); "
                    "the steps run through the first")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=".")
    ap.add_argument("--profile", action="store_true", help="then a batch-1 adapted graph replay's kernels, base and "
                    "adapted (what each kernel adds a layer), and the delta kernels' tiles swept at batches 1 and 8")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    cfg = preset(args.model)
    path = write_adapter(cfg, tempfile.mkdtemp(prefix="lora-bench-"), args.rank)
    mods = tuple(LoraModule(f"a{i}", path) for i in range(args.adapters))
    cfg = msgspec.structs.replace(cfg, lora=LoraConfig(True, mods, max_loras=1, max_rank=args.rank))
    model = build_model(cfg, device="cuda", max_num_seqs=max(args.batches))
    u = 16
    lay = model.kv_layout(1, u)
    per_block = u * model_counts(model)["kv_bytes_per_token"]
    nblocks = int(torch.cuda.mem_get_info(dev)[0] * 0.5) // per_block
    pool = torch.empty(nblocks, lay.num_layers, 2, lay.kv_heads, u, lay.head_dim, dtype=model.dtype, device=dev)
    pool.normal_()
    views = model._layer_pools(pool)
    fwd = model.batched
    print(f"{torch.cuda.get_device_name(dev)}, {args.model}, {args.adapters} adapter(s) of rank {args.rank} on "
          f"{'q/k/v/o' if cfg.is_moe else 'q/k/v/o/gate/up/down'}, context {args.context}; warm-up "
          f"{fwd.warmup(views):.1f}s, graphs {fwd.capture(views):.1f}s", flush=True)

    def step(seqs):
        return model.logits(seqs, views)

    rows = []
    print(f"{'batch':>5} {'base graph':>10} {'base eager':>10} {'half graph':>10} {'all graph':>9} "
          f"{'all eager':>9} {'all/base (graphs)':>17} {'all/base (eager)':>16}")
    for B in args.batches:
        base = decode_seqs(cfg, B, args.context, u)
        half = [msgspec.structs.replace(s, lora=1 if i % 2 else 0) for i, s in enumerate(base)]
        every = [msgspec.structs.replace(s, lora=1) for s in base]
        fwd.use_graphs = True
        graph = _time(functools.partial(step, base), args.reps)
        mixed = _time(functools.partial(step, half), args.reps)
        full = _time(functools.partial(step, every), args.reps)
        fwd.use_graphs = False
        eager = _time(functools.partial(step, base), args.reps)
        full_eager = _time(functools.partial(step, every), args.reps)
        fwd.use_graphs = True
        rows.append(dict(batch=B, graph_s=graph, eager_s=eager, half_graph_s=mixed, all_graph_s=full,
                         all_eager_s=full_eager))
        print(f"{B:>5} {graph * 1e3:>10.2f} {eager * 1e3:>10.2f} {mixed * 1e3:>10.2f} {full * 1e3:>9.2f} "
              f"{full_eager * 1e3:>9.2f} {full / graph:>17.2f} {full_eager / eager:>16.2f}", flush=True)
    lora.KERNELS = False  # the deltas in torch's form: graphs captured again with it
    fwd.drop_graphs()
    print(f"{'batch':>5} {'all graph, torch form':>21} {'all graph, kernels':>18} {'torch / kernels':>15}")
    for row in rows:
        every = [msgspec.structs.replace(s, lora=1) for s in decode_seqs(cfg, row["batch"], args.context, u)]
        row["all_graph_torch_s"] = _time(functools.partial(step, every), args.reps)
        print(f"{row['batch']:>5} {row['all_graph_torch_s'] * 1e3:>21.2f} {row['all_graph_s'] * 1e3:>18.2f} "
              f"{row['all_graph_torch_s'] / row['all_graph_s']:>15.2f}", flush=True)
    lora.KERNELS = None
    fwd.drop_graphs()
    if args.profile:
        profile(cfg, step, fwd, rows, u, args)
    nb = -(-args.prefill // u)
    one = SeqWork(0, tuple(range(args.prefill)), 0, tuple(range(nb)))
    pre = _time(functools.partial(step, [one]), 3, warm=1)
    pre_lora = _time(functools.partial(step, [msgspec.structs.replace(one, lora=1)]), 3, warm=1)
    print(f"prefill of {args.prefill}: {pre * 1e3:.1f} ms, through the adapter {pre_lora * 1e3:.1f} ms "
          f"({pre_lora / pre:.2f}x)", flush=True)
    with open(os.path.join(args.out, "lora.json" if args.adapters == 1 else f"lora_{args.adapters}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(dev), model=args.model, rank=args.rank, adapters=args.adapters,
                       context=args.context, decode=rows, prefill=dict(tokens=args.prefill, base_s=pre,
                                                                          lora_s=pre_lora)), f, indent=1)
    return 0


def profile(cfg, step, fwd, rows, u, args) -> None:
    """The batch-1 step's kernels through the base and the adapted graphs (what each adds a layer: its end less the
    end before it), then the delta kernels' tiles swept (kernels/triton_lora.py's PROGRAMS and BO)."""
    from experiments.moe_decode_probe import profile_step
    from pushkv.model.kernels import triton_lora

    one = decode_seqs(cfg, 1, args.context, u)
    for name, seqs in (("base", one), ("adapted", [msgspec.structs.replace(s, lora=1) for s in one])):
        prof = profile_step(functools.partial(step, seqs), cfg.num_layers)
        print(f"batch 1, {name}: span {prof['span_us_a_layer']} us a layer, kernels busy {prof['busy_us_a_layer']}")
        for k in prof["added_us_a_layer"][:14]:
            print(f"  {k['us']:>7.2f} us  {k['kernel']}")
        rows.append({"profile": name, **prof})
    shipped = triton_lora.PROGRAMS, triton_lora.BO, triton_lora.BN
    for programs in (16, 64, 128, 256):
        for bo in (32, 64, 128):
            for bn in (16, 32):
                triton_lora.PROGRAMS, triton_lora.BO, triton_lora.BN = programs, bo, bn
                fwd.drop_graphs()
                got = {B: _time(functools.partial(step, [msgspec.structs.replace(s, lora=1) for s in
                                                         decode_seqs(cfg, B, args.context, u)]), args.reps)
                       for B in (1, 8)}
                rows.append({"programs": programs, "bo": bo, "bn": bn, **{f"b{B}_s": t for B, t in got.items()}})
                print(f"PROGRAMS {programs:>3} BO {bo:>3} BN {bn:>2}: batch 1 {got[1] * 1e3:.2f} ms, "
                      f"batch 8 {got[8] * 1e3:.2f} ms", flush=True)
    triton_lora.PROGRAMS, triton_lora.BO, triton_lora.BN = shipped
    fwd.drop_graphs()


if __name__ == "__main__":
    raise SystemExit(main())
