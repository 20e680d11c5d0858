"""The post-attention norm with an MoE layer's router logits in one launch (``triton_fused.add_rms_router``):
its residual and normed rows are bit for bit ``add_rms``'s, its logits equal the router's matmul of the normed
row, and the MoE layer given those logits (``triton_moe.moe_mlp(logits=...)``) equals the layer routing h
itself; and a decode step of a small MoE model through the fused layer loop gives the same logits with the
router in the norm as with its own matmul. On the CPU under Triton's interpreter (TRITON_INTERPRET=1, a child process), where the launches go
without programmatic dependent launch (``chain.launch``); on a GPU the kernels themselves, chained."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.model.kernel_script import run_kernel_script  # noqa: E402

SCRIPT = r"""
import torch
import torch.nn.functional as F
from pushkv.model.kernels import chain, triton_fused as K, triton_moe
from pushkv.model.kernels.triton_moe_decode import decode_tiles_for
from pushkv.model.moe import moe_mlp
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
N, d, E, k, inter = 5, 96, 11, 3, 32
for dt in (torch.float32, torch.bfloat16):
    x = torch.randn(N, d, device=dev).to(dt)
    delta = torch.randn(N, d, device=dev).to(dt)
    w = (torch.rand(d, device=dev) + 0.5).to(dt)
    router = (torch.randn(E, d, device=dev) / d ** 0.5).to(dt)
    for be in (1, 2, 4):
        xo, h, logits = K.add_rms_router(x, delta, w, 1e-6, router, experts_a_program=be)
        x_ref, h_ref = K.add_rms(x, delta, w, 1e-6)
        assert torch.equal(xo, x_ref) and torch.equal(h, h_ref), (dt, be)
        want = F.linear(h.float(), router.float())
        tol = 1e-5 if dt == torch.float32 else 1e-2
        torch.testing.assert_close(logits.float(), want, atol=tol, rtol=tol)
        assert logits.dtype == dt and logits.shape == (N, E)
    if dt == torch.float32:
        gate_up = torch.randn(E, 2 * inter, d, device=dev) / d ** 0.5
        down = torch.randn(E, d, inter, device=dev) / inter ** 0.5
        given = triton_moe.moe_mlp(h, router, gate_up, down, k, True, logits=logits)
        own = triton_moe.moe_mlp(h, router, gate_up, down, k, True)
        torch.testing.assert_close(given, own, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(given, moe_mlp(h, router, gate_up, down, k, True), atol=1e-4, rtol=1e-4)
        ungrouped = decode_tiles_for(N)  # the decode GEMVs, which route each slot from the logits themselves
        torch.testing.assert_close(triton_moe.moe_mlp(h, router, gate_up, down, k, True, ungrouped, logits=logits),
                                   triton_moe.moe_mlp(h, router, gate_up, down, k, True, ungrouped),
                                   atol=1e-5, rtol=1e-5)
        try:
            K.add_rms_router(x, delta[:, :-1].contiguous(), w, 1e-6, router)
        except ValueError as e:
            assert "add_rms_router" in str(e)
        else:
            raise AssertionError("a delta of the wrong shape was taken")
if dev == "cpu":
    assert chain.launch(x) == {"PDL": False}
print("ok", dev)
"""


@pytest.mark.unit
def test_add_rms_router_equals_add_rms_then_the_routers_matmul():
    run_kernel_script(SCRIPT)


LAYERS = r"""
import torch
from pushkv.config import preset
from pushkv.model import batched, build_model
from pushkv.model.kernels import triton_fused, triton_moe
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
step, pool = decode_step(model, dev)
off, on, calls = logits_off_and_on(fwd, step, pool, batched, "ROUTER_IN_NORM_TOKENS", 16, triton_fused,
                                   "add_rms_router")
assert calls == cfg.num_layers, calls  # taken in every layer with the bound at 16, never at 0
torch.testing.assert_close(on, off, atol=1e-5, rtol=1e-5)
assert torch.equal(on.argmax(-1), off.argmax(-1))
print("ok", dev)
"""


@pytest.mark.unit
def test_fused_layers_with_the_router_in_the_norm_equal_its_own_matmul():
    run_kernel_script(LAYERS)
