"""The Triton kernels of a step compiled for an H100/H200 (sm_90) on the CPU, by Triton's own compiler and its
bundled ptxas (no GPU): with programmatic dependent launch on (``kernels/chain.py``), every kernel's first
instruction that touches global memory comes after ``griddepcontrol.wait``, so nothing it reads or writes can race
the kernel before it; ``launch_dependents`` follows; with it off, no ``griddepcontrol`` at all, the kernels as
before. ptxas must accept each (a cubin comes out)."""
from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pushkv.model.kernels import triton_fused, triton_moe, triton_moe_decode, triton_paged  # noqa: E402

# pointers: the capitalised arguments but the counts, and the tables; the rest are int32 scalars but two floats
COUNTS = {"T", "E", "HG", "U"}
TABLES = {"cache", "block_table", "seq_lens", "q_starts", "q_lens", "tile_seq", "tile_q0"}
FLOATS = {"eps", "sm_scale_log2"}
INT_PTRS = {"Pos", "Slots", "block_table", "seq_lens", "q_starts", "q_lens", "tile_seq", "tile_q0", "SlotIds",
            "BlockExpert", "Experts"}
F32_PTRS = {"Part", "PartML"}

DECODE_ATTN = dict(PREC="tf32", G=8, D=128, BLOCK_D=128, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=64, NUM_SPLITS=16,
                   HEAVY_FIRST=True, FREE_LOOP=True)
PREFILL_ATTN = dict(DECODE_ATTN, BLOCK_Q=32, BLOCK_M=256, NUM_SPLITS=1)
GROUPED = dict(PREC="tf32", BM=16, BK=128, EVEN=True, ROW_ACT=True)
# (kernel, its constexprs, warps, stages): a Qwen3-30B-A3B decode step's launches, and a prefill's attention
KERNELS = [
    (triton_fused._add_rms_kernel, dict(HAS_DELTA=True, SLOTS=8, BLOCK=2048), 8, 3),
    (triton_fused._add_rms_router_kernel, dict(BE=2, BLOCK=2048), 8, 3),
    (triton_fused._qk_rope_store_kernel, dict(HQ=32, HK=4, D=128, HAS_NORM=True, TB=1), 1, 3),
    (triton_fused._silu_mul_kernel, dict(BLOCK=1024), 4, 3),
    (triton_paged._attn_kernel, DECODE_ATTN, 4, 2),
    (triton_paged._attn_kernel, PREFILL_ATTN, 8, 3),
    (triton_paged._merge_kernel, dict(D=128, BLOCK_D=128, NUM_SPLITS=16), 1, 3),
    (triton_moe._route_group_kernel, dict(K=8, RENORM=True, BM=16, EP=128, TT=1, SC=16, FILL=1024), 1, 3),
    (triton_moe._gate_up_kernel, dict(GROUPED, BN=32), 4, 3),
    (triton_moe._down_kernel, dict(GROUPED, BN=64), 4, 3),
    (triton_moe_decode._router_kernel, dict(BE=2, BK=256), 4, 3),
    (triton_moe_decode._gate_up_kernel, dict(K=8, RENORM=True, EP=128, BN=16, BK=256), 4, 3),
    (triton_moe_decode._down_kernel, dict(K=8, BN=4, BK=256), 4, 3),
]
MEMORY = re.compile(r"^\s*(@%p\d+\s+)?(ld|st|atom|red|cp\.async)\.(global|shared)")


def sm90(fn, consts: dict, pdl: bool, warps: int, stages: int):
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in FLOATS:
            sig[p.name] = "fp32"
        elif p.name in COUNTS or (p.name not in TABLES and not p.name[0].isupper()):
            sig[p.name] = "i32"
        else:
            sig[p.name] = "*i32" if p.name in INT_PTRS else "*fp32" if p.name in F32_PTRS else "*bf16"
    opts = dict(num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}))
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs={**consts, "PDL": pdl}),
                          target=GPUTarget("cuda", 90, 32), options=opts)


@pytest.mark.unit
@pytest.mark.parametrize("fn, consts, warps, stages", KERNELS,
                         ids=[f"{f.fn.__module__.split('.')[-1]}.{f.__name__}" + ("_prefill" if c.get("BLOCK_Q", 1) > 1
                                                                                   else "") for f, c, *_ in KERNELS])
def test_chained_kernel_waits_before_touching_memory(fn, consts, warps, stages):
    on = sm90(fn, consts, True, warps, stages)
    ptx = on.asm["ptx"].splitlines()
    wait = next((i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line), None)
    touch = next((i for i, line in enumerate(ptx) if MEMORY.match(line)), None)
    assert wait is not None and touch is not None, (wait, touch)
    assert wait < touch, f"{fn.__name__}: memory touched at PTX line {touch}, before the wait at {wait}"
    assert any("griddepcontrol.launch_dependents" in line for line in ptx[wait:])
    assert on.asm["cubin"], "ptxas gave no cubin"
    off = sm90(fn, consts, False, warps, stages)
    assert "griddepcontrol" not in off.asm["ptx"] and off.asm["cubin"]
