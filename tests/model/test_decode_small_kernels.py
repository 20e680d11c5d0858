"""A decode step's small kernels reading what no kernel of the step writes before they wait for the kernel before
them, against the same kernel reading it after, bit for bit: under Triton's interpreter on the CPU
(TRITON_INTERPRET=1, set in a child process before Triton is imported) and on a GPU. ``triton_fused.ROUTER_EARLY``:
``add_rms_router``'s router rows (on). Reading the RoPE kernel's constants early was also built and taken out: on a
GPU it changed the bits of a prefill's rows (docs/results/2026-12-05-small-kernels)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = r"""
import json, sys, torch
from pushkv.model.kernels import triton_fused

args = json.loads(sys.argv[1])
dev = torch.device(args["device"])
checked = {}


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# 1. the router's rows
for d, E, dtype in args["router"]:
    dt = getattr(torch, dtype)
    torch.manual_seed(d + E)
    x, delta = torch.randn(1, d, device=dev).to(dt), torch.randn(1, d, device=dev).to(dt)
    nw, router = torch.randn(d, device=dev).to(dt), torch.randn(E, d, device=dev).to(dt)
    got = []
    for on in (False, True):
        triton_fused.ROUTER_EARLY = on
        got.append(triton_fused.add_rms_router(x, delta, nw, 1e-6, router))
    for a, b in zip(*got):
        assert same(a, b), (d, E, dtype)
    checked["router"] = checked.get("router", 0) + 1

print("ok", json.dumps(checked))
"""


def _run(args: dict) -> dict:
    env = {**os.environ}
    if args["device"] == "cpu":
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(args)], capture_output=True, text=True, env=env,
                       timeout=900)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0 and last.startswith("ok"), r.stderr[-3000:]
    return json.loads(last[3:])


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernels themselves (the test below)")
def test_early_reads_give_the_same_bits_under_the_interpreter():
    checked = _run({"device": "cpu", "router": [[64, 8, "float32"], [32, 6, "bfloat16"]]})
    assert checked == {"router": 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_early_reads_give_the_same_bits():
    """The same at Qwen3-30B-A3B's shapes (128 experts over 2048) and a smaller one, bf16 and float32."""
    checked = _run({"device": "cuda", "router": [[2048, 128, "bfloat16"], [2048, 128, "float32"],
                                                 [1024, 60, "float32"]]})
    assert checked == {"router": 3}
