"""The step's Triton kernels compiled for an H100/H200 (sm_90) on any machine, by Triton's compiler and its
bundled ptxas and cuobjdump (no GPU): their instruction sequences saved, and two saves compared. A refactor of a
kernel that leaves its instructions as they were needs no GPU run to show it costs nothing.

    python3 -m tools.kernel_sass --out before.json     (at one commit; prints each kernel's registers, spills and
                                                        shared memory)
    python3 -m tools.kernel_sass --out after.json      (at the next)
    python3 -m tools.kernel_sass --compare before.json after.json
    python3 -m tools.kernel_sass --attention-tiles     (a prefill's attention tile's spills per config)

``tests/model/test_kernels_sm90.py`` compiles the same list with programmatic dependent launch on and off.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

# pointers: the capitalised arguments but the counts, and the tables; the rest are int32 scalars but two floats
COUNTS = {"T", "E", "HG", "U", "N"}
TABLES = {"cache", "block_table", "seq_lens", "q_starts", "q_lens", "tile_seq", "tile_q0"}
FLOATS = {"eps", "sm_scale_log2"}
INT_PTRS = {"Pos", "Slots", "block_table", "seq_lens", "q_starts", "q_lens", "tile_seq", "tile_q0", "SlotIds",
            "BlockExpert", "Experts", "Counter", "Counters"}
F32_PTRS = {"Part", "PartML"}
# as a launch specialises them (tt.divisibility 16): every pointer (torch's allocations are aligned), and the
# integers that are multiples of 16 in a Qwen3-30B-A3B step (strides, widths, counts of 128), not these
UNALIGNED = {"HG", "k_top", "window", "total_rows", "T", "n_slots", "n_rows", "max_blocks"}

DECODE_ATTN = dict(PREC="tf32", G=8, D=128, BLOCK_D=128, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=64, NUM_SPLITS=16,
                   HEAVY_FIRST=True, FREE_LOOP=True, FUSED_MERGE=False)
PREFILL_ATTN = dict(DECODE_ATTN, BLOCK_Q=32, BLOCK_M=256, NUM_SPLITS=1)
GROUPED = dict(PREC="tf32", BM=16, BK=128, EVEN=True, ROW_ACT=True)
# the gate/up kernel's routing: the grouping's tables, or a one-token step routed by the kernel itself
GROUPED_ROUTE = dict(SELF_ROUTE=False, K=1, RENORM=False, EP=1)
SELF_ROUTE = dict(SELF_ROUTE=True, K=8, RENORM=True, EP=128)
# the ungrouped decode MoE kernels in one launch (decode_tiles_for's tiles), and the down weights asked of L2 by
# gate/up (a Qwen3-30B-A3B expert's 2048 x 768 bf16 down weights over its 48 gate/up programs: 512 lines each)
ONE_LAUNCH = dict(K=8, RENORM=True, EP=128, BN_UP=16, BK_UP=256, BN_DOWN=4, BK_DOWN=256, SPIN_NS=200)
PREFETCH = dict(PREFETCH=True, LINES=512, LINE=64)


def kernels() -> list[tuple[str, object, dict, int, int]]:
    """(name, kernel, constexprs, warps, stages): a Qwen3-30B-A3B decode step's launches, a prefill's attention,
    and float32 attention."""
    from pushkv.model.kernels import triton_fused, triton_gemv, triton_moe, triton_moe_decode, triton_paged

    dt = triton_moe.tiles_for(1)  # a decode step's grouped tiles, as shipped
    return [
        ("add_rms", triton_fused._add_rms_kernel, dict(HAS_DELTA=True, SLOTS=8, BLOCK=2048), 8, 3),
        ("add_rms_router", triton_fused._add_rms_router_kernel, dict(BE=2, BLOCK=2048), 8, 3),
        ("add_rms_router_early", triton_fused._add_rms_router_kernel, dict(BE=2, BLOCK=2048, EARLY=True), 8, 3),
        ("qk_rope_store", triton_fused._qk_rope_store_kernel, dict(HQ=32, HK=4, D=128, HAS_NORM=True, TB=1), 1, 3),
        ("silu_mul", triton_fused._silu_mul_kernel, dict(BLOCK=1024), 4, 3),
        ("attn_decode", triton_paged._attn_kernel, DECODE_ATTN, 4, 2),
        ("attn_decode_fused_merge", triton_paged._attn_kernel, dict(DECODE_ATTN, FUSED_MERGE=True), 4, 2),
        ("attn_prefill", triton_paged._attn_kernel, PREFILL_ATTN, 8, 3),
        ("attn_fp32", triton_paged._attn_kernel, dict(DECODE_ATTN, PREC="ieee", BLOCK_N=32), 4, 2),
        ("attn_merge", triton_paged._merge_kernel, dict(D=128, BLOCK_D=128, NUM_SPLITS=16), 1, 3),
        ("route_group", triton_moe._route_group_kernel, dict(K=8, RENORM=True, BM=16, EP=128, TT=1, SC=16, FILL=1024),
         1, 3),
        ("route_one", triton_moe._route_one_kernel, dict(K=8, KP=8, RENORM=True, BM=16, EP=128, RP=256, BP=16), 1, 3),
        ("route_few", triton_moe._route_few_kernel,
         dict(K=8, KP=8, RENORM=True, BM=16, EP=128, TP=2, RP=512, BP=32), triton_moe.ROUTE_FEW_WARPS[0], 3),
        ("moe_gate_up", triton_moe._gate_up_kernel, dict(GROUPED, **GROUPED_ROUTE, BM=dt.bm, BN=dt.bn_up, BK=dt.bk),
         dt.warps, dt.stages),
        ("moe_gate_up_self_route", triton_moe._gate_up_kernel,
         dict(GROUPED, **SELF_ROUTE, BM=dt.bm, BN=dt.bn_up, BK=dt.bk), dt.warps, dt.stages),
        ("moe_down", triton_moe._down_kernel, dict(GROUPED, BM=dt.bm, BN=dt.bn_down, BK=dt.bk_down or dt.bk),
         dt.down_warps or dt.warps, dt.down_stages or dt.stages),
        ("moe_down_prefill_cols_first", triton_moe._down_kernel,
         dict(GROUPED, BM=128, BN=256, BK=64, COLS_FIRST=True), 8, 4),
        ("decode_router", triton_moe_decode._router_kernel, dict(BE=2, BK=256), 4, 3),
        ("decode_gate_up", triton_moe_decode._gate_up_kernel, dict(K=8, RENORM=True, EP=128, BN=16, BK=256), 4, 3),
        ("decode_down", triton_moe_decode._down_kernel, dict(K=8, BN=4, BK=256), 4, 3),
        ("decode_gate_up_prefetch", triton_moe_decode._gate_up_kernel,
         dict(K=8, RENORM=True, EP=128, BN=16, BK=256, **PREFETCH), 4, 3),
        ("decode_one_launch", triton_moe_decode._one_launch_kernel, ONE_LAUNCH, 4, 3),
        ("decode_one_launch_prefetch", triton_moe_decode._one_launch_kernel, dict(ONE_LAUNCH, **PREFETCH), 4, 3),
        ("decode_gate_up_own", triton_moe_decode._gate_up_kernel,
         dict(K=8, RENORM=True, EP=128, BN=16, BK=256, OWN=True, LPR=32, LINE=64), 4, 3),
        ("decode_down_own", triton_moe_decode._down_kernel, dict(K=8, BN=4, BK=256, OWN=True, LPR=16, LINE=64), 4, 3),
        ("decode_one_launch_own", triton_moe_decode._one_launch_kernel,
         dict(ONE_LAUNCH, **PREFETCH, OWN=True, LPR_UP=32, LPR_DOWN=16), 4, 3),
        ("moe_gate_up_prefetch", triton_moe._gate_up_kernel,
         dict(GROUPED, **GROUPED_ROUTE, BM=dt.bm, BN=dt.bn_up, BK=dt.bk, PREFETCH=True, LINES=2048, LINE=64),
         dt.warps, dt.stages),
        ("gemv_o", triton_gemv._gemv_kernel, dict(K=4096, BN=8, HAS_BIAS=False), 8, 1),
        ("gemv_qkv_bias", triton_gemv._gemv_kernel, dict(K=2048, BN=8, HAS_BIAS=True), 8, 1),
        ("gemv_moe_down", triton_moe._down_gemv_kernel,
         dict(K=768, KP=1024, BM=dt.bm, BN=triton_moe.DOWN_GEMV_COLUMNS, ROW_ACT=True), 8, 1),
        *[(f"moe_gate_up_rows{'' if one else '_few'}", triton_moe._gate_up_rows_kernel,
           dict(BM=dt.bm, KP=2048, R=triton_moe.ROWS, ONE=one), triton_moe.ROWS_WARPS, 1) for one in (True, False)],
        *[(f"moe_down_rows{'' if one else '_few'}", triton_moe._down_gemv_kernel,
           dict(K=768, KP=1024, BM=dt.bm, BN=triton_moe.DOWN_ROWS, ROW_ACT=True, EARLY=False, ONE=one),
           triton_moe.DOWN_ROWS_WARPS, 1) for one in (True, False)],
    ]


def compile_sm90(fn, consts: dict, pdl: bool, warps: int, stages: int, dtype: str = "bf16"):
    """The kernel compiled for sm_90 (``asm`` holds its ptx and cubin), chained (``PDL``) or not; its tensors
    of ``dtype`` (bf16, or fp32 for a float32 model)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in FLOATS:
            sig[p.name] = "fp32"
        elif p.name in COUNTS or (p.name not in TABLES and not p.name[0].isupper()):
            sig[p.name] = "i32"
        else:
            sig[p.name] = "*i32" if p.name in INT_PTRS else "*fp32" if p.name in F32_PTRS else f"*{dtype}"
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if sig[p.name] != "constexpr" and sig[p.name] != "fp32" and p.name not in UNALIGNED}
    opts = dict(num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}))
    # every constexpr with a default named, as a launch binds it: one left out shifts what the others bind to
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default and p.name not in consts}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs={**defaults, **consts, "PDL": pdl}, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, *flags, path], capture_output=True, text=True, check=True).stdout


