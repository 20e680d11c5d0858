"""A one-token step's MoE MLP in one persistent launch (kernels/triton_moe_token.py): each slot's output equals the
grouped kernels' (to the rounding of another order of sums), and the layer equals the torch reference. On the CPU
under Triton's interpreter (its halves as two launches); on a GPU with the grid barrier, at every grid size the
same bits, and replayed from a CUDA graph."""
import pytest
import torch

from tests.model.test_moe_kernel import DRAW, _run

# (experts, k, hidden, intermediate, renorm, ties, dtype): k off a power of two, an intermediate size off the
# gate/up column tile and the down depth's power of two, a hidden size off the down column tile, tied logits
CASES = [(8, 2, 32, 48, "renorm", "", "float32"), (12, 8, 40, 24, "", "", "float32"),
         (10, 3, 32, 32, "renorm", "ties", "float32"), (16, 5, 64, 96, "", "ties", "float16")]

SCRIPT = r"""
import json, sys, torch
import torch.nn.functional as F
from pushkv.model.moe import moe_mlp
from pushkv.model.kernels import triton_moe, triton_moe_token
""" + DRAW + r"""
dev = sys.argv[1]
out = []
calls = []
real = triton_moe_token._moe_token_kernel
class Counted:
    def __getitem__(self, grid):
        calls.append(grid)
        return real[grid]
    def __getattr__(self, name):
        return getattr(real, name)
triton_moe_token._moe_token_kernel = Counted()
for E, k, d, i, renorm, ties, dtype in json.loads(sys.argv[2]):
    h, router, gate_up, down = draw(1, E, d, i, dtype, E * 5 + k, dev, ties)  # (no tie across the k-th choice)
    logits = F.linear(h, router)
    ref = moe_mlp(h, router, gate_up, down, k, bool(renorm)).float().cpu()
    triton_moe.PERSISTENT_ONE_TOKEN = False
    grouped = triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm), summed=False, logits=logits).float().cpu()
    triton_moe.PERSISTENT_ONE_TOKEN = True
    n = len(calls)
    on = triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm), summed=False, logits=logits)
    took = len(calls) > n
    summed = triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm)).float().cpu()
    triton_moe.PERSISTENT_ONE_TOKEN = False
    grids = [triton_moe_token.moe_token(h, logits, gate_up, down, k, bool(renorm), programs=p) for p in (1, 3, 7)]
    triton_moe_token.RANK_EXPERTS = 1  # routed by k rounds, as triton_moe routes
    rounds = triton_moe_token.moe_token(h, logits, gate_up, down, k, bool(renorm))
    triton_moe_token.RANK_EXPERTS = 128
    out.append({"took": took, "vs_grouped": float((on.float().cpu() - grouped).abs().max()),
                "vs_ref": float((summed - ref).abs().max()), "scale": float(ref.abs().max()),
                "grids_same": all(torch.equal(g, on) for g in grids), "rounds_same": torch.equal(rounds, on)})
print(json.dumps(out))
"""


def _check(case, r) -> None:
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}[case[-1]] * max(1.0, r["scale"])
    assert r["took"], (case, r)
    # each slot's product as the grouped kernels give it, to the rounding of another order of sums
    assert r["vs_grouped"] <= tol and r["vs_ref"] <= 10 * tol, (case, r)
    # a tile's sums are the same whichever program takes it: any grid, the same bits
    assert r["grids_same"], (case, r)
    # routed by rank, the rounds' experts and weights to the bit
    assert r["rounds_same"], (case, r)


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernel itself (below)")
def test_one_token_in_one_launch_equals_the_grouped_kernels_under_the_interpreter():
    for case, r in zip(CASES, _run("cpu", CASES, SCRIPT)):
        _check(case, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_one_token_in_one_launch_equals_the_grouped_kernels():
    cases = CASES + [c[:6] + ("bfloat16",) for c in CASES]
    for case, r in zip(cases, _run("cuda", cases, SCRIPT)):
        _check(case, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_one_token_in_one_launch_replays_from_a_cuda_graph():
    """Qwen3-30B-A3B's expert shapes, its whole grid resident: 50 replays of a graph of 4 layers give the eager
    launch's bits each time (the barrier's counters left at zero by every launch), with new tokens each time."""
    from pushkv.model.kernels import triton_moe_token

    torch.manual_seed(0)
    dev = torch.device("cuda")
    E, k, d, i, layers = 128, 8, 2048, 768, 4
    gate_up = [(torch.randn(E, 2 * i, d, device=dev) / d ** 0.5).to(torch.bfloat16) for _ in range(layers)]
    down = [(torch.randn(E, d, i, device=dev) / i ** 0.5).to(torch.bfloat16) for _ in range(layers)]
    router = torch.randn(E, d, device=dev, dtype=torch.bfloat16)
    h = torch.empty(1, d, device=dev, dtype=torch.bfloat16)
    triton_moe_token.counters(dev)

    def step():
        x = h
        outs = []
        for gu, dn in zip(gate_up, down):
            y = triton_moe_token.moe_token(x, x @ router.T, gu, dn, k, True)
            outs.append(y)
            x = (y.float().sum(1) / 4).to(torch.bfloat16)
        return outs

    h.copy_(torch.randn(1, d, device=dev))
    step()  # compiled, and its grid sized, before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for rep in range(50):
        h.copy_(torch.randn(1, d, device=dev))
        eager = step()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, eager)), rep
    assert triton_moe_token.counters(dev).tolist() == [0, 0]
    assert triton_moe_token._GRID and min(triton_moe_token._GRID.values()) >= torch.cuda.get_device_properties(
        dev).multi_processor_count
