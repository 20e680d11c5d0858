"""On a GPU: every architecture's float32 greedy tokens with the decode CUDA graphs on equal
transformers' and the eager engine's (docs/results/2026-12-02-models-gpu/ found 1-2 of 3 prompts
differing with graphs on: the graphs replayed on the pool of their first capture).

    pytest tests/model/test_gpu_graphs.py -v -s -p no:cacheprovider    (from the checkout's root)

prints one line per architecture and passes or fails per architecture.
"""
from __future__ import annotations

import pytest
import torch

from pushkv.messages import SeqWork
from pushkv.model import build_model
from pushkv.model.checkpoint import model_config_from_hf
from tests.model.test_architectures import CASES, NEW
from tests.model.test_hf_reference import PROMPTS, hf_reference, save_hf_checkpoint
from tests.model.test_model import paged_generate

ALL = sorted(CASES)  # MoE too: its layer is captured since the fused routing kernel
BLOCKS, U = 8, 16  # per sequence


def _pool(model, blocks: int) -> torch.Tensor:
    lay = model.kv_layout(blocks, U)
    return torch.full((blocks, lay.num_layers, lay.kv_planes, lay.kv_heads, U, lay.head_dim), float("nan"),
                      dtype=model.dtype, device="cuda")


def _together(model, prompts: list[list[int]]) -> list[list[int]]:
    """The prompts prefilled in one step, then decoded together: steps of 3 in the graph of 4."""
    tables = [tuple(range(BLOCKS * i, BLOCKS * i + BLOCKS)) for i in range(len(prompts))]
    pool = _pool(model, BLOCKS * len(prompts))
    outs = [[t] for t in model.execute([SeqWork(i, tuple(p), 0, tables[i]) for i, p in enumerate(prompts)], pool)]
    for step in range(1, NEW):
        seqs = [SeqWork(i, (o[-1],), len(p) + step - 1, tables[i]) for i, (p, o) in enumerate(zip(prompts, outs))]
        for o, t in zip(outs, model.execute(seqs, pool)):
            o.append(t)
    return outs


@pytest.mark.parametrize("case", ALL)
def test_gpu_float32_tokens_with_graphs_equal_transformers_and_eager(case, tmp_path):
    _graphs_equal_transformers_and_eager(case, tmp_path)


@pytest.mark.parametrize("case", ["qwen3", "qwen2", "qwen3_moe"])
def test_gpu_float32_tokens_with_gemv_projections_equal_transformers(case, tmp_path, monkeypatch):
    """The qkv and o projections of a one-token step as GEMVs (``batched.GEMV_TOKENS``, off by default: on an
    H200 2 columns a program took Qwen3-30B-A3B's batch-1 step from 3.12 to 2.91 ms) give transformers' float32
    tokens, with graphs and eager; qwen2 carries the q/k/v bias."""
    from pushkv.model import batched
    from pushkv.model.kernels import triton_gemv

    calls = []
    real = triton_gemv.linear

    def counted(x, w, bias=None):
        calls.append((x.shape[0], triton_gemv.tile_for(w.shape[0], x.shape[1]) is not None))
        return real(x, w, bias)

    monkeypatch.setattr(batched, "GEMV_TOKENS", 1)
    monkeypatch.setattr(triton_gemv, "COLUMNS", 2)
    monkeypatch.setattr(triton_gemv, "linear", counted)
    _graphs_equal_transformers_and_eager(case, tmp_path)
    assert calls and set(calls) == {(1, True)}, calls  # one-token steps only, each by the GEMV kernel


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe-unnormed", "mixtral"])
def test_gpu_float32_tokens_with_moe_down_gemvs_equal_transformers(case, tmp_path, monkeypatch):
    """The MoE down projections of a one-token step as GEMVs that load their weights before they wait
    (``triton_moe.DOWN_GEMV_TOKENS``) give transformers' float32 tokens, with graphs and eager, and every
    one-token step took them."""
    from pushkv.model.kernels import triton_moe

    calls = []
    real = triton_moe.down_gemv

    def counted(act, *args):
        calls.append(act.shape[0])
        return real(act, *args)

    monkeypatch.setattr(triton_moe, "DOWN_GEMV_TOKENS", 1)
    monkeypatch.setattr(triton_moe, "down_gemv", counted)
    _graphs_equal_transformers_and_eager(case, tmp_path)
    assert calls, "no step took the down GEMVs"


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe-unnormed", "mixtral"])
@pytest.mark.parametrize("flags", ["one_launch", "one_launch_prefetch", "grouped_prefetch", "ahead", "ahead_kv",
                                   "persistent", "early_next", "route_one", "route_few"])
