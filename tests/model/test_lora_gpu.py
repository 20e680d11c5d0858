"""On a GPU: LoRA adapters through the fused engine (Triton kernels, the GEMV projections of one token, CUDA graphs
for steps without an adapter) give PEFT's float32 greedy tokens, each sequence through its own adapter in one mixed
step; and bf16 push through an adapter gives local's tokens.

    pytest tests/model/test_lora_gpu.py -v -p no:cacheprovider    (from the checkout's root)
"""
from __future__ import annotations

import msgspec
import pytest
import torch

from pushkv.config import LoraConfig, LoraModule
from pushkv.model import build_model
from pushkv.model.checkpoint import model_config_from_hf
from tests.model.test_hf_reference import save_hf_checkpoint
from tests.model.test_lora import NAMES, PROMPTS, run_pairs
from tests.support.deploy import deployment
from tests.support.lora_adapters import ADAPTERS, NEW_TOKENS, peft_reference, save_adapter

U, BLOCKS = 16, 2


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_gpu")
    base = save_hf_checkpoint(str(root / "base"), "llama", seed=3)
    paths = {n: save_adapter(base, str(root / n), seed=i, **f) for i, (n, f) in enumerate(ADAPTERS.items())}
    return base, paths, {n: peft_reference(base, paths.get(n), PROMPTS) for n in NAMES}


def _run(model, pairs: list[tuple[list[int], int]]) -> list[list[int]]:
    lay = model.kv_layout(BLOCKS * len(pairs), U)
    pool = torch.full((BLOCKS * len(pairs), lay.num_layers, lay.kv_planes, lay.kv_heads, U, lay.head_dim),
                      float("nan"), dtype=model.dtype, device="cuda")
    return run_pairs(model, pairs, pool)


def test_gpu_float32_adapters_in_one_step_and_the_base_from_graphs_equal_peft(llama):
    base, paths, want = llama
    cfg = model_config_from_hf(base)
    lora = LoraConfig(True, tuple(LoraModule(n, p) for n, p in paths.items()), max_loras=2)
    model = build_model(msgspec.structs.replace(cfg, lora=lora), device="cuda")
    assert model.batched is not None and model.batched.fused
    mixed = [(ids, slot) for slot in range(len(NAMES)) for ids in PROMPTS]
    for (ids, slot), got in zip(mixed, _run(model, mixed)):
        assert got == want[NAMES[slot]][PROMPTS.index(ids)], (NAMES[slot], ids)
    alone = [(ids, 0) for ids in PROMPTS]  # no adapter: its decode steps replay a graph
    assert _run(model, alone) == want[None]
    assert model.batched.graphs, "the base model's decode steps replayed no graph"
    one = [(PROMPTS[0], 1)]  # one token a step through an adapter: the GEMV projections, eager
    assert _run(model, one) == [want["all"][0]]


def test_gpu_bf16_push_through_an_adapter_equals_local(llama, tmp_path):
    base, paths, _ = llama
    got = {}
    for mode in ("local", "push"):
        (tmp_path / mode).mkdir()
        with deployment(tmp_path / mode, "--mode", mode, "--model", base, "--device", "cuda", "--dtype", "bfloat16",
                        "--num-blocks", "256", "--enable-lora", "--lora-modules", f"all={paths['all']}") as dep:
            got[mode] = [dep.complete(p, NEW_TOKENS, **({"model": name} if name else {}))["choices"][0]["token_ids"]
                         for p in PROMPTS for name in ("all", None)]
    assert got["push"] == got["local"]
    assert got["push"][0] != got["push"][1]  # the adapter changes the tokens in bf16 too
