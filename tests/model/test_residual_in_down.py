"""A one-token step's MoE layer adding its experts to the residual in the down projections' launch
(``triton_moe.down_rows_sum``) and the next qkv GEMV norming that residual itself (``triton_gemv.linear_normed``),
``batched.RESIDUAL_IN_DOWN``: the residual is what ``down_rows`` then ``triton_fused.add_rms``'s sum give, the
normed GEMV what ``add_rms`` then the GEMV give, at every rows-a-program count, masked shapes and k no power of
two; a residual of the wrong shape or a step of two tokens is refused; and a small MoE model's one-sequence decode
step through the fused layer loop gives the same logits with the fold as without, the fold's kernel taken once a
layer. On the CPU under Triton's interpreter (a child process); on a GPU the kernels themselves."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.model.kernel_script import run_kernel_script  # noqa: E402

KERNELS = r"""
import torch
import torch.nn.functional as F
from pushkv.model.kernels import triton_fused as K, triton_gemv, triton_moe
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
same = []
# (the interpreter runs the small shapes; a GPU also Qwen3-30B-A3B's expert count and k, and its qkv's rows)
gpu = dev == "cuda"
for E, k, d, inter, dt in ((8, 2, 32, 48, torch.float32), (12, 6, 40, 24, torch.float32),
                           (16, 4, 64, 96, torch.bfloat16)) + (((128, 8, 256, 96, torch.bfloat16),) if gpu else ()):
    h = torch.randn(1, d, device=dev).to(dt)
    x = torch.randn(1, d, device=dev).to(dt)
    router = torch.randn(E, d, device=dev).to(dt)
    gate_up = (torch.randn(E, 2 * inter, d, device=dev) / d ** 0.5).to(dt)
    down = (torch.randn(E, d, inter, device=dev) / inter ** 0.5).to(dt)
    logits = F.linear(h, router)
    for renorm in (True, False):
        unsummed = triton_moe.moe_mlp(h, router, gate_up, down, k, renorm, summed=False, logits=logits)
        want = K.add_rms(x, unsummed, torch.ones(d, device=dev, dtype=dt), 1e-6)[0]
        for rows in (1, 2, 4, 8):
            triton_moe.DOWN_SUM_ROWS = rows
            got = triton_moe.moe_mlp(h, router, gate_up, down, k, renorm, logits=logits, residual=x)
            assert got.shape == x.shape and got.dtype == dt
            tol = 1e-5 if dt == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            same.append(bool(torch.equal(got, want)))
            assert not torch.equal(got, x)
triton_moe.DOWN_SUM_ROWS = 4
for bad in (torch.randn(1, d + 1, device=dev).to(dt), torch.randn(2, d, device=dev).to(dt)):
    try:
        slots = torch.zeros(16 * k, device=dev, dtype=torch.int32)
        triton_moe.down_rows_sum(torch.empty(16 * k, inter, device=dev, dtype=dt), down,
                                 torch.ones(k, device=dev, dtype=dt), slots, slots[:k], k, 16, bad)
    except ValueError as e:
        assert "residual" in str(e)
    else:
        raise AssertionError("a residual of the wrong shape was taken")
try:
    triton_moe.moe_mlp(torch.randn(2, d, device=dev).to(dt), router, gate_up, down, k, True, residual=x)
except ValueError as e:
    assert "one token" in str(e)
else:
    raise AssertionError("a two-token step took a residual")
normed_same = []
for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    for N, Kd, T in ((40, 64, 1), (16, 128, 3)) + (((5120, 2048, 1),) if gpu else ()):
        x = torch.randn(T, Kd, device=dev).to(dt)
        nw = (torch.rand(Kd, device=dev) + 0.5).to(dt)
        w = (torch.randn(N, Kd, device=dev) / Kd ** 0.5).to(dt)
        for bias in (None, torch.randn(N, device=dev).to(dt)):
            got = triton_gemv.linear_normed(x, nw, 1e-6, w, bias)
            want = triton_gemv.linear(K.add_rms(x, None, nw, 1e-6)[1], w, bias)
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            normed_same.append(bool(torch.equal(got, want)))
x = torch.randn(1, 96, device=dev)
nw, w = torch.rand(96, device=dev) + 0.5, torch.randn(8, 96, device=dev)
assert triton_gemv.tile_for(8, 96) is None
assert torch.equal(triton_gemv.linear_normed(x, nw, 1e-6, w), F.linear(K.add_rms(x, None, nw, 1e-6)[1], w))
if dev == "cpu":  # the interpreter sums each row in one order, so the fold's bits are the two launches'
    assert all(same) and all(normed_same), (same, normed_same)
print("ok", dev, "bits the same:", sum(same), "of", len(same), "sums;", sum(normed_same), "of", len(normed_same),
      "normed GEMVs")
"""


@pytest.mark.unit
def test_the_experts_summed_into_the_residual_and_the_norm_in_the_gemv_equal_the_launches_they_replace():
    print(run_kernel_script(KERNELS, timeout_s=600))


LAYERS = r"""
import torch
from pushkv.config import preset
from pushkv.model import batched, build_model
from pushkv.model.kernels import triton_gemv, triton_moe
from tests.model.kernel_script import decode_step, logits_off_and_on
dev = "cuda" if torch.cuda.is_available() else "cpu"
model = build_model(preset("tiny", architecture="Qwen3MoeForCausalLM", num_experts=4, experts_per_token=2,
                           intermediate_size=32), device=dev)
model.enable_batched(max_num_seqs=8, use_graphs=False)
cfg, fwd, real = model.cfg, model.batched, model.mlp_delta
if dev == "cpu":  # the experts' Triton kernels, as on a GPU (mlp_delta takes torch's on the CPU)
    def triton_delta(lw, h, summed=True, logits=None):
        if lw.router is None:
            return real(lw, h, summed, logits)
        return triton_moe.moe_mlp(h, lw.router, lw.gate_up, lw.down, cfg.experts_per_token, cfg.norm_topk_prob,
                                  summed=summed, logits=logits)
    model.mlp_delta = triton_delta
    fwd.fused = True
batched.GEMV_TOKENS = 1
step, pool = decode_step(model, dev)
normed = []
real_normed = triton_gemv.linear_normed
def counted_normed(*a, **kw):
    normed.append(1)
    return real_normed(*a, **kw)
triton_gemv.linear_normed = counted_normed
off, on, calls = logits_off_and_on(fwd, step[:1], pool, batched, "RESIDUAL_IN_DOWN", True, triton_moe,
                                   "down_rows_sum")
assert calls == cfg.num_layers and len(normed) == cfg.num_layers, (calls, len(normed))  # every layer, on only
torch.testing.assert_close(on, off, atol=1e-5, rtol=1e-5)
assert torch.equal(on.argmax(-1), off.argmax(-1))
if dev == "cpu":
    assert torch.equal(on, off)
# a step of three sequences takes no fold
calls_before = len(normed)
three = fwd.logits(step, model._layer_pools(pool.clone()))
assert len(normed) == calls_before and three.shape[0] == 3
print("ok", dev)
"""


@pytest.mark.unit
def test_fused_layers_with_the_experts_summed_into_the_residual_give_the_same_logits():
    run_kernel_script(LAYERS)
