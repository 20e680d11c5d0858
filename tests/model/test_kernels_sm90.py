"""The Triton kernels of a step compiled for an H100/H200 (sm_90) on the CPU, by Triton's own compiler and its
bundled ptxas (no GPU; ``tools/kernel_sass.py``): with programmatic dependent launch on (``kernels/chain.py``),
every kernel's first instruction that touches global or shared memory comes after ``griddepcontrol.wait``, so
nothing it reads or writes can race the kernel before it (the GEMV loads its weights, which no kernel writes, before
the wait, and nothing else), and ``launch_dependents`` follows; with it off, no
``griddepcontrol`` at all. ptxas must accept each (a cubin comes out). The grouped MoE kernels' tiles, as
``triton_moe.tiles_for`` gives them for a decode step or a prefill in bf16 and float32, fit the shared memory
(a float32 decode tile once asked for 272 KB and failed on the GPU). And the SASS comparison's verdicts."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

from tools.kernel_sass import GROUPED_ROUTE, compile_sm90, instructions, kernels, verdict  # noqa: E402

KERNELS = kernels()
MEMORY = re.compile(r"^\s*(@%p\d+\s+)?(ld|st|atom|red|cp\.async)\.(global|shared)")


def _lines(ptx: str) -> list[str]:
    return [x.strip() for x in ptx.splitlines() if x.strip() and not x.strip().startswith(("//", ".loc"))]


@pytest.mark.unit
@pytest.mark.parametrize("name, fn, consts, warps, stages", KERNELS, ids=[k[0] for k in KERNELS])
def test_chained_kernel_waits_before_touching_memory(name, fn, consts, warps, stages):
    on = compile_sm90(fn, consts, True, warps, stages)
    ptx = on.asm["ptx"].splitlines()
    wait = next((i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line), None)
    touch = next((i for i, line in enumerate(ptx) if MEMORY.match(line)), None)
    assert wait is not None and touch is not None, (wait, touch)
    # a GEMV's weights load first, on purpose: nothing is written, and its input waits (the MoE down projection's
    # also reads the routing's tables, written two launches before); so do the router's rows
    # (``triton_fused.ROUTER_EARLY``)
    if name.startswith("gemv") or name.endswith("_early"):
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
@pytest.mark.parametrize("tokens", [1, 8, 16, 128, 1024, 4096])
@pytest.mark.parametrize("dtype, itemsize, prec", [("bf16", 2, "tf32"), ("fp32", 4, "ieee")])
def test_grouped_moe_tiles_fit_shared_memory(tokens, dtype, itemsize, prec):
    from pushkv.model.kernels import triton_moe as tm

    t = tm.fit_tiles(tm.tiles_for(tokens), itemsize)
    for fn, bn, bk, warps, stages, mats, route in (
            (tm._gate_up_kernel, t.bn_up, t.bk, t.warps, t.stages, 2, GROUPED_ROUTE),
            (tm._down_kernel, t.bn_down, t.bk_down or t.bk, t.down_warps or t.warps, t.down_stages or t.stages, 1,
             {})):
        k = compile_sm90(fn, dict(PREC=prec, BM=t.bm, BN=bn, BK=bk, EVEN=True, ROW_ACT=True, **route), False, warps,
                         stages, dtype)
        assert k.metadata.shared == tm.shared_bytes(t.bm, bn, bk, stages, itemsize, mats), (t, fn.__name__)
        assert k.metadata.shared <= tm.SHARED_BYTES, (t, fn.__name__, k.metadata.shared)


@pytest.mark.unit
def test_sass_verdicts():
    a = ["IMAD R1, R2, 0x4, RZ ;", "LDG.E R3, desc[UR4][R6.64] ;", "EXIT ;"]
    assert verdict(a, list(a)) == "the same instructions"
    assert verdict(a, ["IMAD R7, R2.reuse, 0x8, RZ ;", a[1], a[2]]) == \
        "the same operations in the same order, other registers or constants"
    assert verdict(a, [a[1], a[0], a[2]]) == "the same operations, 2 of them in another place"
    assert verdict(a, [a[0], "STG.E desc[UR4][R6.64], R3 ;", a[2]]) == "other operations: 1 gone, 1 new"


@pytest.mark.unit
def test_fused_merge_counts_in_after_every_thread_stored():
    """Split decode attention with the merge in the kernel: every thread's partials stored before a barrier, then one
    thread's acquire-release add on the tile's counter (its result broadcast through shared memory behind another
    barrier, so every thread takes the same branch after that thread's acquire), and the last resets it to zero."""
    from pushkv.model.kernels import triton_paged
    from tools.kernel_sass import DECODE_ATTN

    ptx = compile_sm90(triton_paged._attn_kernel, dict(DECODE_ATTN, FUSED_MERGE=True), False, 4, 2).asm["ptx"]
    lines = _lines(ptx)
    add = [i for i, x in enumerate(lines) if "atom.global.gpu.acq_rel.add" in x]
    assert len(add) == 1 and lines[add[0]].startswith("@%p"), add  # one thread's
    partials = [i for i, x in enumerate(lines[:add[0]]) if re.match(r"(@%p\d+\s+)?st\.global", x)]
    assert partials and any(x.startswith("bar.sync") for x in lines[max(partials):add[0]])
    after = lines[add[0]:]
    assert re.match(r"@%p\d+ st\.shared", after[1]) and after[2].startswith("bar.sync"), after[:3]
    assert any("atom.global.gpu.relaxed.exch" in x for x in after)
    off = compile_sm90(triton_paged._attn_kernel, DECODE_ATTN, False, 4, 2).asm["ptx"]
    assert "atom." not in off


@pytest.mark.unit
def test_one_launch_down_programs_wait_with_an_acquire_for_a_release_after_every_store():
    """The one-launch MoE decode kernel: a program's work by ticket (one thread's relaxed add, after the wait for the
    kernel before); gate/up's stores, then a barrier, then one thread's release add on the token's counter; down
    spins on a volatile read with a pause after each, then one acquire read (an atomic add of 0 that Triton makes a
    load: it once dropped it as unused), a barrier, and only then reads the products; the last program zeroes the
    counters."""
    from pushkv.model.kernels import triton_moe_decode
    from tools.kernel_sass import ONE_LAUNCH

    k = compile_sm90(triton_moe_decode._one_launch_kernel, ONE_LAUNCH, True, 4, 3)
    lines = _lines(k.asm["ptx"])
    wait = next(i for i, x in enumerate(lines) if "griddepcontrol.wait" in x)
    ticket = next(i for i, x in enumerate(lines) if "atom.global" in x)
    assert wait < ticket and "atom.global.gpu.relaxed.add" in lines[ticket] and lines[ticket].startswith("@%p")
    # one thread's ticket, given to every thread through shared memory behind a barrier (else the others would
    # take another part)
    after = lines[ticket + 1:ticket + 4]
    assert any(re.match(r"@%p\d+ st\.shared", x) for x in after) and after[-1].startswith("bar.sync"), after
    release = [i for i, x in enumerate(lines) if "atom.global.gpu.release.add" in x]
    assert len(release) == 1 and lines[release[0]].startswith("@%p"), release
    stores = [i for i, x in enumerate(lines[:release[0]]) if re.match(r"(@%p\d+\s+)?st\.global", x)]
    assert stores and any(x.startswith("bar.sync") for x in lines[max(stores):release[0]])
    spin = [i for i, x in enumerate(lines) if "ld.volatile.global" in x]
    acquire = [i for i, x in enumerate(lines) if "ld.global.gpu.acquire" in x]
    assert len(spin) == 1 and len(acquire) == 1 and release[0] < spin[0] < acquire[0], (spin, acquire)
    # a pause between two reads of the counter (SPIN_NS), inside the spin
    sleeps = [i for i, x in enumerate(lines) if "nanosleep.u32 200" in x]
    assert len(sleeps) == 1 and spin[0] < sleeps[0] < acquire[0], sleeps
    after = lines[acquire[0] + 1:acquire[0] + 3]  # the acquired count, to every thread
    assert re.match(r"@%p\d+ st\.shared", after[0]) and after[1].startswith("bar.sync"), after
    # after the acquire: a barrier before the products' loads (from L2: .cg)
    reads = [i for i, x in enumerate(lines) if re.match(r"(@%p\d+\s+)?ld\.global\.cg", x)]
    assert reads and min(reads) > acquire[0]
    assert any(x.startswith("bar.sync") for x in lines[acquire[0]:min(reads)])
    assert sum("atom.global.gpu.relaxed.exch" in x for x in lines) >= 1
    # the acquire invalidates L1 in SASS (CCTL.IVALL) after its strong load
    sass = instructions(k.asm["cubin"])
    assert any("CCTL.IVALL" in x for x in sass) and any("LDG.E.STRONG.GPU" in x for x in sass)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["decode_gate_up_prefetch", "decode_one_launch_prefetch", "moe_gate_up_prefetch"])
