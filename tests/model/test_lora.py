"""LoRA adapters (pushkv/model/lora.py, lora_files.py) against PEFT itself: a tiny transformers checkpoint and two
adapters PEFT wrote give PEFT's float32 greedy tokens in both engines, each sequence through its own adapter in one
mixed step; an MoE model serves attention adapters; what an adapter holds that is not served is refused by name."""
from __future__ import annotations

import json
import os
import shutil

import msgspec
import pytest
import torch

from pushkv.config import LoraConfig, LoraModule
from pushkv.messages import SeqWork
from pushkv.model import build_model
from pushkv.model.checkpoint import model_config_from_hf
from pushkv.model.lora import LoraStep
from pushkv.model.lora_files import read_adapter
from tests.model.test_hf_reference import save_hf_checkpoint
from tests.model.test_model import new_pool
from tests.support.lora_adapters import ADAPTERS, NEW_TOKENS, peft_reference, save_adapter

PROMPTS = [[2, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180, 190, 200, 210], [2, 11, 12]]
NAMES = [None, *ADAPTERS]  # slot 0 is the base model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_hf_checkpoint(str(root / "base"), "llama", seed=3)
    paths = {n: save_adapter(base, str(root / n), seed=i, **f) for i, (n, f) in enumerate(ADAPTERS.items())}
    want = {n: peft_reference(base, paths.get(n), PROMPTS) for n in NAMES}
    return base, paths, want


def _model(base: str, paths: dict, engine: str, **over):
    cfg = model_config_from_hf(base, engine=engine, **over)
    lora = LoraConfig(True, tuple(LoraModule(n, p) for n, p in paths.items()), max_loras=2)
    return build_model(msgspec.structs.replace(cfg, lora=lora))


def run_pairs(model, pairs: list[tuple[list[int], int]], pool) -> list[list[int]]:
    """Each (prompt, slot) as its own sequence, all prefilled in one step and decoded together: each one's greedy
    new tokens (16-token blocks in ``pool``: a prompt and its new tokens fit in two a sequence)."""
    blocks = 2
    tables = [tuple(range(i * blocks, i * blocks + blocks)) for i in range(len(pairs))]
    out = [[t] for t in model.execute([SeqWork(i, tuple(ids), 0, tables[i], lora=slot)
                                       for i, (ids, slot) in enumerate(pairs)], pool)]
    while len(out[0]) < NEW_TOKENS:
        step = [SeqWork(i, (out[i][-1],), len(ids) + len(out[i]) - 1, tables[i], lora=slot)
                for i, (ids, slot) in enumerate(pairs)]
        for o, t in zip(out, model.execute(step, pool)):
            o.append(t)
    return out


@pytest.mark.parametrize("engine", ["per-seq", "batched"])
def test_each_adapter_and_the_base_in_one_step_give_pefts_tokens(llama, engine):
    """Every (prompt, adapter) pair as its own sequence in one step: each gives PEFT's tokens for its adapter (and
    the base model's where it names none)."""
    base, paths, want = llama
    model = _model(base, paths, engine)
    pairs = [(ids, slot) for slot in range(len(NAMES)) for ids in PROMPTS]
    for (ids, slot), got in zip(pairs, run_pairs(model, pairs, new_pool(model, 2 * len(pairs), 16))):
        assert got == want[NAMES[slot]][PROMPTS.index(ids)], (NAMES[slot], ids)
    assert want["all"] != want[None] and want["qv"] != want[None]  # each adapter changes the tokens


def test_a_bank_that_runs_out_of_memory_growing_stays_as_it_was(monkeypatch):
    """Growing the bank makes every new tensor before any replaces its old one: an allocation that fails midway
    (the GPU out of memory) fails the load and leaves every pair, and so the graphs captured on them, as they were."""
    from pushkv.model import lora as lora_mod

    bank = lora_mod.LoraBank(2, 4, "cpu", torch.float32)
    bank.put(1, [{"o": (torch.randn(2, 8), torch.randn(3, 2))}, {"o": (torch.randn(4, 8), torch.randn(3, 4))}])
    before = [dict(p) for p in bank.layers]
    real, made = torch.zeros, []

    def zeros(*a, **k):
        if len(made) == 3:  # the second layer's B
            raise torch.OutOfMemoryError("CUDA out of memory")
        made.append(a)
        return real(*a, **k)

    monkeypatch.setattr(lora_mod.torch, "zeros", zeros)
    with pytest.raises(torch.OutOfMemoryError):
        bank.put(2, [{"o": (torch.randn(2, 8), torch.randn(3, 2))}, {}])
    assert bank.capacity == 1 and len(made) == 3
    assert all(p[k] is before[i][k] for i, p in enumerate(bank.layers) for k in p)  # the same tensors, not grown


