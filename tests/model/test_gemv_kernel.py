"""The decode step's projection GEMV (``triton_gemv.linear``, its weights loaded before it waits for the kernel
before it) equals ``F.linear`` to rounding: float32 and bf16, with and without a bias, 1 to 8 rows, rows apart in
memory, a last program of fewer columns; a shape it does not serve goes to ``F.linear`` itself; and a small
model's decode step through the fused layer loop gives the same logits with the GEMVs as with cuBLAS. On the CPU
under Triton's interpreter (TRITON_INTERPRET=1, a child process); on a GPU the kernel itself."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.model.kernel_script import run_kernel_script  # noqa: E402

SCRIPT = r"""
import torch
import torch.nn.functional as F
from pushkv.config import preset
from pushkv.model import batched, build_model
from pushkv.model.kernels import triton_gemv
from tests.model.kernel_script import decode_step, logits_off_and_on
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    for N, K, T in ((40, 64, 1), (16, 128, 3), (24, 32, 8)):
        big = torch.randn(T, K + 16, device=dev).to(dt)
        x = big[:, :K]  # rows apart in memory
        w = (torch.randn(N, K, device=dev) / K ** 0.5).to(dt)
        b = torch.randn(N, device=dev).to(dt)
        for bias in (None, b):
            got = triton_gemv.linear(x, w, bias)
            want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            assert got.dtype == dt and got.shape == (T, N)
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
x = torch.randn(3, 96, device=dev)
w = torch.randn(8, 96, device=dev)
assert triton_gemv.tile_for(8, 96) is None and torch.equal(triton_gemv.linear(x, w), F.linear(x, w))
assert triton_gemv.linear(torch.randn(0, 64, device=dev), torch.randn(8, 64, device=dev)).shape == (0, 8)

model = build_model(preset("tiny"), device=dev)
model.enable_batched(max_num_seqs=8, use_graphs=False)
fwd = model.batched
fwd.fused = True  # the fused layer loop (the CPU's default is torch's)
step, pool = decode_step(model, dev)
off, on, calls = logits_off_and_on(fwd, step, pool, batched, "GEMV_TOKENS", 8, triton_gemv._gemv_kernel, "run")
assert calls == 2 * model.cfg.num_layers, calls  # qkv and o in every layer at 8, never at 0
torch.testing.assert_close(on, off, atol=1e-4, rtol=1e-4)
assert torch.equal(on.argmax(-1), off.argmax(-1))
print("ok", dev)
"""


@pytest.mark.unit
def test_gemv_equals_linear_and_serves_the_fused_layers():
    run_kernel_script(SCRIPT)