def test_prefetch_asks_l2_for_lines_only_when_on(name):
    """With PREFETCH a gate/up program asks L2 for its share of its expert's down weights (prefetch ...evict_last,
    CCTL.E.PML2 in SASS: LINES over the program's threads), and the ungrouped gate/up weights load evict-first;
    without it, neither."""
    fn, consts, warps, stages = next((f, c, w, st) for n, f, c, w, st in KERNELS if n == name)
    on = compile_sm90(fn, consts, True, warps, stages)
    off = compile_sm90(fn, {c: v for c, v in consts.items() if c not in ("PREFETCH", "LINES", "LINE")}, True, warps,
                       stages)
    lines = _lines(on.asm["ptx"])
    asks = [x for x in lines if "prefetch.global.L2::evict_last" in x]
    per_thread = consts["LINES"] // (32 * warps)
    assert len(asks) >= per_thread, (len(asks), per_thread)
    sass = instructions(on.asm["cubin"])
    assert sum("CCTL.E.PML2" in x for x in sass) == per_thread
    # each predicated on its line lying in the share: none asked twice, none past the data
    assert all(x.startswith("@") for x in sass if "CCTL.E.PML2" in x)
    assert "prefetch" not in off.asm["ptx"] and not any("CCTL.E.PML2" in x for x in instructions(off.asm["cubin"]))
    if name.startswith("decode"):
        assert any("ld.global.L1::evict_first" in x for x in lines)
        assert not any("evict_first" in x for x in _lines(off.asm["ptx"]))


