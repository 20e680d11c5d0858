"""The CUDA checksum kernel (model/kernels/triton_checksum.py) equals the torch reference
(kv/checksum.py) bit for bit, and D's check on the sums' device (``checksum.verify``) answers
as the host reference (``compare``): on the CPU under Triton's interpreter (a child process:
the switch is read at import), and on a GPU when there is one."""
import json
import os
import subprocess
import sys

import pytest
import torch

# (model, dtype, tp, rank, block size, sub-block, head group, prompt tokens, layer groups)
CASES = [
    ("small", "float32", 2, 1, 32, 16, 1, 61, 0),  # head groups of one head, sub-blocks of 16
    ("hybrid", "bfloat16", 1, 0, 16, 8, 0, 100, 0),  # a window group
    ("mla", "bfloat16", 1, 0, 16, 16, 0, 45, 0),
    ("small", "bfloat16", 1, 0, 16, 0, 0, 90, 3),  # layer-streamed push's groups: 1, 2 and 1 layers
]

SCRIPT = r"""
import json, sys, torch
from pushkv.config import preset
from pushkv.kv import checksum as C, layout as L
from pushkv.model.kernels import triton_checksum as K
dev = sys.argv[1]
out = []
for name, dtype, tp, rank, bs, sub, hg, n, split in json.loads(sys.argv[2]):
    lay = L.layout_for(preset(name, dtype=dtype), tp, rank, 12, bs, sub, hg, layer_split=split)
    pool = torch.empty(L.pool_bytes(lay) // lay.dtype_bytes, dtype=getattr(torch, dtype), device=dev)
    pool.view(torch.int16 if lay.dtype_bytes == 2 else torch.int32).random_(-30000, 30000)
    views = L.layer_views(pool, lay)
    table = [7, 2, 9, 4, 11, 0, 5][:L.blocks_for(n, bs)]
    for mode in ("full", "sample"):
        units = C.plan_units(mode, n, bs, salt=3)
        ref = C.unit_sums(views, lay, table, n, units, bs)
        got = K.unit_sums(views, lay, table, n, units, bs)
        equal = bool(torch.equal(ref.cpu(), got.cpu()))
        # D's check where the sums are gives the host reference's answer, clean and damaged
        exp = C.to_wire(lay, ref, units, bs, n)
        answers = []
        for damage in (False, True):
            if damage:
                got[-1, -1, -1] += 1
            answers.append((C.verify(lay, exp, got), C.compare(lay, exp, C.to_wire(lay, got, units, bs, n))))
        (clean, clean_ref), (bad, bad_ref) = answers
        verified = clean == clean_ref and clean[0] == "" and bad == bad_ref and "mismatch" in bad[0]
        out.append([name, mode, equal, bool((ref != 0).any()), verified])
print(json.dumps(out))
"""


def _run(device: str, env: dict) -> list:
    r = subprocess.run([sys.executable, "-c", SCRIPT, device, json.dumps(CASES)], env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check(rows: list) -> None:
    assert len(rows) == 2 * len(CASES)
    for name, mode, equal, nonzero, verified in rows:
        assert equal, (name, mode)
        assert nonzero, (name, mode)
        assert verified, (name, mode)


def test_kernel_equals_torch_under_interpreter():
    pytest.importorskip("triton")
    _check(_run("cpu", {**os.environ, "TRITON_INTERPRET": "1"}))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_equals_torch_on_gpu():
    _check(_run("cuda", dict(os.environ)))