def instructions(cubin: bytes) -> list[str]:
    """The cubin's SASS, one instruction a line, without addresses and encodings."""
    out = []
    for line in _cuobjdump(cubin, "-sass").splitlines():
        text = re.sub(r"/\*.*?\*/", "", line).strip()
        if text.endswith(";"):
            out.append(text)
    return out


_OPERANDS = re.compile(r"\bU?R\d+\b|\bU?P\d+\b|0x[0-9a-f]+|c\[[^\]]*\]\[[^\]]*\]")


def shape(instruction: str) -> str:
    """An instruction without its registers, predicates, constants and reuse hints."""
    return _OPERANDS.sub("#", instruction.replace(".reuse", ""))


def verdict(a: list[str], b: list[str]) -> str:
    if a == b:
        return "the same instructions"
    sa, sb = [shape(x) for x in a], [shape(x) for x in b]
    if sa == sb:
        return "the same operations in the same order, other registers or constants"
    if sorted(sa) == sorted(sb):
        moved = sum(x != y for x, y in zip(sa, sb))
        return f"the same operations, {moved} of them in another place"
    gone = len(sa) - sum(min(sa.count(x), sb.count(x)) for x in set(sa))
    new = len(sb) - sum(min(sa.count(x), sb.count(x)) for x in set(sb))
    return f"other operations: {gone} gone, {new} new"