@pytest.mark.unit
def test_ahead_launch_lets_the_next_kernel_go_then_asks_then_waits():
    """``prefetch.ahead``'s kernel, chained: launch_dependents first (the kernel after it is scheduled as early as
    without it), then only L2 prefetches (no load or store of any value), then the wait, so that it ends only
    after the kernel before it: the next kernel's wait still covers that one. Unchained: no griddepcontrol."""
    from pushkv.model.kernels import prefetch

    on = compile_sm90(prefetch._ahead_kernel, dict(LINES=2048, LINE=64), True, prefetch.AHEAD_WARPS, 1)
    lines = _lines(on.asm["ptx"])
    go = next(i for i, x in enumerate(lines) if "griddepcontrol.launch_dependents" in x)
    wait = next(i for i, x in enumerate(lines) if "griddepcontrol.wait" in x)
    asks = [i for i, x in enumerate(lines) if "prefetch.global.L2::evict_last" in x]
    assert go < min(asks) and max(asks) < wait, (go, asks[:2], wait)
    assert not any(MEMORY.match(x) for x in lines), [x for x in lines if MEMORY.match(x)]
    assert sum("CCTL.E.PML2" in x for x in instructions(on.asm["cubin"])) == 2048 // (32 * prefetch.AHEAD_WARPS)
    off = compile_sm90(prefetch._ahead_kernel, dict(LINES=2048, LINE=64), False, prefetch.AHEAD_WARPS, 1)
    assert "griddepcontrol" not in off.asm["ptx"] and "prefetch.global.L2" in off.asm["ptx"]


