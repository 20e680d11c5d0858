"""The GPU sampler (pushkv/model/kernels/triton_sample.py) draws what the torch path draws.

On the CPU it runs under Triton's interpreter (TRITON_INTERPRET=1, a child process: the switch
is read when kernels are defined); on a GPU at Qwen3's vocabulary. Rows cover every mode the
kernel has: greedy, the plain draw, top_k, the window without top_k (top_p, min_p), a nucleus
wider than the window, a top_k above the candidates and a top_k crowded into one segment (all
answered by sorting the row),
edits (bias, penalties) and logprobs.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support import sampling_cases as C
from tests.support import ROOT



def _lines(out: str) -> dict:
    return {k: json.loads(v) for k, v in (ln.split(" ", 1) for ln in out.splitlines() if " " in ln)}


@pytest.mark.timeout(600)
def test_kernel_interpreted_equals_torch_path():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    rows = len(C.MIXES)
    r = subprocess.run([sys.executable, "-m", "tests.support.sampling_cases", str(rows), "6000", "256"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stderr[-3000:]
    got = _lines(r.stdout)
    assert got["torch"] == got["kernel"]
    # the kernel drew every row but the nucleus wider than its window, the top_k above its
    # candidates and the top_k crowded into one segment
    assert got["rows"] == {"kernel": rows - 3, "sorted": 3}
    assert got["alone"] == got["kernel"][1:4]  # a row's token does not depend on its batch
    assert len(got["logprobs"]) == 2  # the edited row's 2 and the greedy row's 20, as the torch path gives them
    for (a_lp, a_ids, a_top), (b_lp, b_ids, b_top) in got["logprobs"]:
        assert a_ids == b_ids and len(b_ids) in (2, 20)
        assert abs(a_lp - b_lp) < 1e-5 and all(abs(u - v) < 1e-5 for u, v in zip(a_top, b_top))


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_cuda_equals_torch_path_at_qwen3_vocab():
    x, seqs = C.batch(8 * len(C.MIXES), 151936, "cuda")
    a, b = C.both(x, seqs)
    assert a.tokens == b.tokens
    for la, lb in zip(a.logprobs, b.logprobs):  # logprobs: the kernel's against torch's logsumexp and topk
        assert (la is None) == (lb is None)
        if la is not None:
            assert la.top_ids == lb.top_ids and abs(la.logprob - lb.logprob) < 1e-4
            assert all(abs(u - v) < 1e-4 for u, v in zip(la.top_logprobs, lb.top_logprobs))
    from pushkv.model import sampling as S
    saved = S.SAMPLER
    try:
        S.SAMPLER = "triton"  # and a row alone draws what it drew in the batch
        assert [S.sample(x[i:i + 1], [seqs[i]]).tokens[0] for i in range(len(C.MIXES))] == b.tokens[:len(C.MIXES)]
    finally:
        S.SAMPLER = saved


@pytest.mark.timeout(300)
def test_kernel_compiles_for_hopper():
    """The interpreter runs Python, not Triton's compiler: compile for an H100/H200 (sm_90) here,
    to the cubin, so a kernel the GPU would refuse fails on the CPU first."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pushkv.model.kernels import triton_sample as TS

    sig = {"X": "*fp32", "stride": "i32", "P": "*fp32", "Out": "*i64", "Parts": "*fp32", "Taus": "*i64",
           "Cand": "*u64", "Count": "*i32", "V": "i32", "BLOCK": "constexpr", "KS": "constexpr", "NS": "constexpr"}
    src = ASTSource(TS._sample_kernel, sig, constexprs={"BLOCK": TS.BLOCK, "KS": TS.KS, "NS": 64})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": TS.WARPS})
    assert k.asm["cubin"]
    sig = {"X": "*fp32", "stride": "i32", "Rows": "*i64", "Tok": "*i64", "N": "*i64", "Out": "*fp32", "Parts": "*fp32",
           "Taus": "*i64", "Cand": "*u64", "Count": "*i32", "V": "i32", "BLOCK": "constexpr", "KS": "constexpr",
           "NS": "constexpr", "W": "constexpr"}
    src = ASTSource(TS._logprob_kernel, sig, constexprs={"BLOCK": TS.BLOCK, "KS": TS.LP_KS, "NS": 32, "W": TS.LP_MAX})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": TS.WARPS})
    assert k.asm["cubin"]
