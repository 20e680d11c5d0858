"""MLA's decode attention kernel (pushkv/model/kernels/triton_mla.py) against its torch yardstick
(``paged.mla_decode_ref``, what the batched engine runs without it): under Triton's interpreter on the CPU (a
child process: TRITON_INTERPRET=1 must be set before Triton is imported), and on a GPU at DeepSeek-V2-Lite's
shapes in bf16.

Rows of several lengths, one longer than the splits' tiles and one of a single key, a padding row with no keys (a
CUDA graph's: 0), block tables in shuffled order, and the keys split over 1 and 3 programs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support import ROOT

pytest.importorskip("triton")

SCRIPT = r"""
import json, random, sys, torch
from pushkv.model.kernels import paged, triton_mla
args = json.loads(sys.argv[1])
dev, dtype = args["device"], getattr(torch, args["dtype"])
r, rd, H, u = args["rank"], args["rope"], args["heads"], 16
torch.manual_seed(0)
lens = args["lens"]
width = max(-(-n // u) for n in lens) + 1
blocks = len(lens) * width
cache = torch.randn(blocks, 1, 1, u, r + rd, device=dev).to(dtype)
order = list(range(blocks))
random.Random(1).shuffle(order)
table = torch.tensor([order[i * width:(i + 1) * width] for i in range(len(lens))], dtype=torch.int32, device=dev)
seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
tiles = torch.tensor(list(range(len(lens)))[::-1], dtype=torch.int32, device=dev)  # rows in another order
q = (torch.randn(len(lens), H, r + rd, device=dev) / 4).to(dtype)
scale = (r + rd) ** -0.5
want = paged.mla_decode_ref(q, cache, table, seq_lens, tiles, r, scale).float()
out = []
for splits in (1, 3):
    got = triton_mla.mla_decode(q, cache, table, seq_lens, tiles, r, scale, splits).float()
    out.append({"splits": splits, "err": float((got - want).abs().max()), "scale": float(want.abs().max()),
                "pad": float(got[lens[::-1].index(0)].abs().max()) if 0 in lens else 0.0})
print(json.dumps(out))
"""


def _run(args: dict, interpret: bool) -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1"} if interpret else dict(os.environ)
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(args)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=540)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.unit
@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernel itself (the test below)")
def test_mla_decode_kernel_equals_the_torch_path_under_the_interpreter():
    for rope in (16, 8):  # a RoPE part as wide as a dot takes, and one narrower (summed products)
        got = _run({"device": "cpu", "dtype": "float32", "rank": 64, "rope": rope, "heads": 20,
                    "lens": [70, 1, 0, 33, 16]}, interpret=True)
        assert [g["splits"] for g in got] == [1, 3]
        for g in got:
            assert g["err"] < 2e-5 * max(1.0, g["scale"]), (rope, g)
            assert g["pad"] == 0.0, g  # a row with no keys gives 0, not NaN


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, tol", [("bfloat16", 2e-2), ("float32", 2e-5)])
def test_mla_decode_kernel_equals_the_torch_path_on_the_gpu(dtype, tol):
    """DeepSeek-V2-Lite's latent (512 + 64) and 16 heads; V3's 128 heads a rank take 4 head blocks."""
    for heads in (16, 128):
        got = _run({"device": "cuda", "dtype": dtype, "rank": 512, "rope": 64, "heads": heads,
                    "lens": [4100, 1, 0, 513, 64, 2047]}, interpret=False)
        for g in got:
            assert g["err"] < tol * max(1.0, g["scale"]), (heads, g)
            assert g["pad"] == 0.0, g