def test_each_row_takes_its_own_slots_delta_from_the_bank():
    """LoraStep over a bank of two slots: the rows of slot 2 get x A2^T B2^T, those of slot 1 slot 1's, the base
    model's rows nothing (and a step of slot 2 alone takes its columns only); a slot cleared is zero, and loading
    past the bank's capacity reallocates (and says so)."""
    from pushkv.model.lora import LoraBank

    bank = LoraBank(1, 4, "cpu", torch.float32)
    a1, b1, a2, b2 = torch.randn(2, 8), torch.randn(3, 2), torch.randn(4, 8), torch.randn(3, 4)
    assert bank.put(1, [{"o": (a1, b1)}]) and bank.capacity == 1
    assert bank.put(2, [{"o": (a2, b2)}]) and bank.capacity == 2  # grew
    assert not bank.put(1, [{"o": (a1, b1)}])  # in place
    seqs = [SeqWork(0, (1, 2), 0, (0,)), SeqWork(1, (3, 4, 5), 2, (0,), lora=2), SeqWork(2, (6,), 0, (0,), lora=1)]
    step = LoraStep.of(bank, seqs, torch.device("cpu"))
    x, y = torch.randn(6, 8), torch.randn(6, 3)
    got = step.add(0, "o", y.clone(), x)
    want = y.clone()
    want[2:5] += x[2:5] @ a2.T @ b2.T
    want[5:] += x[5:] @ a1.T @ b1.T
    torch.testing.assert_close(got, want)
    assert step.add(0, "qkv", y.clone(), x).equal(y)  # a projection no adapter adapts
    # a step whose rows use slot 2 alone multiplies by its columns only (a range of the bank), the same delta
    only = LoraStep.of(bank, [seqs[0], seqs[1]], torch.device("cpu"))
    assert only.span() == (2, 2) and only.mask("o", torch.float32).shape == (6 - 1, 4)
    got = only.add(0, "o", y[:5].clone(), x[:5])
    want = y[:5].clone()
    want[2:5] += x[2:5] @ a2.T @ b2.T
    torch.testing.assert_close(got, want)
    graph_like = LoraStep(bank, step.slots)  # slots on the device, no rows on the host (a graph's): every slot
    assert graph_like.span() == (1, 2)
    torch.testing.assert_close(graph_like.add(0, "o", y.clone(), x), step.add(0, "o", y.clone(), x))
    assert LoraStep.of(bank, seqs[:1], torch.device("cpu")) is None
    bank.clear(2)
    with pytest.raises(ValueError, match=r"LoRA slots \[2\] are not loaded"):
        LoraStep.of(bank, seqs, torch.device("cpu"))
    assert not bank.layers[0]["o"][0][4:].any() and not bank.layers[0]["o"][1][:, 4:].any()


def test_moe_model_serves_attention_adapters(tmp_path):
    base = save_hf_checkpoint(str(tmp_path / "moe"), "qwen3_moe", seed=4, num_local_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32)
    path = save_adapter(base, str(tmp_path / "attn"), r=4, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                      "o_proj"])
    want = peft_reference(base, path, PROMPTS[:1])
    model = _model(base, {"attn": path}, "batched")
    pool = new_pool(model, 4, 16)
    out = model.execute([SeqWork(0, tuple(PROMPTS[0]), 0, (0, 1), lora=1)], pool)
    while len(out) < NEW_TOKENS:
        out += model.execute([SeqWork(0, (out[-1],), len(PROMPTS[0]) + len(out) - 1, (0, 1), lora=1)], pool)
    assert out == want[0]
    expert = save_adapter(base, str(tmp_path / "experts"), r=4, target_modules=["gate_proj", "up_proj"])
    with pytest.raises(ValueError, match="MoE layer's experts or router are not built"):
        read_adapter("experts", expert, model_config_from_hf(base), 16)


