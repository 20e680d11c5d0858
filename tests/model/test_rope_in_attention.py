"""``triton_paged.ROPE_IN_ATTENTION``: a decode step's attention norming and rotating its queries from the qkv
projection and storing the token's own K/V itself gives what the RoPE-and-store kernel and the attention after it
give, bit for bit: the attention's output and every cache element. Under Triton's interpreter on the CPU
(TRITON_INTERPRET=1, in a child process) and on a GPU (bf16 and float32), with and without the q/k norm, a sliding
window, one to sixteen splits (most of them without keys), GQA 8 and 1, a pool cut into head groups (6-d), and a
graph's padding row (no keys, slot -1: nothing stored)."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from tests.model.kernel_script import run_kernel_script  # noqa: E402

SCRIPT = r"""
import json, torch
from pushkv.messages import SeqWork
from pushkv.model.kernels import paged, triton_fused, triton_paged
from pushkv.model.step import StepTensors, plan_step

args = json.loads(%r)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
d, u, kvh = args["d"], 16, 2
checked = 0


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


for dtype in args["dtypes"]:
    dt = getattr(torch, dtype)
    for G, window, splits, norm, groups in args["cases"]:
        torch.manual_seed(G * 100 + window + splits)
        hq = kvh * G
        seqs, start = [], 0
        for i, ctx in enumerate((1, 20, 40, 300, 130, 1)):
            nb = -(-ctx // u)
            seqs.append(SeqWork(i, (1,), ctx - 1, tuple(range(start, start + nb))))
            start += nb
        meta = StepTensors.upload(plan_step(seqs, u, block_q=16), dev)
        T = len(seqs)
        meta.seq_lens[-1] = 0  # a graph's padding row: no keys, and its slot -1 stores nothing
        slots = meta.slots.clone()
        slots[-1] = -1
        shape = (80, 2, groups, kvh // groups, u, d) if groups > 1 else (80, 2, kvh, u, d)
        cache = torch.randn(shape, device=dev).to(dt)
        qkv = torch.randn(T, (hq + 2 * kvh) * d, device=dev).to(dt)
        qn = torch.randn(d, device=dev).to(dt) if norm else None
        kn = torch.randn(d, device=dev).to(dt) if norm else None
        pos_table = torch.arange(512, device=dev, dtype=torch.float32)[:, None] / (1 + torch.arange(d, device=dev))
        cos, sin = pos_table.cos().to(dt), pos_table.sin().to(dt)
        positions = (meta.seq_lens - 1).clamp(min=0).long()
        scratch = paged.decode_scratch(splits, T, hq, kvh, d, dev)
        # the two launches: RoPE and the store, then the attention over the pool
        c_two = cache.clone()
        q = triton_fused.qk_norm_rope_store(qkv, hq, kvh, d, qn, kn, 1e-6, cos, sin, positions, slots, c_two)
        two = torch.full((T, hq, d), float("nan"), device=dev).to(dt)
        triton_paged.attention(q, c_two, meta.block_table, meta.seq_lens, meta.q_starts, meta.q_lens,
                               meta.decode_tiles, meta.decode_q0, 1, splits, window, two, scratch[:2])
        # the attention doing both
        c_one = cache.clone()
        one = torch.full((T, hq, d), float("nan"), device=dev).to(dt)
        rope = triton_paged.RopeIn(qkv, kvh, qn, kn, 1e-6, cos, sin, positions, slots)
        triton_paged.attention(qkv[:, :hq * d].view(T, hq, d), c_one, meta.block_table, meta.seq_lens, meta.q_starts,
                               meta.q_lens, meta.decode_tiles, meta.decode_q0, 1, splits, window, one, scratch[:2],
                               rope=rope)
        case = (dtype, G, window, splits, norm, groups)
        assert same(one[:-1], two[:-1]), (case, float((one[:-1].float() - two[:-1].float()).abs().max()))
        assert same(c_one, c_two), case
        assert not same(c_two, cache), case  # the new keys were stored
        checked += 1
# a q that is not the qkv projection's view is refused
try:
    triton_paged.attention(q, c_one, meta.block_table, meta.seq_lens, meta.q_starts, meta.q_lens, meta.decode_tiles,
                           meta.decode_q0, 1, splits, window, one, scratch[:2], rope=rope)
    raise AssertionError("a q that is no view of qkv was taken")
except ValueError:
    pass
print("ok", checked)
"""


def _run(args: dict) -> int:
    out = run_kernel_script(SCRIPT % json.dumps(args), timeout_s=900)
    return int(out.strip().splitlines()[-1].split()[1])


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernels themselves (the test below)")
def test_rope_in_attention_gives_the_two_launch_bits_under_the_interpreter():
    cases = [(4, 0, 3, True, 1), (1, 37, 16, False, 1), (4, 0, 1, True, 2)]
    assert _run({"d": 32, "dtypes": ["float32"], "cases": cases}) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_rope_in_attention_gives_the_two_launch_bits():
    """The same at head_dim 128, bf16 and float32, over more cases."""
    cases = [(G, window, splits, norm, groups) for G in (8, 1) for window in (0, 37) for splits in (1, 3, 16)
             for norm in (True, False) for groups in (1, 2)]
    assert _run({"d": 128, "dtypes": ["bfloat16", "float32"], "cases": cases}) == 2 * len(cases)
