"""``triton_moe.GUESS_ONE_TOKEN``: a one-token step's gate/up programs guess their row blocks' experts from the
router's logits before they wait for the routing launch, and ask L2 for those rows. The guess must be the expert
the grouping gives the block (else the prefetch fetches bytes no program reads): checked against
``group_logits``'s table for random logits, ties among them, 128 and 60 experts and k 8 and 2, under Triton's
interpreter (TRITON_INTERPRET=1, in a child process) or on a GPU. On a GPU the step's tokens with it are in
tests/model/test_gpu_graphs.py."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.model.kernel_script import run_kernel_script  # noqa: E402

SCRIPT = r"""
import torch, triton
import triton.language as tl
from pushkv.model.kernels import triton_moe

@triton.jit
def guesses(Logits, Out, E, K: tl.constexpr, EP: tl.constexpr):
    tl.store(Out + tl.program_id(0), triton_moe._guess_block_expert(Logits, tl.program_id(0), E, K, EP))

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
checked = 0
for E, k in ((128, 8), (60, 2), (128, 2)):
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(1, E, generator=g)
        if seed % 2:  # ties: the lowest expert first, as the routing takes them
            logits = (logits * 2).round() / 2
        logits = logits.to(dev)
        _w, _e, _slots, block_expert = triton_moe.group_logits(logits, k, True, 16)
        out = torch.full((k,), -1, dtype=torch.int32, device=dev)
        guesses[(k,)](logits, out, E, K=k, EP=triton.next_power_of_2(E))
        assert torch.equal(out.cpu(), block_expert[:k].cpu().to(torch.int32)), (E, k, seed, out, block_expert[:k])
        assert bool((block_expert[k:] < 0).all())  # one token: k blocks, the rest past the last expert's
        checked += 1
print("ok", checked)
"""


@pytest.mark.unit
def test_the_guess_is_the_groupings_expert_for_each_block():
    assert run_kernel_script(SCRIPT, timeout_s=600).strip().splitlines()[-1] == "ok 18"