def test_gpu_float32_tokens_with_moe_one_launch_or_prefetch_equal_transformers(case, flags, tmp_path, monkeypatch):
    """The MoE decode kernels of up to 8 tokens in one launch (``triton_moe_decode.ONE_LAUNCH``, with
    ``PUSHKV_MOE_DECODE=ungrouped``), also with the down weights asked of L2 by gate/up (``PREFETCH_DOWN``), the
    grouped kernels with that prefetch and each program's own rows asked for first
    (``triton_moe.PREFETCH_DOWN_TOKENS``, ``PREFETCH_OWN_TOKENS``), the dense weights asked of L2 ahead of their
    projections at every place (``batched.AHEAD``), and the decode attention's first key tile asked for before its
    wait (``triton_paged.PREFETCH_KV``), and a one-token step's MLP in one persistent launch
    (``triton_moe.PERSISTENT_ONE_TOKEN``), every kernel letting the next one be scheduled before it waits
    (``chain.EARLY_NEXT``), and a one-token step's routing in registers (``triton_moe.ROUTE_ONE_TOKEN``) or a few
    tokens' (``ROUTE_FEW_TOKENS``, the prompts together) give
    transformers' float32 tokens, with graphs and eager; the decode steps took the
    launch counted where there is one."""
    from pushkv.model import batched
    from pushkv.model.kernels import prefetch, triton_moe, triton_moe_decode

    launches = []

    def counted(module, name):
        real = getattr(module, name)

        class Counted:
            def __getitem__(self, grid):
                launches.append(grid)
                return real[grid]

            def __getattr__(self, attr):  # warmup and the rest: the kernel's own
                return getattr(real, attr)

        monkeypatch.setattr(module, name, Counted())

    if flags.startswith("one_launch"):
        monkeypatch.setenv("PUSHKV_MOE_DECODE", "ungrouped")
        monkeypatch.setattr(triton_moe_decode, "ONE_LAUNCH", True)
        monkeypatch.setattr(triton_moe_decode, "PREFETCH_DOWN", flags.endswith("prefetch"))
        counted(triton_moe_decode, "_one_launch_kernel")
    elif flags == "ahead":
        monkeypatch.setattr(batched, "AHEAD_TOKENS", 8)
        monkeypatch.setattr(batched, "AHEAD", batched.AHEAD_PLACES)
        counted(prefetch, "_ahead_kernel")
    elif flags == "persistent":
        from pushkv.model.kernels import triton_moe_token

        monkeypatch.setattr(triton_moe, "PERSISTENT_ONE_TOKEN", True)
        counted(triton_moe_token, "_moe_token_kernel")
    elif flags == "ahead_kv":  # the decode attention asking for its first key tile before its wait
        from pushkv.model.kernels import triton_paged

        monkeypatch.setattr(triton_paged, "PREFETCH_KV", True)
        launches.append("not counted")
    elif flags == "early_next":  # every kernel of the step letting the next be scheduled before it waits
        from pushkv.model.kernels import chain

        monkeypatch.setattr(chain, "EARLY_NEXT", chain.NAMES)
        launches.append("not counted")
    elif flags == "route_one":  # a one-token step's routing in registers
        monkeypatch.setattr(triton_moe, "ROUTE_ONE_TOKEN", True)
        counted(triton_moe, "_route_one_kernel")
    elif flags == "route_few":  # a few tokens' routing in registers (the prompts decoding together)
        monkeypatch.setattr(triton_moe, "ROUTE_FEW_TOKENS", 8)
        counted(triton_moe, "_route_few_kernel")
    else:  # the grouped kernels asking for the down weights and for their own rows
        monkeypatch.setattr(triton_moe, "PREFETCH_DOWN_TOKENS", 8)
        monkeypatch.setattr(triton_moe, "PREFETCH_OWN_TOKENS", 8)
    _graphs_equal_transformers_and_eager(case, tmp_path)
    assert bool(launches) == (flags != "grouped_prefetch"), len(launches)


def _graphs_equal_transformers_and_eager(case, tmp_path):
    family, extra, _ = CASES[case]
    path = save_hf_checkpoint(str(tmp_path), family, seed=3, **extra)
    want = hf_reference(path, PROMPTS)
    model = build_model(model_config_from_hf(path, engine="batched"), device="cuda")
    fwd = model.batched
    assert fwd.use_graphs, "CUDA graphs are off (PUSHKV_CUDA_GRAPHS=0?)"
    got = {}
    for graphs in (True, False):
        fwd.use_graphs = graphs
        # a fresh pool per prompt, as experiments/models_gpu.py runs them
        alone = [paged_generate(model, _pool(model, BLOCKS), ids, NEW, tuple(range(BLOCKS))) for ids, _ in want]
        got[graphs] = alone, _together(model, [ids for ids, _ in want])
    fwd.use_graphs = True
    assert fwd.graphs, "no decode step replayed a graph"
    equal = [a[:a.index(3) + 1 if 3 in a else len(a)] == new for a, (_, new) in zip(got[True][0], want)]
    same = got[True] == got[False]
    print(f"\n{case}: graphs on, float32: {'equal' if all(equal) else 'NOT EQUAL'} to transformers "
          f"({sum(equal)} of {len(equal)} prompts); {'equal' if same else 'NOT EQUAL'} to graphs off "
          f"(alone and 3 together)")
    assert all(equal) and same


def test_gpu_enforce_eager_replays_no_graph_and_gives_the_graphs_tokens(tmp_path):
    """vLLM's --enforce-eager (``ModelConfig.cuda_graphs`` False, pushkv/vllm_serve.py): the decode steps run their
    kernels with no graph captured, and the tokens are the graphs' (float32)."""
    import msgspec

    path = save_hf_checkpoint(str(tmp_path), "qwen3", seed=3)
    cfg = model_config_from_hf(path, engine="batched")
    ids = hf_reference(path, PROMPTS[:1])[0][0]
    got = {}
    for graphs in (True, False):
        model = build_model(msgspec.structs.replace(cfg, cuda_graphs=graphs), device="cuda")
        assert model.batched.use_graphs is graphs
        got[graphs] = paged_generate(model, _pool(model, BLOCKS), ids, NEW, tuple(range(BLOCKS)))
        assert bool(model.batched.graphs) is graphs
    assert got[False] == got[True]
