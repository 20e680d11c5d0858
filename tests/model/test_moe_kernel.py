"""The MoE kernels (model/kernels/triton_moe.py, triton_moe_decode.py) equal the torch reference
(model/moe.py): the slot grouping in-process, the kernels under Triton's interpreter on the CPU
(a child process: the switch is read at import) and on a GPU when there is one: the fused routing
and grouping kernel against ``route`` + ``group_slots`` exactly, the grouped layer against the
reference at every tile ``tiles_for`` picks (and at the grouped tiles for a few tokens), the decode
kernels (1, 2, 7, 8 tokens; ties; renormalised or not) against the reference routed with the
kernels' tie rule, bit for bit run to run and batch to batch, and at the reference's rounding points
(float16, whose rounding the interpreter does as the GPU does); the decode kernels in one launch and with
the down weights prefetched, and the grouped kernels with the prefetch, the same bits as without; and (GPU)
the layer captured in a CUDA graph and replayed on new tokens, also in one launch.

    pytest tests/model/test_moe_kernel.py -v -p no:cacheprovider    (on a GPU: the GPU cases)
"""
import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from pushkv.model.kernels.triton_moe import group_slots  # noqa: E402

# (tokens, experts, k, hidden, intermediate, renorm, dtype): sizes off the tiles' multiples, so
# every mask is exercised; one token (a decode step) to more slots than one row block
CASES = [(1, 8, 2, 32, 48, "renorm", "float32"), (5, 4, 2, 40, 24, "", "float32"),
         (37, 8, 3, 64, 80, "renorm", "float32"), (300, 6, 2, 32, 32, "", "float32"),
         (9, 12, 8, 32, 40, "renorm", "float32"),  # E not a power of two, k = 8 (Qwen3-MoE's)
         (20, 8, 2, 128, 128, "renorm", "float32")]  # whole tiles of every size tiles_for picks: loads unmasked

# the child scripts' layer: a token batch, the router (``ties``: every expert has a twin, rows 2m and 2m+1
# equal) and the experts' weights, drawn in this order from one generator
DRAW = r"""
def draw(T, E, d, i, dtype, seed, dev, ties=""):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    h = torch.randn(T, d, generator=g)
    router = torch.randn(E, d, generator=g)
    if ties:
        router[1::2] = router[0:E - E % 2:2]
    h, router = h.to(dev, dt), router.to(dev, dt)
    gate_up = (torch.randn(E, 2 * i, d, generator=g) / d ** 0.5).to(dev, dt)
    down = (torch.randn(E, d, i, generator=g) / i ** 0.5).to(dev, dt)
    return h, router, gate_up, down
"""

SCRIPT = r"""
import json, sys, torch
from pushkv.model.moe import moe_mlp, route
from pushkv.model.kernels import triton_moe, triton_moe_decode
""" + DRAW + r"""
dev = sys.argv[1]
out = []
for T, E, k, d, i, renorm, dtype in json.loads(sys.argv[2]):
    h, router, gate_up, down = draw(T, E, d, i, dtype, T * 7 + E, dev)
    ref = moe_mlp(h, router, gate_up, down, k, bool(renorm)).float().cpu()
    got = triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm)).float().cpu()
    # the gate/up programs asking L2 for the down weights (on a GPU; a no-op under the interpreter): the same bits
    # and each program asking for its own rows first, with and without that
    ahead = True
    for down_ahead, own in ((True, False), (False, True), (True, True)):
        triton_moe.PREFETCH_DOWN_TOKENS = triton_moe_decode.DECODE_TOKENS if down_ahead else 0
        triton_moe.PREFETCH_OWN_TOKENS = triton_moe_decode.DECODE_TOKENS if own else 0
        ahead &= torch.equal(triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm)).float().cpu(), got)
    triton_moe.PREFETCH_DOWN_TOKENS = triton_moe.PREFETCH_OWN_TOKENS = 0
    # every grouped tile size tiles_for picks, and the grouped path at a decode step's few tokens, on the
    # smaller shapes (the interpreter is slow)
    tiles = {triton_moe.tiles_for(n) for n in (100, 5000)} | {triton_moe.Tiles(16, 32, 64, 128)} if T < 10 else set()
    # and the down kernel with its own depth, warps and stages
    tiles |= {triton_moe.tiles_for(n) for n in (100, 5000)} | {triton_moe.Tiles(64, 64, 128, 64, 4, 3, 128, 8, 4)} \
        if d % 128 == 0 and i % 128 == 0 else set()
    errs = [float((ref - triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm), tiles=t).float().cpu())
                  .abs().max()) for t in tiles] + [0.0]
    # the product in slot order and masked loads (what experiments/moe_prefill_probe.py measures against)
    triton_moe.ROW_ACT = triton_moe.EVEN_LOADS = False
    errs.append(float((ref - triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm)).float().cpu()).abs().max()))
    triton_moe.ROW_ACT = triton_moe.EVEN_LOADS = True
    # the fused routing + grouping against route + group_slots: each token's same experts (as a set: CUDA's top-k
    # may order a token's k experts differently from the CPU's) and the same slot table
    w, ex = route(h, router, k, bool(renorm))
    bm = 16
    kw, kex, slots, blocks = triton_moe.route_group(h, router, k, bool(renorm), bm)
    ref_slots, ref_blocks = triton_moe.group_slots(kex.view(T, k).long(), E, bm)
    # a prefill's grouping across the GPU: the same routing, each expert's run holding the same slots (in
    # any order) and the same blocks; the layer's per-slot products bit for bit those of the sorted table
    ww, wex, wslots, wblocks = triton_moe.route_group_wide(h, router, k, bool(renorm), bm)
    canon = lambda sl, bl: torch.sort(bl.repeat_interleave(bm).long().cpu() * (T * k + 1) + sl.long().cpu()).values
    t16 = triton_moe.Tiles(16, 32, 32, 32)
    per_slot = lambda sl, bl: triton_moe.down_per_slot(triton_moe.gate_up_product(h, gate_up, sl, bl, k, t16), down,
                                                      kw, sl, bl, T * k, t16)
    wide = (torch.equal(ww, kw) and torch.equal(wex, kex) and torch.equal(wblocks.cpu(), ref_blocks.cpu())
            and torch.equal(canon(wslots, wblocks), canon(ref_slots, ref_blocks))
            and torch.equal(per_slot(wslots, wblocks), per_slot(ref_slots.to(dev), ref_blocks.to(dev))))
    out.append({"err": float((ref - got).abs().max()), "tile_err": max(errs), "scale": float(ref.abs().max()),
                "wide": wide, "prefetch_same": ahead,
                "experts": [sorted(r) for r in ex.tolist()] == [sorted(r) for r in kex.view(T, k).long().tolist()],
                "weights": float((w.float().sort(-1).values - kw.view(T, k).float().sort(-1).values).abs().max()),
                "slots": torch.equal(slots.cpu(), ref_slots.cpu()) and torch.equal(blocks.cpu(), ref_blocks.cpu())})
print(json.dumps(out))
"""