def resources(cubin: bytes) -> dict:
    """cuobjdump's resource usage of a cubin: registers a thread, stack bytes a thread (spills), static shared."""
    text = _cuobjdump(cubin, "--dump-resource-usage")
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k.lower(): int(v) for k, v in found.items()}


def compare(a: dict, b: dict) -> list[str]:
    lines = []
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            lines.append(f"{name}: only in {'the second' if name not in a else 'the first'}")
        else:
            lines.append(f"{name}: {len(a[name])} -> {len(b[name])} instructions, {verdict(a[name], b[name])}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tools.kernel_sass", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="save the kernels' instructions (JSON)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saves")
    ap.add_argument("--attention-tiles", action="store_true",
                    help="a prefill's 256-row attention tile: registers and spills per (keys a step, warps, stages)")
    args = ap.parse_args(argv)
    if args.attention_tiles:
        from pushkv.model.kernels import triton_paged

        for bn, warps, stages in ((64, 8, 3), (64, 8, 2), (64, 16, 3), (64, 16, 2), (32, 8, 3), (32, 16, 3)):
            k = compile_sm90(triton_paged._attn_kernel, dict(PREFILL_ATTN, BLOCK_N=bn), False, warps, stages)
            r = resources(k.asm["cubin"])
            print(f"block_n {bn}, {warps} warps, {stages} stages: {r.get('reg')} registers, {r.get('stack')} stack "
                  f"bytes (spills), {k.metadata.shared} bytes of shared memory", flush=True)
        return 0
    if args.compare:
        with open(args.compare[0]) as fa, open(args.compare[1]) as fb:
            print("\n".join(compare(json.load(fa), json.load(fb))))
        return 0
    if not args.out:
        ap.error("--out or --compare")
    saved = {}
    for name, fn, consts, warps, stages in kernels():
        k = compile_sm90(fn, consts, False, warps, stages)
        saved[name] = instructions(k.asm["cubin"])
        r = resources(k.asm["cubin"])
        print(f"{name}: {len(saved[name])} instructions, {r.get('reg')} registers a thread, {r.get('stack')} "
              f"stack bytes (spills), {k.metadata.shared} bytes of shared memory; {warps} warps, {stages} stages",
              flush=True)
    with open(args.out, "w") as f:
        json.dump(saved, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
