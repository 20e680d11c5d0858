"""The architectures of pushkv/model/arch.py on a GPU (docs/running.md#models).

1. float32: each architecture's tiny random checkpoint (written by transformers, as
   tests/model/test_architectures.py writes them) run by the batched engine on CUDA (Triton paged
   attention, fused norm/RoPE/store kernels, CUDA graphs where the model allows) gives transformers'
   greedy tokens (transformers on the CPU, float32).
2. bfloat16: a push deployment on the GPU gives the tokens a local deployment gives, per family named.

    python3 -m experiments.models_gpu --out DIR [--push qwen2 qwen3_moe]   (from the checkout's root)

A case named ``NAME-fp8`` (``--cases qwen3_moe-fp8``, ``--push llama3-fp8``) is the case's checkpoint quantized
to block-scaled fp8, which pushkv dequantizes at load and transformers too.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch


def checkpoint(name: str, seed: int) -> str:
    """A case of tests/model/test_architectures.py written by transformers; ``NAME-fp8``: the same, its projections
    then quantized to block-scaled fp8 (16 x 32 blocks) as the FP8 releases are (tests/model/test_fp8_checkpoint.py)."""
    from tests.model.test_fp8_checkpoint import quantize_checkpoint
    from tests.model.test_hf_reference import save_hf_checkpoint

    base = name.removesuffix("-fp8")
    family, extra, _ = cases()[base]
    path = save_hf_checkpoint(tempfile.mkdtemp(prefix=name), family, seed=seed, **extra)
    if name != base:
        quantize_checkpoint(path, (16, 32))
    return path


def cases() -> dict:
    """Every case of tests/model/test_architectures.py, and tests/model/test_deepseek.py's as ``deepseek-NAME``."""
    from tests.model.test_architectures import CASES
    from tests.model.test_deepseek import CASES as DEEPSEEK

    return {**CASES, **{f"deepseek-{k}": v for k, v in DEEPSEEK.items()}}


def engine_vs_transformers(cases: list[str]) -> list[dict]:
    from pushkv.model import build_model
    from pushkv.model.checkpoint import model_config_from_hf
    from tests.model.test_architectures import NEW
    from tests.model.test_hf_reference import PROMPTS, hf_reference
    from tests.model.test_model import paged_generate

    rows = []
    for name in cases:
        path = checkpoint(name, seed=3)
        want = hf_reference(path, PROMPTS)
        cfg = model_config_from_hf(path, engine="batched")
        model = build_model(cfg, device="cuda")
        lay = model.kv_layout(8, 16)
        ok = 0
        for ids, new in want:
            pool = torch.full((8, lay.num_layers, lay.kv_planes, lay.kv_heads, 16, lay.head_dim), float("nan"),
                              dtype=model.dtype, device="cuda")
            got = paged_generate(model, pool, ids, NEW, tuple(range(8)))
            stop = got.index(3) + 1 if 3 in got else len(got)
            ok += got[:stop] == new
        rows.append({"case": name, "architecture": cfg.architecture, "prompts_equal": ok, "prompts": len(want),
                     "graphs": bool(model.batched.use_graphs), "fused": bool(model.batched.fused),
                     "mla": cfg.is_mla})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def push_vs_local(families: list[str]) -> list[dict]:
    from tools.launch import launched

    prompts = ["hello world, the lazy fox", [(7 * i) % 290 + 4 for i in range(200)], [5, 17, 42, 99, 3, 250]]
    rows = []
    for name in families:
        path = checkpoint(name, seed=5)
        got = {}
        for mode in ("local", "push"):
            t0 = time.monotonic()
            with launched("--mode", mode, "--model", path, "--dtype", "bfloat16", "--device", "cuda",
                          "--num-blocks", "256", start_timeout_s=300) as dep:
                up = time.monotonic() - t0
                got[mode] = [dep.tokens(p, 16) for p in prompts]
            print(f"{name} {mode}: up in {up:.0f} s", flush=True)
        rows.append({"case": name, "dtype": "bfloat16", "push_equals_local": got["push"] == got["local"],
                     "tokens": got})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", nargs="*", default=None,
                    help="default: every case of the CPU tests (DeepSeek's as deepseek-NAME), and llama3-fp8 and "
                         "qwen3_moe-fp8")
    ap.add_argument("--push", nargs="*", default=["qwen2", "qwen3_moe", "qwen3_moe-fp8", "qwen2_moe", "deepseek-v3"])
    args = ap.parse_args()

    out = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    out["engine_float32"] = engine_vs_transformers(args.cases or sorted(cases()) + ["llama3-fp8", "qwen3_moe-fp8"])
    out["push_bfloat16"] = push_vs_local(args.push)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "models_gpu.json"), "w") as f:
        json.dump(out, f, indent=1)
    bad = [r for r in out["engine_float32"] if r["prompts_equal"] != r["prompts"]]
    bad += [r for r in out["push_bfloat16"] if not r["push_equals_local"]]
    print("ALL EQUAL" if not bad else f"MISMATCH: {[r['case'] for r in bad]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