# (tokens, experts, k, hidden, intermediate, renorm, ties, dtype, tiles). "ties": every expert has a
# twin (router rows 2m and 2m+1 equal), so each token's probabilities come in tied pairs: with k odd
# the k-th choice splits a pair (the lower expert is to win), with k even a pair is chosen whole.
# float16 at k = 2 checks the rounding points: the interpreter rounds float16 as the GPU does (its
# bfloat16 truncates), and two slots sum alike in float32 and in the reference's float16 adds.
# Tiles: "default" (decode_tiles_for), "fine" (every shape cut into several masked column tiles and
# depth chunks; one router row a program), "coarse" (the router in torch; partial tiles).
DECODE_CASES = [(1, 8, 2, 32, 48, "renorm", "", "float32", "default"),
                (1, 10, 3, 24, 40, "", "ties", "float32", "fine"),
                (2, 12, 8, 40, 24, "", "", "float32", "coarse"),  # E not a power of two, k = 8 (Qwen3-MoE's)
                (2, 8, 3, 32, 32, "renorm", "ties", "float32", "fine"),
                (7, 8, 3, 40, 48, "renorm", "ties", "float32", "coarse"),
                (7, 6, 2, 32, 32, "", "ties", "float32", "default"),
                (8, 6, 2, 40, 24, "", "", "float32", "coarse"),
                (8, 16, 5, 32, 24, "renorm", "ties", "float32", "coarse"),
                (1, 8, 2, 64, 96, "renorm", "", "float16", "default"),
                (8, 12, 2, 64, 48, "", "ties", "float16", "coarse")]

DECODE_SCRIPT = r"""
import json, sys, torch
from pushkv.model.moe import routed_experts, route
from pushkv.model.kernels import triton_moe
from pushkv.model.kernels.triton_moe_decode import DecodeTiles, decode_tiles_for, moe_mlp_decode, router_logits
""" + DRAW + r"""
dev = sys.argv[1]
out = []
TILES = {"default": decode_tiles_for(1), "fine": DecodeTiles(16, 16, 4, 16, 1, 2, 2),
         "coarse": DecodeTiles(32, 64, 16, 64, 0, 8, 3)}


def stable_route(logits, k, renorm, dtype):
    # the kernels' tie rule: the larger probability first, the lower expert on a tie
    probs = logits.float().softmax(dim=-1)
    experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = probs.gather(1, experts)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), experts


for T, E, k, d, i, renorm, ties, dtype, tiles in json.loads(sys.argv[2]):
    tiles = TILES[tiles]
    dt = getattr(torch, dtype)
    h, router, gate_up, down = draw(T, E, d, i, dtype, T * 11 + E + k, dev, ties)
    # routed from the logits the kernels computed (checked on their own below), so a bfloat16 logit that
    # rounds one way on the device and another on the CPU cannot change the experts compared
    logits = router_logits(h, router, tiles.be).cpu()
    w_ref, ex_ref = stable_route(logits, k, bool(renorm), dt)
    ref = routed_experts(h.cpu(), w_ref, ex_ref, gate_up.cpu(), down.cpu()).float()
    got, w, ex = moe_mlp_decode(h, router, gate_up, down, k, bool(renorm), tiles)
    # run to run (on the CPU numpy's, so only on a GPU), and each token alone as in the batch (with the
    # router's own kernel: torch's matmul may sum a batch's logits in another order than one token's)
    again = moe_mlp_decode(h, router, gate_up, down, k, bool(renorm), tiles)[0] if dev != "cpu" else got
    alone = torch.cat([moe_mlp_decode(h[t:t + 1], router, gate_up, down, k, bool(renorm), tiles)[0]
                       for t in range(T)]) if T > 1 and tiles.be else got
    # gate/up and down in one launch, and with the down weights prefetched (a no-op off the GPU): the same bits,
    # twice in a row (the launch leaves its counters zero for the next), and the counters zero after
    from pushkv.model.kernels import triton_moe_decode
    one = []
    for one_launch, ahead, own in ((True, False, False), (True, False, False), (False, True, False),
                                   (True, True, False), (False, False, True), (True, True, True)):
        triton_moe_decode.ONE_LAUNCH, triton_moe_decode.PREFETCH_DOWN = one_launch, ahead
        triton_moe_decode.PREFETCH_OWN = own
        one.append(moe_mlp_decode(h, router, gate_up, down, k, bool(renorm), tiles))
    triton_moe_decode.ONE_LAUNCH = triton_moe_decode.PREFETCH_DOWN = triton_moe_decode.PREFETCH_OWN = False
    one_launch = all(torch.equal(a, b) for o in one for a, b in zip(o, (got, w, ex))) and \
        not bool(triton_moe_decode.counters(h.device, T).any())
    exact = h.cpu().double() @ router.cpu().double().T
    diff = (ref - got.float().cpu()).abs()
    out.append({
        "err": float(diff.max()), "scale": float(ref.abs().max()), "frac_differ": float((diff > 0).float().mean()),
        "via_moe_mlp": torch.equal(triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm), tiles), got)
        if tiles == decode_tiles_for(T) else None,
        "experts": ex.long().cpu().tolist() == ex_ref.tolist(),
        "topk_sets": [sorted(r) for r in ex.long().cpu().tolist()] == [sorted(r) for r in route(
            h.cpu(), router.cpu(), k, bool(renorm))[1].tolist()] if not ties else None,
        "weights": float((w.float().cpu() - w_ref.float()).abs().max()),
        "same_bits": torch.equal(got, again), "batch_invariant": torch.equal(got, alone), "one_launch": one_launch,
        "logits_err": float((logits.double() - exact).abs().max() / exact.abs().max()),
        "has_ties": bool((logits[:, 0] == logits[:, 1]).all()) if ties else None})
print(json.dumps(out))
"""


