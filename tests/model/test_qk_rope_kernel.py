"""The fused q/k norm, RoPE and K/V store (``triton_fused.qk_norm_rope_store``) on the CPU under Triton's
interpreter (TRITON_INTERPRET=1, in a child process): one head of 8 tokens a program (a prefill's launch) gives
bit for bit what one token a program gives (a decode step's), both equal a torch reference, and a token whose
slot is -1 stores nothing."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from pushkv.model.kernels import triton_fused as K
torch.manual_seed(0)
T, Hq, Hk, D, U, eps = 19, 4, 2, 32, 4, 1e-6
for dt in (torch.float32, torch.bfloat16):
    qkv = torch.randn(T, (Hq + 2 * Hk) * D).to(dt)
    qn, kn = torch.rand(D).to(dt) + 0.5, torch.rand(D).to(dt) + 0.5
    ang = torch.arange(64)[:, None] * (0.1 + torch.arange(D) / D)[None, :]
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    pos = torch.randperm(64)[:T]
    slots = torch.randperm(T + 5)[:T].to(torch.int32)
    slots[3] = slots[11] = -1
    outs = []
    for tb in (1, 8):
        cache = torch.zeros(8, 2, Hk, U, D, dtype=dt)
        q = K.qk_norm_rope_store(qkv, Hq, Hk, D, qn, kn, eps, cos, sin, pos, slots, cache, tokens_a_program=tb)
        outs.append((q, cache))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), dt
    x = qkv.view(T, Hq + 2 * Hk, D).float()

    def normed(x, w):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return ((x * r).to(dt).float() * w.float()).to(dt).float()

    def rope(x):
        h = D // 2
        c, s = cos[pos, :h].float()[:, None], sin[pos, :h].float()[:, None]
        return torch.cat([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1).to(dt)

    q_ref, k_ref, v_ref = rope(normed(x[:, :Hq], qn)), rope(normed(x[:, Hq:Hq + Hk], kn)), x[:, Hq + Hk:].to(dt)
    tol = 1e-5 if dt == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1][0].float(), q_ref.float(), atol=tol, rtol=tol)
    cache = outs[1][1]
    for t in range(T):
        s = int(slots[t])
        if s < 0:
            continue
        torch.testing.assert_close(cache[s // U, 0, :, s % U].float(), k_ref[t].float(), atol=tol, rtol=tol)
        assert torch.equal(cache[s // U, 1, :, s % U], v_ref[t])
    stored = sum(int(s) >= 0 for s in slots)
    assert int((cache[:, 1].abs().sum(-1) > 0).sum()) == stored * Hk, "a slot of -1 stored something"
print("ok")
"""


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernel itself (tests/model/test_batched.py)")
def test_qk_rope_store_by_token_blocks_equals_one_token_a_program_and_torch():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
