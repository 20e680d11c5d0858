"""The Triton kernels of a step compiled for an H100/H200 (sm_90) on the CPU, by Triton's own compiler and its
bundled ptxas (no GPU; ``tools/kernel_sass.py``): with programmatic dependent launch on (``kernels/chain.py``),
every kernel's first instruction that touches global or shared memory comes after ``griddepcontrol.wait``, so
nothing it reads or writes can race the kernel before it (the GEMV loads its weights, which no kernel writes, before
the wait, and nothing else), and ``launch_dependents`` follows; with it off, no
``griddepcontrol`` at all. ptxas must accept each (a cubin comes out). And the SASS comparison's verdicts."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

from tools.kernel_sass import compile_sm90, instructions, kernels, verdict  # noqa: E402

KERNELS = kernels()
MEMORY = re.compile(r"^\s*(@%p\d+\s+)?(ld|st|atom|red|cp\.async)\.(global|shared)")


@pytest.mark.unit
@pytest.mark.parametrize("name, fn, consts, warps, stages", KERNELS, ids=[k[0] for k in KERNELS])
def test_chained_kernel_waits_before_touching_memory(name, fn, consts, warps, stages):
    on = compile_sm90(fn, consts, True, warps, stages)
    ptx = on.asm["ptx"].splitlines()
    wait = next((i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line), None)
    touch = next((i for i, line in enumerate(ptx) if MEMORY.match(line)), None)
    assert wait is not None and touch is not None, (wait, touch)
    if name.startswith("gemv"):  # its weights load first, on purpose: nothing is written, and its input waits
        early = [line for line in ptx[:wait] if MEMORY.match(line)]
        assert early and all(re.match(r"^\s*(@%p\d+\s+)?ld\.global", line) for line in early), early
        assert any(MEMORY.match(line) and "ld.global" in line for line in ptx[wait:]), "the input loads before the wait"
    else:
        assert wait < touch, f"{name}: memory touched at PTX line {touch}, before the wait at {wait}"
    assert any("griddepcontrol.launch_dependents" in line for line in ptx[wait:])
    assert on.asm["cubin"], "ptxas gave no cubin"
    off = compile_sm90(fn, consts, False, warps, stages)
    assert "griddepcontrol" not in off.asm["ptx"] and off.asm["cubin"]
    if name == "attn_merge":  # cuobjdump reads a cubin back into instructions
        sass = instructions(off.asm["cubin"])
        assert len(sass) > 20 and all(x.endswith(";") for x in sass) and any("EXIT" in x for x in sass)


@pytest.mark.unit
def test_sass_verdicts():
    a = ["IMAD R1, R2, 0x4, RZ ;", "LDG.E R3, desc[UR4][R6.64] ;", "EXIT ;"]
    assert verdict(a, list(a)) == "the same instructions"
    assert verdict(a, ["IMAD R7, R2.reuse, 0x8, RZ ;", a[1], a[2]]) == \
        "the same operations in the same order, other registers or constants"
    assert verdict(a, [a[1], a[0], a[2]]) == "the same operations, 2 of them in another place"
    assert verdict(a, [a[0], "STG.E desc[UR4][R6.64], R3 ;", a[2]]) == "other operations: 1 gone, 1 new"