@pytest.mark.unit
def test_prefetch_lines_cover_each_share():
    """``lines_for``: a share's lines, rounded up to a power of two, cover its elements (a Qwen3-30B-A3B o
    projection, 2048 x 4096 bf16, over 132 programs: 63,550 elements a share, 993 lines, 1,024 asked)."""
    from pushkv.model.kernels.prefetch import lines_for

    for elems, shares, size in ((2048 * 4096, 132, 2), (2048 * 768, 48, 2), (5120 * 2048, 132, 4), (100, 7, 2)):
        lines, line = lines_for(elems, shares, size)
        assert line * size == 128 and lines & (lines - 1) == 0
        per = -(-elems // shares)
        assert lines * line >= per and (lines // 2) * line < per, (elems, shares, lines, line)
    assert lines_for(2048 * 4096, 132, 2) == (1024, 64)


@pytest.mark.unit
def test_own_prefetch_asks_for_every_line_of_the_tile_before_its_loads():
    """``PREFETCH_OWN_TOKENS``: a grouped gate/up program asks L2 for its gate and up rows (a decode step's 64
    columns x 2 x 2048 bf16: 4,096 lines, 32 a thread), a down program for its rows (64 x 768: 16 lines a row
    rounded up, 16 a thread on 2 warps), at normal priority (CCTL.E.PF2 in SASS, not the evict-last PML2), after
    the wait and before the first weight load; without it, none."""
    from pushkv.model.kernels import triton_moe as tm
    from tools.kernel_sass import GROUPED, GROUPED_ROUTE

    dt = tm.tiles_for(1)
    for fn, consts, warps, stages, lines in (
            (tm._gate_up_kernel, dict(GROUPED, **GROUPED_ROUTE, BM=dt.bm, BN=dt.bn_up, BK=dt.bk), dt.warps, dt.stages,
             dt.bn_up * 2 * 32),
            (tm._down_kernel, dict(GROUPED, BM=dt.bm, BN=dt.bn_down, BK=dt.bk_down), dt.down_warps, dt.down_stages,
             dt.bn_down * 16)):
        lpr = 32 if fn is tm._gate_up_kernel else 16
        on = compile_sm90(fn, dict(consts, OWN=True, LPR=lpr, LINE=64), True, warps, stages)
        ptx = _lines(on.asm["ptx"])
        asks = [i for i, x in enumerate(ptx) if x.startswith("prefetch.global.L2 ") or " prefetch.global.L2 [" in x]
        wait = next(i for i, x in enumerate(ptx) if "griddepcontrol.wait" in x)
        first_weight = next(i for i, x in enumerate(ptx) if "cp.async" in x)
        assert asks and wait < min(asks) and max(asks) < first_weight, (fn.__name__, wait, asks[:1], first_weight)
        assert not any("evict_last" in x for x in ptx)
        sass = instructions(on.asm["cubin"])
        assert sum("CCTL.E.PF2" in x for x in sass) == lines // (32 * warps), fn.__name__
        off = compile_sm90(fn, consts, True, warps, stages)
        assert "prefetch" not in off.asm["ptx"]


# a thread's own-row asks: gate/up's 16 gate and 16 up rows of 32 lines over 128 threads; down's 4 rows of 16
# lines an expert (64: every thread holds one, half of them twice over), for each of 8 experts
GATE_UP_ASKS, DOWN_ASKS = 16 * 2 * 32 // 128, 8 * max(1, 4 * 16 // 128)


@pytest.mark.unit
@pytest.mark.parametrize("name, asks", [("decode_gate_up_own", GATE_UP_ASKS), ("decode_down_own", DOWN_ASKS),
                                        ("decode_one_launch_own", GATE_UP_ASKS + DOWN_ASKS)])
def test_ungrouped_own_prefetch_asks_for_the_whole_tile(name, asks):
    """``triton_moe_decode.PREFETCH_OWN``: a gate/up program asks L2 for its 16 gate and 16 up rows (2048 bf16:
    32 lines each), a down program for its 4 rows of each of its token's 8 experts (768 bf16: 12 lines, 16
    asked), at normal priority (CCTL.E.PF2); in one launch both, beside the evict-last asks of the down weights."""
    fn, consts, warps, stages = next((f, c, w, st) for n, f, c, w, st in KERNELS if n == name)
    sass = instructions(compile_sm90(fn, consts, True, warps, stages).asm["cubin"])
    assert sum("CCTL.E.PF2" in x for x in sass) == asks
    if "LINES" in consts:
        assert sum("CCTL.E.PML2" in x for x in sass) == consts["LINES"] // (32 * warps)


@pytest.mark.unit
def test_decode_attention_asks_for_its_first_key_tile_before_the_wait():
    """``triton_paged.PREFETCH_KV``: before the wait a decode attention program reads only the step's tables (the
    tile's sequence and first query, the sequence's keys, queries and first row, and its block table's entries:
    six loads, no store) and asks L2 for its first key tile's K and V rows (64 keys x 2 lines of 128 dims, one
    line of each a thread); q, written by the kernel before, loads after the wait. Off: nothing before it."""
    from pushkv.model.kernels import triton_paged
    from tools.kernel_sass import DECODE_ATTN

    on = compile_sm90(triton_paged._attn_kernel, dict(DECODE_ATTN, PREFETCH_KV=True, LPR=2, LINE=64), True, 4, 2)
    lines = _lines(on.asm["ptx"])
    wait = next(i for i, x in enumerate(lines) if "griddepcontrol.wait" in x)
    early = [x for x in lines[:wait] if MEMORY.match(x)]
    assert len(early) == 6 and all(re.match(r"^(@%p\d+\s+)?ld\.global\.b32", x) for x in early), early
    asks = [x for x in lines[:wait] if "prefetch.global.L2 [" in x]
    assert len(asks) == 2, asks
    assert sum("CCTL.E.PF2" in x for x in instructions(on.asm["cubin"])) == 2
    assert any(MEMORY.match(x) for x in lines[wait:])
    off = _lines(compile_sm90(triton_paged._attn_kernel, DECODE_ATTN, True, 4, 2).asm["ptx"])
    wait = next(i for i, x in enumerate(off) if "griddepcontrol.wait" in x)
    assert not any(MEMORY.match(x) or "prefetch" in x for x in off[:wait])


EARLY_NEXT = [k for k in KERNELS if any(p.name == "NEXT_EARLY" for p in k[1].params)]


@pytest.mark.unit
@pytest.mark.parametrize("name, fn, consts, warps, stages", EARLY_NEXT, ids=[k[0] for k in EARLY_NEXT])
def test_next_early_lets_the_next_kernel_in_before_the_wait(name, fn, consts, warps, stages):
    """``chain.EARLY_NEXT``: a kernel launched with ``NEXT_EARLY`` lets the next kernel be scheduled
    (``griddepcontrol.launch_dependents``) before it waits, and touches no memory it waits for before the wait
    (the same loads before the wait as without it); without it, after the wait."""
    lines = {}
    for early in (False, True):
        lines[early] = _lines(compile_sm90(fn, dict(consts, NEXT_EARLY=early), True, warps, stages).asm["ptx"])
    for early, ptx in lines.items():
        wait = next(i for i, x in enumerate(ptx) if "griddepcontrol.wait" in x)
        launch = [i for i, x in enumerate(ptx) if "griddepcontrol.launch_dependents" in x]
        assert len(launch) == 1 and (launch[0] < wait) == early, (name, early, wait, launch)
    before = {e: [x for x in ptx[:next(i for i, x in enumerate(ptx) if "griddepcontrol.wait" in x)]
                  if MEMORY.match(x)] for e, ptx in lines.items()}
    assert len(before[True]) == len(before[False]), before


@pytest.mark.unit
def test_every_chained_step_kernel_takes_next_early():
    """Each name ``chain.launch`` takes is a kernel of the step that declares ``NEXT_EARLY``, and an unknown
    name is refused (a misspelt one would otherwise time the step unchanged)."""
    import torch

    from pushkv.model.kernels import chain

    takes = {k[0] for k in EARLY_NEXT}
    assert {"add_rms", "add_rms_router", "qk_rope_store", "attn_decode", "attn_merge", "route_group", "moe_gate_up",
            "moe_down", "gemv_o"} <= takes, takes
    with pytest.raises(ValueError, match="unknown kernel name"):
        chain.launch(torch.empty(1), "attention")
    assert chain.launch(torch.empty(1), "attn") == {"PDL": False}  # off the GPU: no PDL, nothing early
