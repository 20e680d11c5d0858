"""One row's projection (``triton_gemv.gemv``, the fused decode path's qkv and o at one sequence) against
``F.linear``: under Triton's interpreter on the CPU (a child process: the switch is read at import) and on a GPU
when there is one; float32 and float16, with and without a bias, sizes off the tile's multiples (masked columns
and a last K pass), at the default tile and a small one. ``linear`` sends only one CUDA row to it.

    pytest tests/model/test_gemv.py -v -p no:cacheprovider
"""
import pytest
import torch

pytest.importorskip("triton")

from tests.model.test_moe_kernel import _run  # noqa: E402  (the kernels' child process, interpreter or GPU)

pytestmark = pytest.mark.timeout(600)

# (N, K, bias, dtype, tile or None)
CASES = [(40, 96, True, "float32", None), (37, 300, False, "float32", [8, 128, 4, 2]),
         (64, 1030, True, "float16", [16, 256, 4, 3]), (5, 2048, False, "float16", None)]

SCRIPT = r"""
import json, sys, torch
import torch.nn.functional as F
from pushkv.model.kernels.triton_gemv import GemvTile, gemv
dev = sys.argv[1]
out = []
for N, K, bias, dtype, tile in json.loads(sys.argv[2]):
    g = torch.Generator().manual_seed(N * 13 + K)
    dt = getattr(torch, dtype)
    x = torch.randn(1, K, generator=g).to(dev, dt)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dev, dt)
    b = torch.randn(N, generator=g).to(dev, dt) if bias else None
    want = F.linear(x.float(), w.float(), b.float() if bias else None)
    got = gemv(x, w, b, GemvTile(*tile) if tile else None)
    out.append({"shape": list(got.shape), "dtype": str(got.dtype).split(".")[-1],
                "err": ((got.float() - want).abs().max() / want.abs().max()).item()})
print(json.dumps(out))
"""


def _check(results: list[dict]) -> None:
    assert len(results) == len(CASES)
    for (N, K, bias, dtype, tile), r in zip(CASES, results):
        assert r["shape"] == [1, N] and r["dtype"] == dtype, r
        assert r["err"] <= (1e-5 if dtype == "float32" else 2e-3), ((N, K, bias, dtype, tile), r)


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernel itself (below)")
def test_gemv_equals_f_linear_under_the_interpreter():
    _check(_run("cpu", CASES, SCRIPT))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_gemv_equals_f_linear():
    _check(_run("cuda", CASES, SCRIPT))


def test_linear_leaves_more_rows_and_the_cpu_to_f_linear(monkeypatch):
    from pushkv.model.kernels import triton_gemv

    called = []
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a: called.append(a))
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert torch.equal(triton_gemv.linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(triton_gemv.linear(x[:1], w), torch.nn.functional.linear(x[:1], w))  # a CPU row
    assert not called


def test_gemv_refuses_what_is_not_one_row():
    from pushkv.model.kernels.triton_gemv import gemv

    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.randn(1, 8), torch.randn(8, 4).t())