def _run(device: str, cases, script: str = SCRIPT) -> list[dict]:
    env = dict(os.environ)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", script, device, json.dumps(cases)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("T, E, k, bm", [(1, 8, 2, 16), (7, 3, 2, 4), (40, 8, 4, 16), (5, 16, 1, 16)])
def test_slots_are_grouped_by_expert_in_whole_blocks(T, E, k, bm):
    experts = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:k] for t in range(T)])
    slot_ids, block_expert = group_slots(experts, E, bm)
    n = T * k
    assert slot_ids.numel() == block_expert.numel() * bm
    real = slot_ids[slot_ids < n]
    assert sorted(real.tolist()) == list(range(n))  # every slot once
    flat = experts.flatten()
    for b, e in enumerate(block_expert.tolist()):
        rows = slot_ids[b * bm:(b + 1) * bm]
        rows = rows[rows < n]
        if e < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and bool((flat[rows.long()] == e).all())  # a block holds one expert's slots
            assert rows.tolist() == sorted(rows.tolist())  # tokens in order within an expert
    used = int((block_expert >= 0).sum())
    assert used == sum(-(-int((flat == e).sum()) // bm) for e in range(E))  # no block more than needed


@pytest.mark.unit  # the skip reason names CUDA, which would file it (and skip it, off a GPU) as a GPU test
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernels themselves (below)")
def test_kernels_equal_the_reference_under_the_interpreter():
    for case, r in zip(CASES, _run("cpu", CASES)):
        assert r["err"] <= 1e-4 * max(1.0, r["scale"]) and r["tile_err"] <= 1e-4 * max(1.0, r["scale"]), (case, r)
        assert r["experts"] and r["slots"] and r["wide"] and r["prefetch_same"] and r["weights"] <= 1e-6, (case, r)


def _check_decode(case, r, tol: float) -> None:
    dtype = case[7]
    assert r["experts"] and r["topk_sets"] in (None, True), (case, r)  # the tie rule, and torch's top-k elsewhere
    assert r["has_ties"] in (None, True), (case, r)  # the twins did tie
    assert r["weights"] <= {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2}[dtype], (case, r)  # an ulp or two
    assert r["logits_err"] <= {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}[dtype], (case, r)
    assert r["err"] <= tol * max(1.0, r["scale"]), (case, r)
    assert r["same_bits"] and r["batch_invariant"] and r["via_moe_mlp"] in (None, True), (case, r)
    assert r["one_launch"], (case, r)


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernels themselves (below)")
def test_decode_kernels_equal_the_reference_under_the_interpreter():
    for case, r in zip(DECODE_CASES, _run("cpu", DECODE_CASES, DECODE_SCRIPT)):
        _check_decode(case, r, 1e-4 if case[7] == "float32" else 2e-3)
        if case[7] == "float16":  # a rounding point left out or added shows in a third or more of the outputs
            assert r["frac_differ"] <= 0.02, (case, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_kernels_equal_the_reference():
    cases = DECODE_CASES + [c[:7] + ("bfloat16", c[8]) for c in DECODE_CASES if c[7] == "float32"]
    for case, r in zip(cases, _run("cuda", cases, DECODE_SCRIPT)):
        _check_decode(case, r, {"float32": 1e-4, "float16": 2e-3, "bfloat16": 3e-2}[case[7]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernels_equal_the_reference():
    cases = CASES + [(c[0], c[1], c[2], c[3], c[4], c[5], "bfloat16") for c in CASES]
    for case, r in zip(cases, _run("cuda", cases)):
        tol = 1e-4 if case[-1] == "float32" else 3e-2
        assert r["err"] <= tol * max(1.0, r["scale"]) and r["tile_err"] <= tol * max(1.0, r["scale"]), (case, r)
        assert r["experts"] and r["slots"] and r["prefetch_same"], (case, r)
        assert r["weights"] <= (1e-6 if case[-1] == "float32" else 1e-2), (case, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 8, 64, 200])  # 200: routed and grouped in torch
def test_gpu_layer_captured_in_a_cuda_graph_replays_new_tokens(T):
    """The layer waits for no host read: captured once, replayed on other tokens (other experts
    chosen), it equals the reference on them."""
    from pushkv.model.kernels import triton_moe
    from pushkv.model.moe import moe_mlp

    g = torch.Generator().manual_seed(T)
    E, k, d, i = 32, 4, 256, 128
    router = torch.randn(E, d, generator=g).cuda()
    gate_up = (torch.randn(E, 2 * i, d, generator=g) / d ** 0.5).cuda()
    down = (torch.randn(E, d, i, generator=g) / i ** 0.5).cuda()
    h = torch.randn(T, d, generator=g).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        triton_moe.moe_mlp(h, router, gate_up, down, k, True)  # compiles
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.moe_mlp(h, router, gate_up, down, k, True)
    for _ in range(3):
        h.copy_(torch.randn(T, d, generator=g).cuda())
        graph.replay()
        ref = moe_mlp(h, router, gate_up, down, k, True)
        assert float((out - ref).abs().max()) <= 1e-4 * max(1.0, float(ref.abs().max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 2, 8])
@pytest.mark.parametrize("ahead", [False, True])
def test_gpu_one_launch_replayed_in_a_cuda_graph_equals_two_launches(T, ahead):
    """The ungrouped decode kernels in one launch at Qwen3-30B-A3B's shapes (bf16), where its down programs truly
    wait on other programs: captured once and replayed on 50 new batches, each
    replay the two launches' bits (eager), and the counters zero after; ``ahead``: with the down weights asked of
    L2 by gate/up and every program's own rows too."""
    from pushkv.model.kernels import triton_moe_decode as tmd

    g = torch.Generator().manual_seed(T)
    E, k, d, i = 128, 8, 2048, 768
    dt = torch.bfloat16
    router = torch.randn(E, d, generator=g).to("cuda", dt)
    gate_up = (torch.randn(E, 2 * i, d, generator=g) / d ** 0.5).to("cuda", dt)
    down = (torch.randn(E, d, i, generator=g) / i ** 0.5).to("cuda", dt)
    h = torch.randn(T, d, generator=g).to("cuda", dt)
    tiles = tmd.decode_tiles_for(T)
    try:
        tmd.ONE_LAUNCH, tmd.PREFETCH_DOWN, tmd.PREFETCH_OWN = True, ahead, ahead
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            tmd.moe_mlp_decode(h, router, gate_up, down, k, True, tiles)  # compiles
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                out = tmd.moe_mlp_decode(h, router, gate_up, down, k, True, tiles)[0]
        torch.cuda.current_stream().wait_stream(side)
        for _ in range(50):
            h.copy_(torch.randn(T, d, generator=g).to("cuda", dt))
            graph.replay()
            tmd.ONE_LAUNCH = tmd.PREFETCH_DOWN = tmd.PREFETCH_OWN = False
            two = tmd.moe_mlp_decode(h, router, gate_up, down, k, True, tiles)[0]
            tmd.ONE_LAUNCH, tmd.PREFETCH_DOWN, tmd.PREFETCH_OWN = True, ahead, ahead
            assert torch.equal(out, two)
        assert not bool(tmd.counters(h.device, T).any())
    finally:
        tmd.ONE_LAUNCH = tmd.PREFETCH_DOWN = tmd.PREFETCH_OWN = False


def test_decode_steps_take_the_grouped_kernels_unless_the_ungrouped_are_asked_for(monkeypatch):
    """The ungrouped decode kernels are not yet measured on a GPU: opt-in (PUSHKV_MOE_DECODE)."""
    from pushkv.model.kernels import triton_moe
    from pushkv.model.kernels.triton_moe_decode import decode_tiles_for

    monkeypatch.delenv("PUSHKV_MOE_DECODE", raising=False)
    assert all(isinstance(triton_moe.tiles_for(t), triton_moe.Tiles) for t in (1, 8, 64, 4096))
    monkeypatch.setenv("PUSHKV_MOE_DECODE", "ungrouped")
    assert triton_moe.tiles_for(1) == decode_tiles_for(1) and triton_moe.tiles_for(8) == decode_tiles_for(8)
    assert isinstance(triton_moe.tiles_for(64), triton_moe.Tiles)


# one token (a decode step of one sequence): (experts, k, hidden, intermediate, renorm, ties, dtype)
SELF_ROUTE_CASES = [(8, 2, 32, 48, "renorm", "", "float32"), (12, 8, 40, 24, "", "", "float32"),
                    (10, 3, 32, 32, "renorm", "ties", "float32"), (16, 5, 64, 96, "", "ties", "float16")]

SELF_ROUTE_SCRIPT = r"""
import json, sys, torch
import torch.nn.functional as F
from pushkv.model.moe import moe_mlp
from pushkv.model.kernels import triton_moe
""" + DRAW + r"""
dev = sys.argv[1]
out = []
# the routing in gate/up serves the grouped kernels: those, routed apart, are what it must equal to the bit
triton_moe.ROWS_ONE_TOKEN = triton_moe.DOWN_ROWS_ONE_TOKEN = False
for E, k, d, i, renorm, ties, dtype in json.loads(sys.argv[2]):
    h, router, gate_up, down = draw(1, E, d, i, dtype, E * 5 + k, dev, ties)
    logits = F.linear(h, router)
    ref = moe_mlp(h, router, gate_up, down, k, bool(renorm)).float().cpu()
    res = {}
    for on in (False, True):
        triton_moe.SELF_ROUTE_ONE_TOKEN = on
        res[on] = [triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm), summed=False),
                   triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm), logits=logits),
                   triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm))]
    # the tables the gate/up kernel writes: slot j's row block holds its choice, the weights the grouping's
    tiles = triton_moe.fit_tiles(triton_moe.tiles_for(1), h.element_size())
    kw, kex, _, _ = triton_moe.group_logits(logits, k, bool(renorm), tiles.bm)
    route = triton_moe.SelfRoute(logits, k, bool(renorm))
    w, _, slots, blocks = triton_moe._routing_buffers(logits, k, tiles.bm, blocks=k)
    slots.fill_(-7), blocks.fill_(-7)
    triton_moe.gate_up_product(h, gate_up, slots, blocks, k, tiles, route, w)
    off, on = res[False], res[True]
    out.append({"same_bits": all(torch.equal(a, b) for a, b in zip(off, on)),
                "max_diff": max(float((a.float() - b.float()).abs().max()) for a, b in zip(off, on)),
                "err": float((ref - on[2].float().cpu()).abs().max()), "scale": float(ref.abs().max()),
                "experts": blocks.tolist() == kex.tolist(), "weights": float((w.float() - kw.float()).abs().max()),
                "slots": slots.tolist() == [j if r == 0 else k for j in range(k) for r in range(tiles.bm)],
                "has_ties": bool(logits[0, 0] == logits[0, 1]) if ties else None})
print(json.dumps(out))
"""


def _check_self_route(case, r, exact: bool) -> None:
    tol = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 3e-2}[case[-1]]
    assert r["experts"] and r["slots"] and r["has_ties"] in (None, True), (case, r)
    assert r["weights"] <= (0 if exact else 1e-2), (case, r)
    assert r["err"] <= tol * max(1.0, r["scale"]), (case, r)
    # the interpreter sums the softmax in one order, so the routing is the grouping's to the bit; a GPU's
    # reductions over other warps may move a weight by an ulp of its dtype
    assert r["same_bits"] if exact else r["max_diff"] <= tol * max(1.0, r["scale"]), (case, r)


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernels themselves (below)")
def test_one_token_routed_by_the_gate_up_kernel_equals_the_grouping_under_the_interpreter():
    """``SELF_ROUTE_ONE_TOKEN``: no routing launch, the gate/up kernel routes the token and writes the tables
    the down kernel reads; each choice in its own row block, in choice order (the grouping's experts, ties to
    the lower expert), and the layer the grouped path's, summed or not, with the router's logits given or not."""
    for case, r in zip(SELF_ROUTE_CASES, _run("cpu", SELF_ROUTE_CASES, SELF_ROUTE_SCRIPT)):
        _check_self_route(case, r, exact=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_one_token_routed_by_the_gate_up_kernel_equals_the_grouping():
    cases = SELF_ROUTE_CASES + [c[:6] + ("bfloat16",) for c in SELF_ROUTE_CASES]
    for case, r in zip(cases, _run("cuda", cases, SELF_ROUTE_SCRIPT)):
        _check_self_route(case, r, exact=False)


# (tokens, experts, k, hidden, intermediate, renorm, dtype): one token to a few sharing experts (rows of one block
# taken in turn), an intermediate size off a power of two (masked depth), hidden off the column tile
DOWN_GEMV_CASES = [(1, 8, 2, 32, 48, "renorm", "float32"), (1, 12, 8, 40, 24, "", "float32"),
                   (5, 4, 2, 40, 24, "renorm", "float32"), (8, 6, 3, 64, 96, "", "float16")]

DOWN_GEMV_SCRIPT = r"""
import json, sys, torch
from pushkv.model.moe import moe_mlp
from pushkv.model.kernels import triton_moe
""" + DRAW + r"""
dev = sys.argv[1]
out = []
calls = []
real = triton_moe._down_gemv_kernel
class Counted:
    def __getitem__(self, grid):
        calls.append(grid)
        return real[grid]
triton_moe._down_gemv_kernel = Counted()
triton_moe.ROWS_ONE_TOKEN = triton_moe.DOWN_ROWS_ONE_TOKEN = False  # (the whole-row kernels come before the GEMVs)
for T, E, k, d, i, renorm, dtype in json.loads(sys.argv[2]):
    h, router, gate_up, down = draw(T, E, d, i, dtype, T * 13 + E + k, dev)
    ref = moe_mlp(h, router, gate_up, down, k, bool(renorm)).float().cpu()
    triton_moe.DOWN_GEMV_TOKENS = 0
    grouped = triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm), summed=False).float().cpu()
    errs = []
    for cols in (1, 4, 8):
        for row_act in (True, False):
            triton_moe.DOWN_GEMV_TOKENS, triton_moe.DOWN_GEMV_COLUMNS, triton_moe.ROW_ACT = 8, cols, row_act
            n = len(calls)
            got = triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm), summed=False).float().cpu()
            errs.append({"took_gemv": len(calls) == n + 1, "vs_grouped": float((got - grouped).abs().max()),
                         "vs_ref": float((got.sum(1) - ref).abs().max())})
    triton_moe.DOWN_GEMV_TOKENS, triton_moe.DOWN_GEMV_COLUMNS, triton_moe.ROW_ACT = 0, 8, True
    out.append({"runs": errs, "scale": float(ref.abs().max())})
print(json.dumps(out))
"""


def _check_down_gemv(case, r) -> None:
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}[case[-1]] * max(1.0, r["scale"])
    for run in r["runs"]:
        assert run["took_gemv"], (case, run)
        # each slot's product as the grouped kernel gives it, to the rounding of another order of sums
        assert run["vs_grouped"] <= tol and run["vs_ref"] <= 10 * tol, (case, run)


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernels themselves (below)")
def test_down_projection_as_gemvs_equals_the_grouped_kernel_under_the_interpreter():
    """``DOWN_GEMV_TOKENS``: the down projections of a few tokens as GEMVs whose weights load before the wait;
    1, 4 and 8 columns a program, the products in the slot table's rows or in slot order."""
    cases = DOWN_GEMV_CASES[2:]  # (off by default: the interpreter's seconds go to two shapes, both routings; the GPU
    for case, r in zip(cases, _run("cpu", cases, DOWN_GEMV_SCRIPT)):  # test below runs every shape, both dtypes)
        _check_down_gemv(case, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_down_projection_as_gemvs_equals_the_grouped_kernel():
    cases = DOWN_GEMV_CASES + [c[:6] + ("bfloat16",) for c in DOWN_GEMV_CASES]
    for case, r in zip(cases, _run("cuda", cases, DOWN_GEMV_SCRIPT)):
        _check_down_gemv(case, r)


# one token, and a few (ROWS_TOKENS: a block's rows read once for its slots; tokens that share an expert at 4 of 6)
ROWS_CASES = [(1, 8, 2, 32, 48, "renorm", "float32"), (1, 12, 8, 40, 24, "", "float32"),
              (1, 16, 4, 64, 96, "renorm", "float16"), (3, 6, 4, 40, 24, "", "float32"),
              (5, 4, 2, 32, 48, "renorm", "float32"), (2, 16, 8, 64, 96, "", "float16")]

ROWS_SCRIPT = r"""
import json, sys, torch
from pushkv.model.moe import moe_mlp
from pushkv.model.kernels import triton_moe
""" + DRAW + r"""
dev = sys.argv[1]
out = []
calls = {"up": 0, "down": 0}
real_up, real_down = triton_moe.gate_up_rows, triton_moe.down_rows
class Counted:
    def __init__(self, kind, real):
        self.kind, self.real = kind, real
    def __call__(self, *a, **k):
        calls[self.kind] += 1
        return self.real(*a, **k)
triton_moe.gate_up_rows, triton_moe.down_rows = Counted("up", real_up), Counted("down", real_down)
for T, E, k, d, i, renorm, dtype in json.loads(sys.argv[2]):
    h, router, gate_up, down = draw(T, E, d, i, dtype, T * 17 + E + k, dev)
    triton_moe.ROWS_TOKENS = 8
    ref = moe_mlp(h, router, gate_up, down, k, bool(renorm)).float().cpu()
    grouped = triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm), summed=False).float().cpu()
    runs = []
    for rows in (1, 4, 8):
        for up, dn in ((True, False), (False, True), (True, True)):
            triton_moe.ROWS, triton_moe.DOWN_ROWS = rows, 2 * rows
            triton_moe.ROWS_ONE_TOKEN, triton_moe.DOWN_ROWS_ONE_TOKEN = up, dn
            before = dict(calls)
            got = triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm), summed=False).float().cpu()
            summed = triton_moe.moe_mlp(h, router, gate_up, down, k, bool(renorm)).float().cpu()
            runs.append({"rows": rows, "up": up, "down": dn,
                         "took": [calls["up"] - before["up"], calls["down"] - before["down"]],
                         "vs_grouped": float((got - grouped).abs().max()), "vs_ref": float((got.sum(1) - ref).abs().max()),
                         "summed": float((summed - got.sum(1)).abs().max())})
    triton_moe.ROWS, triton_moe.DOWN_ROWS, triton_moe.ROWS_ONE_TOKEN, triton_moe.DOWN_ROWS_ONE_TOKEN = 1, 8, False, False
    out.append({"runs": runs, "scale": float(ref.abs().max())})
print(json.dumps(out))
"""


def _check_rows(case, r) -> None:
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}[case[-1]] * max(1.0, r["scale"])
    for run in r["runs"]:
        # each kernel taken twice (the products per slot, then summed) where switched on, and not where off
        assert run["took"] == [2 * run["up"], 2 * run["down"]], (case, run)
        # each slot's product as the grouped kernels give it, to the rounding of another order of sums
        # (and summed as the caller sums them; the test sums on the CPU, a GPU in its own order)
        assert run["vs_grouped"] <= tol and run["vs_ref"] <= 10 * tol and run["summed"] <= tol, (case, run)


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernels themselves (below)")
def test_one_tokens_experts_as_whole_row_gemvs_equal_the_grouped_kernels_under_the_interpreter():
    """``ROWS_ONE_TOKEN`` and ``DOWN_ROWS_ONE_TOKEN``: a one-token step's gate/up and down products as GEMVs of 1, 4
    and 8 whole rows a program (down 2, 8 and 16), each alone and both, and a few tokens' (``ROWS_TOKENS``: each
    block's rows read once for every slot of it), against the grouped kernels and the torch reference: shapes
    whose rows are no power of two (masked), the expert count past the choices, renormalised or not."""
    cases = ROWS_CASES[:2] + ROWS_CASES[3:5]
    for case, r in zip(cases, _run("cpu", cases, ROWS_SCRIPT)):
        _check_rows(case, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_one_tokens_experts_as_whole_row_gemvs_equal_the_grouped_kernels():
    cases = ROWS_CASES + [c[:6] + ("bfloat16",) for c in ROWS_CASES]
    for case, r in zip(cases, _run("cuda", cases, ROWS_SCRIPT)):
        _check_rows(case, r)


ROUTED_SCRIPT = r"""
import json, sys, torch
from pushkv.config import MoeRouting
from pushkv.model.moe import route_grouped, routed_experts
from pushkv.model.kernels import triton_moe
""" + DRAW + r"""
dev = sys.argv[1]
out = []
for T, E, k, d, i in json.loads(sys.argv[2]):
    h, router, gate_up, down = draw(T, E, d, i, "float32", T * 11 + E, dev)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(E)).to(dev) * 0.1
    w, ex = route_grouped(h, router, k, True, MoeRouting("sigmoid", 2, 1, "top2", True, 2.5), bias)
    ref = routed_experts(h, w, ex, gate_up, down).float().cpu()
    got = triton_moe.moe_routed(h, w, ex, gate_up, down).float().cpu()
    out.append({"err": float((ref - got).abs().max()), "scale": float(ref.abs().max())})
print(json.dumps(out))
"""
ROUTED_CASES = [(1, 8, 2, 32, 48), (9, 8, 3, 40, 24), (40, 16, 4, 64, 32)]


def _check_routed(results) -> None:
    for case, r in zip(ROUTED_CASES, results):
        assert r["scale"] > 0 and r["err"] <= 1e-4 * r["scale"], (case, r)


def test_kernels_for_a_routing_already_made_equal_the_reference_under_the_interpreter():
    """DeepSeek's routing (``moe.route_grouped``: grouped sigmoid with a correction bias, scaled) through the
    grouped kernels (``triton_moe.moe_routed``, what an MLA model's MoE runs on CUDA) equals the torch reference."""
    _check_routed(_run("cpu", ROUTED_CASES, ROUTED_SCRIPT))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernels_for_a_routing_already_made_equal_the_reference():
    _check_routed(_run("cuda", ROUTED_CASES, ROUTED_SCRIPT))


# (experts, k, renorm, dtype, ties): Qwen3-MoE's 128 experts and k = 8, Mixtral's 8 and 2, E off a power of two
ROUTE_ONE_CASES = [(128, 8, "renorm", "bfloat16", ""), (128, 8, "", "float32", "ties"), (8, 2, "renorm", "float32", ""),
                   (12, 8, "renorm", "float16", "ties"), (60, 4, "", "bfloat16", "")]

ROUTE_ONE_SCRIPT = r"""
import json, sys, torch
from pushkv.model.kernels import triton_moe
dev = sys.argv[1]
out = []
for n, (E, k, renorm, dtype, ties) in enumerate(json.loads(sys.argv[2])):
    g = torch.Generator().manual_seed(n)
    logits = torch.randn(1, E, generator=g)
    if ties:
        logits[0, 1::2] = logits[0, 0:E - E % 2:2]
    logits = logits.to(dev, getattr(torch, dtype))
    triton_moe.ROUTE_ONE_TOKEN = False
    general = triton_moe.group_logits(logits, k, bool(renorm), 16)
    triton_moe.ROUTE_ONE_TOKEN = True
    one = triton_moe.group_logits(logits, k, bool(renorm), 16)
    out.append({"same": [bool(torch.equal(a, b)) for a, b in zip(general, one)],
                "has_ties": bool(logits[0, 0] == logits[0, 1]) if ties else None})
print(json.dumps(out))
"""


def _check_route_one(case, r) -> None:
    # weights, experts, the slot table and each block's expert: the general kernel's, to the bit
    assert r["same"] == [True] * 4 and r["has_ties"] in (None, True), (case, r)


# (tokens, E, k, renorm, dtype, how the tokens' logits relate: "same" (every token the first's: all share their
# experts), "ties", or independent)
ROUTE_FEW_CASES = [(2, 128, 8, "renorm", "bfloat16", ""), (2, 128, 8, "", "float32", "same"),
                   (3, 12, 8, "renorm", "float16", "ties"), (4, 60, 4, "", "bfloat16", "same"),
                   (8, 128, 8, "renorm", "bfloat16", ""), (5, 8, 2, "renorm", "float32", "")]

ROUTE_FEW_SCRIPT = r"""
import json, sys, torch
from pushkv.model.kernels import triton_moe
dev = sys.argv[1]
out = []
for n, (T, E, k, renorm, dtype, how) in enumerate(json.loads(sys.argv[2])):
    g = torch.Generator().manual_seed(n)
    logits = torch.randn(T, E, generator=g)
    if how == "same":
        logits[1:] = logits[0]
        logits[T - 1, 0] += 3.0  # (the last token's top choice its own)
    if how == "ties":
        logits[:, 1::2] = logits[:, 0:E - E % 2:2]
    logits = logits.to(dev, getattr(torch, dtype))
    triton_moe.ROUTE_FEW_TOKENS = 0
    general = triton_moe.group_logits(logits, k, bool(renorm), 16)
    triton_moe.ROUTE_FEW_TOKENS = 8
    calls = []
    kernel = triton_moe._route_few_kernel
    class Counted:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]
    triton_moe._route_few_kernel = Counted()
    few = triton_moe.group_logits(logits, k, bool(renorm), 16)
    triton_moe._route_few_kernel = kernel
    shared = len(set(general[1].tolist())) < T * k
    out.append({"same": [bool(torch.equal(a, b)) for a, b in zip(general, few)], "launched": len(calls),
                "shared": shared})
print(json.dumps(out))
"""


def _check_route_few(case, r) -> None:
    # the few-token kernel ran, and its weights, experts, slot table and block experts are the general kernel's
    assert r["launched"] == 1 and r["same"] == [True] * 4, (case, r)
    if case[5] == "same":
        assert r["shared"], (case, r)  # (tokens choosing the same experts: rows after the first in a block)


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernels themselves (below)")
def test_a_few_tokens_routing_in_registers_gives_the_general_kernels_tables_under_the_interpreter():
    """``ROUTE_FEW_TOKENS``: 2 to 8 tokens routed and grouped in one program (``_route_few_kernel``) give the general
    kernel's weights, experts, slot table and block experts bit for bit: tokens sharing experts, ties, renormalising
    or not, padded token and choice counts."""
    for case, r in zip(ROUTE_FEW_CASES, _run("cpu", ROUTE_FEW_CASES, ROUTE_FEW_SCRIPT)):
        _check_route_few(case, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_few_tokens_routing_in_registers_gives_the_general_kernels_tables():
    for case, r in zip(ROUTE_FEW_CASES, _run("cuda", ROUTE_FEW_CASES, ROUTE_FEW_SCRIPT)):
        _check_route_few(case, r)


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernels themselves (below)")
def test_one_tokens_routing_in_registers_gives_the_general_kernels_tables_under_the_interpreter():
    """``ROUTE_ONE_TOKEN``: a one-token step's routing and grouping in registers (``_route_one_kernel``) gives the
    general kernel's weights, experts, slot table and block experts bit for bit, ties and renormalisation included."""
    for case, r in zip(ROUTE_ONE_CASES, _run("cpu", ROUTE_ONE_CASES, ROUTE_ONE_SCRIPT)):
        _check_route_one(case, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_one_tokens_routing_in_registers_gives_the_general_kernels_tables():
    for case, r in zip(ROUTE_ONE_CASES, _run("cuda", ROUTE_ONE_CASES, ROUTE_ONE_SCRIPT)):
        _check_route_one(case, r)


COLS_FIRST_SCRIPT = r"""
import json, sys, torch
from pushkv.model.kernels import triton_moe
""" + DRAW + r"""
dev = sys.argv[1]
out = []
for T, E, k, d, i, dtype in json.loads(sys.argv[2]):
    h, router, gate_up, down = draw(T, E, d, i, dtype, T * 5 + E, dev)
    row = {}
    for switch in ("DOWN_COLS_FIRST_SLOTS", "GATE_UP_COLS_FIRST_SLOTS"):
        triton_moe.DOWN_COLS_FIRST_SLOTS = triton_moe.GATE_UP_COLS_FIRST_SLOTS = 0
        runs = {}
        for slots in (0, 1, T * k + 1):  # off, on, and a bound past this launch's slots (off)
            setattr(triton_moe, switch, slots)
            runs[slots] = triton_moe.moe_mlp(h, router, gate_up, down, k, True, triton_moe.Tiles(16, 32, 16, 32),
                                             summed=False)
        row[switch] = {"on_same": bool(torch.equal(runs[0], runs[1])),
                       "past_same": bool(torch.equal(runs[0], runs[T * k + 1])), "nonzero": bool(runs[1].abs().sum() > 0)}
    out.append(row)
print(json.dumps(out))
"""
# (tokens, experts, k, hidden, intermediate, dtype): hidden no multiple of the 16-column tile (masked), and a block
# table with blocks past the last expert (which return at once in either order)
COLS_FIRST_CASES = [(9, 4, 2, 40, 32, "float32"), (20, 6, 3, 64, 48, "float16")]
COLS_FIRST_SWITCHES = ("DOWN_COLS_FIRST_SLOTS", "GATE_UP_COLS_FIRST_SLOTS")
COLS_FIRST_SAME = {"on_same": True, "past_same": True, "nonzero": True}


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernels themselves (below)")
def test_grouped_launches_with_their_column_tiles_first_give_the_same_bits_under_the_interpreter():
    """``DOWN_COLS_FIRST_SLOTS`` and ``GATE_UP_COLS_FIRST_SLOTS``: the grouped down and gate/up launches with the column
    tiles as the grid's first axis compute each tile as before (the same bits), from the bound's slot count on."""
    for case, r in zip(COLS_FIRST_CASES, _run("cpu", COLS_FIRST_CASES, COLS_FIRST_SCRIPT)):
        assert r == {s: COLS_FIRST_SAME for s in COLS_FIRST_SWITCHES}, (case, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_grouped_launches_with_their_column_tiles_first_give_the_same_bits():
    cases = COLS_FIRST_CASES + [(4096, 128, 8, 2048, 768, "bfloat16")]
    for case, r in zip(cases, _run("cuda", cases, COLS_FIRST_SCRIPT)):
        assert r == {s: COLS_FIRST_SAME for s in COLS_FIRST_SWITCHES}, (case, r)


TMA_SCRIPT = r"""
import json, sys, torch
from pushkv.model.kernels import triton_moe
""" + DRAW + r"""
dev = sys.argv[1]
boxes = []
made = triton_moe._box
triton_moe._box = lambda t, r, c: boxes.append((tuple(t.shape), r, c)) or made(t, r, c)
out = []
for T, E, k, d, i, dtype, tiles in json.loads(sys.argv[2]):
    h, router, gate_up, down = draw(T, E, d, i, dtype, T * 3 + E, dev)
    tiles = triton_moe.Tiles(*tiles) if tiles else None
    runs, took = {}, {}
    for slots in (0, 1, T * k + 1):  # off, on, and a bound past this launch's slots (off)
        triton_moe.TMA_SLOTS = slots
        boxes.clear()
        runs[slots] = triton_moe.moe_mlp(h, router, gate_up, down, k, True, tiles, summed=False)
        took[slots] = len(boxes)
    out.append({"on_same": bool(torch.equal(runs[0], runs[1])),
                "on_close": bool(torch.allclose(runs[0], runs[1], rtol=1e-5, atol=1e-6)), "past_same": bool(torch.equal(runs[0], runs[T * k + 1])),
                "nonzero": bool(runs[1].abs().sum() > 0), "boxes": [took[0], took[1], took[T * k + 1]]})
print(json.dumps(out))
"""
# (tokens, experts, k, hidden, intermediate, dtype, tiles or [] for tiles_for's): whole tiles (the descriptors serve
# no other), a block table with blocks past the last expert, 4- and 2-byte types
TMA_CASES = [(9, 4, 2, 64, 64, "float32", [16, 32, 16, 32]), (20, 6, 3, 64, 96, "float16", [16, 32, 32, 32])]


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the kernels themselves (below)")
def test_weights_loaded_through_tensor_descriptors_give_the_same_bits_under_the_interpreter():
    """``TMA_SLOTS``: the grouped launches loading their weights (and down its product rows) through descriptors
    compute each tile as the pointer loads do (the same bits), take three descriptors (gate/up's weights, down's
    product and weights) from the bound's slot count on, and none below it."""
    for case, r in zip(TMA_CASES, _run("cpu", TMA_CASES, TMA_SCRIPT)):
        # the interpreter's dots are numpy's matmuls, whose float32 sums follow the BLAS kernel the CPU and the
        # operands' layout pick (a descriptor's box is a copy): float32 may differ there in its last bits, where
        # float16's rounded products may not; the GPU test below holds float32 to the same bits on the device
        exact = case[5] != "float32"
        assert r["on_close"] and (r["on_same"] or not exact), (case, r)
        assert {k: r[k] for k in ("past_same", "nonzero", "boxes")} == {"past_same": True, "nonzero": True,
                                                                         "boxes": [0, 3, 0]}, (case, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_weights_loaded_through_tensor_descriptors_give_the_same_bits():
    # the interpreter's cases in their 2-byte types, and Qwen3-30B-A3B's 4k prefill layer at tiles_for's tiles
    cases = [c[:5] + ("bfloat16", c[6]) for c in TMA_CASES] + [(4096, 128, 8, 2048, 768, "bfloat16", [])]
    for case, r in zip(cases, _run("cuda", cases, TMA_SCRIPT)):
        assert r == {"on_same": True, "past_same": True, "nonzero": True, "boxes": [0, 3, 0]}, (case, r)