def _edited(src: str, dst: str, **fields) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "adapter_config.json")) as f:
        conf = json.load(f)
    conf.update(fields)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(conf, f)
    return dst


@pytest.mark.parametrize("fields, says", [
    (dict(peft_type="IA3"), "peft_type 'IA3': only LORA adapters are served"),
    (dict(use_dora=True), "use_dora True: DoRA's magnitudes are not built"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(rank_pattern={"q_proj": 4}), "a rank per module is not built"),
    (dict(bias="all"), "bias 'all'"),
    (dict(r=32), "r 32 is past --max-lora-rank 16"),
    (dict(r=4), r"lora_A.weight is \[8, \d+\], where this model and r 4 make \[4, \d+\]"),
])
def test_what_is_not_served_is_refused_by_name(llama, tmp_path, fields, says):
    base, paths, _ = llama
    path = _edited(paths["all"], str(tmp_path / "edited"), **fields)
    with pytest.raises(ValueError, match=says):
        read_adapter("edited", path, model_config_from_hf(base), 16)


def test_missing_and_foreign_files_are_refused(llama, tmp_path):
    base, paths, _ = llama
    cfg = model_config_from_hf(base)
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        read_adapter("x", str(tmp_path), cfg, 16)
    bin_only = _edited(paths["qv"], str(tmp_path / "bin"))
    os.rename(os.path.join(bin_only, "adapter_model.safetensors"), os.path.join(bin_only, "adapter_model.bin"))
    with pytest.raises(ValueError, match="pushkv reads safetensors only"):
        read_adapter("bin", bin_only, cfg, 16)
    info = read_adapter("qv", paths["qv"], cfg, 16)
    assert info.rank == 4 and info.scale == pytest.approx(8 / 2)  # rsLoRA: alpha / sqrt(r)
    assert info.modules == {"q_proj", "v_proj"}


@pytest.mark.parametrize("together", [True, False])
def test_decode_steps_through_adapters_replay_graphs_of_their_own(llama, together):
    """With the graphs on (their CPU stand-in, which replays on the static buffers it recorded: the rows' slots
    among them): the mixed step's decode steps replay a LoRA graph and give PEFT's tokens, a step of the base model
    alone replays the plain graph; an adapter loaded past the bank's capacity drops the graphs captured on it.
    ``together`` False: the batch-invariant engine runs each sequence alone, so one graph replays every adapter in
    turn (its masks made from each replay's slots, never kept from an earlier one)."""
    from pushkv.model.lora import load_adapter
    from tests.model.test_decode_graphs import _PinnedGraph

    base, paths, want = llama
    model = _model(base, paths, "batched", deterministic=not together)
    model.enable_batched(max_num_seqs=8, use_graphs=True)
    model.batched.graph_type = _PinnedGraph
    pairs = [(ids, slot) for slot in range(len(NAMES)) for ids in PROMPTS]
    for (ids, slot), got in zip(pairs, run_pairs(model, pairs, new_pool(model, 2 * len(pairs), 16))):
        assert got == want[NAMES[slot]][PROMPTS.index(ids)], (NAMES[slot], ids)
    assert set(model.batched.lora_graphs) == ({8} if together else {1})  # 6 sequences: the bucket of 8
    assert not model.batched.graphs or not together  # (alone, the base model's sequences replay the plain graph)
    base_only = [(ids, 0) for ids in PROMPTS]
    assert run_pairs(model, base_only, new_pool(model, 4, 16)) == want[None]
    assert set(model.batched.graphs) == ({2} if together else {1})
    info = read_adapter("qv", paths["qv"], model.cfg, 16)
    assert model.lora_bank.put(3, load_adapter(info, model.cfg, model.plan, "cpu"))  # past capacity 2: grew
    model.batched.drop_graphs()  # as the worker does when put says so
    again = [(PROMPTS[0], 3), (PROMPTS[1], 2)]
    assert run_pairs(model, again, new_pool(model, 4, 16)) == [want["qv"][0], want["qv"][1]]
