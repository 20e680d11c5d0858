"""An MoE layer's k experts a token summed in the residual add (``triton_fused.add_rms`` with a
[N, k, d] delta, fed by ``triton_moe.moe_mlp(summed=False)``): the slots summed in float32 in slot
order and rounded once, then added, bit for bit (the same bits at one token and at five: a row's sum
does not depend on the batch), and within one rounding of the sum done apart (torch's sum, whose
order is its own, then the plain residual add); under Triton's interpreter on the CPU (a child
process: the switch is read at import) and on a GPU when there is one, in bfloat16 and float32, for
one token (a decode step) and several, with k = 8 (Qwen3-MoE's) and k = 2. The interpreter rounds
float16 as a GPU does and truncates to bfloat16, so bfloat16 is checked on the GPU only.

    pytest tests/model/test_moe_slot_sum.py -v -p no:cacheprovider
"""
import pytest
import torch

pytest.importorskip("triton")

from tests.model.test_moe_kernel import _run  # noqa: E402  (the kernels' child process, interpreter or GPU)

pytestmark = pytest.mark.timeout(600)

# (tokens, experts, k, hidden, intermediate, dtype): hidden off a power of two (masked columns)
CASES = [(1, 16, 8, 96, 40, "float16"), (5, 16, 8, 96, 40, "float16"), (3, 8, 2, 64, 24, "float32"),
         (1, 8, 2, 40, 24, "float32")]
GPU_CASES = CASES + [(1, 16, 8, 96, 40, "bfloat16"), (5, 16, 8, 96, 40, "bfloat16")]

SCRIPT = r"""
import json, sys, torch
from pushkv.model.kernels import triton_fused as K, triton_moe
dev = sys.argv[1]
out = []
for T, E, k, d, i, dtype in json.loads(sys.argv[2]):
    g = torch.Generator().manual_seed(T * 31 + k)
    dt = getattr(torch, dtype)
    h = torch.randn(T, d, generator=g).to(dev, dt)
    x = torch.randn(T, d, generator=g).to(dev, dt)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dev, dt)
    router = torch.randn(E, d, generator=g).to(dev, dt)
    gate_up = (torch.randn(E, 2 * i, d, generator=g) / d ** 0.5).to(dev, dt)
    down = (torch.randn(E, d, i, generator=g) / i ** 0.5).to(dev, dt)
    summed = triton_moe.moe_mlp(h, router, gate_up, down, k, True)
    slots = triton_moe.moe_mlp(h, router, gate_up, down, k, True, summed=False)
    x_apart, h_apart = K.add_rms(x, summed, w, 1e-6)
    x_fused, h_fused = K.add_rms(x, slots, w, 1e-6)
    acc = torch.zeros(T, d, dtype=torch.float32, device=dev)
    for s in range(k):  # in slot order, in float32, rounded once
        acc += slots[:, s].float()
    x_want, h_want = K.add_rms(x, acc.to(dt), w, 1e-6)  # the plain add of that sum, one slot
    x_row, _ = K.add_rms(x[:1].contiguous(), slots[:1].contiguous(), w, 1e-6)  # the first token alone
    out.append({"shape": list(slots.shape), "sum_equal": torch.equal(slots.sum(dim=1), summed),
                "x_equal": torch.equal(x_fused, x_want), "h_equal": torch.equal(h_fused, h_want),
                "batch_invariant": torch.equal(x_row, x_fused[:1]),
                "apart": (x_fused.float() - x_apart.float()).abs().max().item(),
                "ulp": (x_apart.float().abs().max() * torch.finfo(dt).eps).item() * 2,
                "moved": (x_fused.float() - x.float()).abs().max().item()})
print(json.dumps(out))
"""


def _check(cases: list, results: list[dict]) -> None:
    assert len(results) == len(cases)
    for (T, E, k, d, _i, dtype), r in zip(cases, results):
        case = (T, E, k, d, dtype)
        assert r["shape"] == [T, k, d], (case, r)
        assert r["sum_equal"] and r["x_equal"] and r["h_equal"] and r["batch_invariant"], (case, r)
        assert r["apart"] <= r["ulp"], (case, r)  # torch's own order: within a rounding of the result
        assert r["moved"] > 0, (case, r)  # the experts did add something


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernels themselves (below)")
def test_slots_summed_in_the_residual_add_under_the_interpreter():
    _check(CASES, _run("cpu", CASES, SCRIPT))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_slots_summed_in_the_residual_add():
    _check(GPU_CASES, _run("cuda", GPU_CASES, SCRIPT))


def test_a_delta_of_the_wrong_shape_is_refused():
    from pushkv.model.kernels import triton_fused as K

    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="delta"):
        K.add_rms(x, torch.zeros(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="delta"):
        K.add_rms(x, torch.zeros(2, 4, 8).transpose(0, 1), torch.ones(8), 1e-6)
