"""--gpu-memory-utilization: a CUDA instance's KV pool sized from its GPU's memory at launch (vLLM's
rule), --num-blocks as the override, and the refusals (not enough free memory, a model that does
not fit, a pool shorter than one request), each naming the flags that fix it. The GPU's memory is
given (the driver query itself is ``pushkv.cuda_driver``); on the CPU the flag is refused."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import msgspec
import pytest

from pushkv.config import PRESETS, DeploymentConfig, InstanceConfig, LoraConfig, LoraModule, ModelConfig, MoeRouting
from pushkv.config_flags import user_config
from pushkv.model.build import param_names
from pushkv.model.footprint import lora_bank_bytes, lora_slots, weight_bytes
from pushkv.supervisor.kv_sizing import (CONTEXT_BYTES, GIB, PROCESSES_PER_RANK, activation_bytes, pool_note,
                                         rank_block_bytes, size_pools)
from pushkv.supervisor.plan import plan_deployment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H200 = 143 * GIB  # total; most of it free


def counted(model: ModelConfig) -> int:
    """The bytes of every parameter the loader names (``model.weights.hf_names``)."""
    return sum(math.prod(shape) for _, shape in param_names(model)) * model.dtype_bytes


DEEPSEEK_V3_LIKE = msgspec.structs.replace(  # a query LoRA, experts with a correction bias, shared experts, a dense layer
    PRESETS["mla"], architecture="DeepseekV3ForCausalLM", q_lora_rank=48, num_experts=8, experts_per_token=2,
    intermediate_size=64, routing=MoeRouting("sigmoid", 2, 1, "top2", True, 2.5), shared_intermediate_size=128,
    dense_layers=1, dense_intermediate_size=512)


@pytest.mark.parametrize("model", [
    PRESETS["tiny"], PRESETS["small"], PRESETS["qwen3-8b"], PRESETS["qwen3-30b-a3b"],
    msgspec.structs.replace(PRESETS["small"], qkv_bias=True, qk_norm=False, tie_embeddings=True),
    PRESETS["mla"], DEEPSEEK_V3_LIKE,
    msgspec.structs.replace(PRESETS["qwen3-30b-a3b"], architecture="Qwen2MoeForCausalLM", qk_norm=False,
                            qkv_bias=True, shared_intermediate_size=4096, shared_gate=True),
], ids=["tiny", "small", "qwen3-8b", "qwen3-30b-a3b", "qwen2-like", "mla", "deepseek-v3-like", "qwen2-moe-like"])
def test_one_rank_weights_are_every_parameter_the_loader_names(model):
    assert weight_bytes(model, 1) == counted(model)


def test_tp_splits_heads_and_columns_but_not_the_embeddings():
    m = PRESETS["qwen3-8b"]
    whole = 2 * m.vocab_size * m.hidden_size * m.dtype_bytes
    assert weight_bytes(m, 2) - whole / 2 == pytest.approx((weight_bytes(m, 1) - whole) / 2 + whole / 2, rel=1e-3)
    assert weight_bytes(m, 4) < weight_bytes(m, 2) < weight_bytes(m, 1)


def deployment(model="qwen3-8b", p="cuda:0", d="cuda:1", tp=1, util=0.9, blocks=0, **kw) -> DeploymentConfig:
    inst = dict(tp=tp, num_blocks=blocks)
    cfg = DeploymentConfig(model=PRESETS[model], gpu_memory_utilization=util,
                           prefill=InstanceConfig(role="prefill", device=p, **inst),
                           decode=InstanceConfig(role="decode", device=d, **inst), **kw)
    ports = iter(range(20000, 21000))
    return plan_deployment(cfg, pick_port=lambda: next(ports))


class GPUs:
    """Each GPU's (free, total); records what was asked."""

    def __init__(self, free=H200 - GIB // 2, total=H200):
        self.free, self.total, self.asked = free, total, []

    def __call__(self, gpu: int) -> tuple[int, int]:
        self.asked.append(gpu)
        return self.free, self.total


def test_the_pool_is_what_the_share_leaves_after_weights_activations_and_contexts():
    cfg = deployment()
    sized = size_pools(cfg, GPUs())
    assert sized.problems == [] and sized.sized == ("prefill", "decode")
    for inst in sized.cfg.instances():
        used = (weight_bytes(cfg.model, 1) + activation_bytes(cfg.model, inst) + PROCESSES_PER_RANK * CONTEXT_BYTES
                + inst.num_blocks * rank_block_bytes(cfg.model, inst, 0))
        assert 0.9 * H200 - rank_block_bytes(cfg.model, inst, 0) < used <= 0.9 * H200
        assert inst.num_blocks > 10_000  # 8B in bf16 on an H200: ~100 GiB of KV at 2.25 MiB a block
    assert sized.cfg.prefill.num_blocks == sized.cfg.decode.num_blocks


def test_ranks_on_one_gpu_share_its_budget_and_each_gpu_is_asked_once():
    alone, gpus = size_pools(deployment(), GPUs()), GPUs()
    shared = size_pools(deployment(d="cuda:0"), gpus)
    assert gpus.asked == [0]
    assert shared.cfg.decode.num_blocks < alone.cfg.decode.num_blocks / 2
    gpus = GPUs()
    size_pools(deployment(p="cuda:0", d="cuda:2", tp=2), gpus)
    assert sorted(gpus.asked) == [0, 1, 2, 3]


def test_num_blocks_overrides_and_nothing_is_asked():
    gpus = GPUs()
    sized = size_pools(deployment(blocks=128), gpus)
    assert gpus.asked == [] and sized.cfg.decode.num_blocks == 128 and sized.sized == ()
    assert "128 blocks x 16 tokens = 2048 tokens of context" in pool_note(sized.cfg, sized.cfg.decode, False)


def test_less_free_memory_than_asked_is_refused_with_the_fraction_that_fits():
    sized = size_pools(deployment(), GPUs(free=H200 // 2))
    assert len(sized.problems) == 2  # one line per GPU
    assert "--gpu-memory-utilization 0.9: cuda:0 has 71.50 GiB free of 143.00 GiB" in sized.problems[0]
    assert "lower it to 0.5 or less" in sized.problems[0]


def test_a_model_that_does_not_fit_names_tp_and_the_flag():
    sized = size_pools(deployment("qwen3-32b", d="cuda:0"), GPUs(free=48 * GIB, total=48 * GIB))
    assert sized.problems and all("the model does not fit" in p and "raise -tp" in p for p in sized.problems)
    assert "weights take 61.0" in sized.problems[0]


def test_a_pool_shorter_than_one_request_names_max_model_len():
    sized = size_pools(deployment(util=0.15), GPUs())
    assert sized.problems and "fewer than one request of --max-model-len 40960" in sized.problems[0]
    assert size_pools(deployment(util=0.15, max_model_len=4096), GPUs()).problems == []


def test_the_note_says_blocks_tokens_and_gib():
    sized = size_pools(deployment(), GPUs())
    note = pool_note(sized.cfg, sized.cfg.prefill, True)
    n = sized.cfg.prefill.num_blocks
    assert note.startswith(f"KV pool prefill: {n} blocks x 16 tokens = {n * 16} tokens of context")
    assert f"{n * rank_block_bytes(sized.cfg.model, sized.cfg.prefill, 0) / GIB:.2f} GiB per rank on cuda:0" in note
    assert "--gpu-memory-utilization 0.9" in note


def no_gpu():
    return 0, "no GPU visible"


def one_gpu():
    return 1, ""


def test_the_device_is_cuda_where_a_gpu_is_and_its_pool_is_sized():
    on_gpu = user_config({"model": "tiny", "load_format": "dummy"}, gpus=one_gpu)
    assert (on_gpu.prefill.device, on_gpu.decode.device, on_gpu.prefill.num_blocks) == ("cuda", "cuda", 0)
    on_cpu = user_config({"model": "tiny", "load_format": "dummy"}, gpus=no_gpu)
    assert (on_cpu.prefill.device, on_cpu.decode.num_blocks) == ("cpu", 2048)
    given = user_config({"model": "tiny", "device": "cpu", "num_blocks": 64}, gpus=one_gpu)
    assert (given.decode.device, given.decode.num_blocks) == ("cpu", 64)
    fixed = user_config({"model": "tiny", "device": "cuda:1", "num_blocks": 64}, gpus=one_gpu)
    assert fixed.decode.num_blocks == 64


def test_gpu_memory_utilization_on_the_cpu_is_refused():
    with pytest.raises(ValueError, match="--gpu-memory-utilization sizes KV pools on CUDA; every instance here is "
                                         "on cpu, whose pool is --num-blocks"):
        user_config({"model": "tiny", "gpu_memory_utilization": 0.5}, gpus=no_gpu)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        user_config({"model": "tiny", "device": "cuda", "gpu_memory_utilization": 0}, gpus=one_gpu)


def test_pushkv_up_refuses_it_on_the_cpu_at_once():
    p = subprocess.run([sys.executable, "-m", "processes.cli", "up", "--model", "tiny", "--load-format", "dummy",
                        "--device", "cpu", "--gpu-memory-utilization", "0.8"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "--gpu-memory-utilization sizes KV pools on CUDA" in p.stderr


def test_a_pool_sized_on_another_host_bounds_the_routers_messages_by_the_widest_id():
    """A router host plans templates whose pools are sized elsewhere (num_blocks 0): its message caps
    must hold P's largest block ids all the same."""
    from pushkv import limits

    sized_elsewhere = deployment(blocks=0)
    known = deployment(blocks=(1 << 32) - 1)
    assert limits.generate_cap_bytes(sized_elsewhere) == limits.generate_cap_bytes(known)
    assert limits.generate_cap_bytes(sized_elsewhere) > limits.generate_cap_bytes(deployment(blocks=100))


def test_a_gpu_whose_memory_the_driver_does_not_give_is_a_problem_not_a_crash():
    from pushkv.cuda_driver import DriverError

    def refuses(gpu):
        raise DriverError("cuDevicePrimaryCtxRetain error 46")

    sized = size_pools(deployment(), refuses)
    assert sized.problems[0] == ("--gpu-memory-utilization: cuda:0's memory is unknown (cuDevicePrimaryCtxRetain "
                                 "error 46); give --num-blocks N, or check the GPU with nvidia-smi")


def test_the_driver_query_without_a_gpu_says_why():
    from pushkv.cuda_driver import DriverError, device_count, memory_info

    count, why = device_count()
    if count:
        free, total = memory_info(0)
        assert 0 < free <= total
    else:
        assert why
        with pytest.raises(DriverError):
            memory_info(0)


def test_the_compute_capability_is_torchs_where_a_gpu_is():
    """cuda_driver.capability (--dtype auto's choice, as vLLM's): torch's answer on a GPU, None without one."""
    from pushkv.cuda_driver import capability, device_count

    if not device_count()[0]:
        assert capability() is None
        return
    import torch

    assert capability() == tuple(torch.cuda.get_device_capability(0))


def test_the_l2_set_aside_is_set_clamped_and_read_back_where_a_gpu_is():
    """cuda_driver.persisting_l2 (experiments/moe_decode_probe.py's ``*_l2`` variants): on a GPU, within torch's
    context, the set-aside asked for is what the driver reads back, a larger one is clamped to the device's most,
    and 0 puts it back; without a GPU it says why."""
    from pushkv.cuda_driver import DriverError, device_count, persisting_l2

    if not device_count()[0]:
        with pytest.raises(DriverError):
            persisting_l2(1 << 20)
        return
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # torch's context current on this thread
    before, most = persisting_l2()
    try:
        assert most > 0
        assert persisting_l2(4 << 20)[0] == 4 << 20
        assert persisting_l2(1 << 40) == (most, most)
        assert persisting_l2(0)[0] == 0
    finally:
        persisting_l2(before)


def _with_lora(model: ModelConfig, adapters: int, max_loras: int = 1, rank: int = 16) -> ModelConfig:
    mods = tuple(LoraModule(f"a{i}", f"/adapters/a{i}") for i in range(adapters))
    return msgspec.structs.replace(model, lora=LoraConfig(True, mods, max_loras, rank))


@pytest.mark.parametrize("name,tp", [("small", 1), ("small", 2), ("qwen3-30b-a3b", 2), ("tiny", 1)])
def test_the_lora_bank_counted_is_what_a_bank_of_full_rank_adapters_on_every_projection_takes(name, tp):
    torch = pytest.importorskip("torch")
    from pushkv.model.lora import KIND_PARTS, LoraBank
    from pushkv.model.shard import shard_plan

    model = _with_lora(msgspec.structs.replace(PRESETS[name], dtype="float16"), adapters=2, max_loras=3, rank=8)
    assert lora_slots(model) == 3  # --max-loras above the adapters given
    plan = shard_plan(model, 0, tp)
    d, hd, r = model.hidden_size, model.head_dim, model.lora.max_rank
    width = model.dense_intermediate_size if model.is_moe else model.intermediate_size
    shapes = {"qkv": ((plan.q_heads + 2 * plan.kv_heads) * hd, d), "o": (d, plan.q_heads * hd),
              "gate_up": (2 * width // tp, d), "down": (d, width // tp)}
    bank = LoraBank(model.num_layers, r, "cpu", torch.float16, lora_slots(model))
    moe_layer = model.is_moe
    adapter = [{kind: (torch.ones(KIND_PARTS[kind] * r, n_in), torch.ones(n_out, KIND_PARTS[kind] * r))
                for kind, (n_out, n_in) in shapes.items() if not (moe_layer and kind in ("gate_up", "down"))}
               for _ in range(model.num_layers)]
    for slot in (1, 2, 3):
        assert not bank.put(slot, adapter) or slot == 1  # made at its slots once: no slot reallocates
    held = sum(t.numel() * t.element_size() for pairs in bank.layers for pair in pairs.values() for t in pair)
    assert lora_bank_bytes(model, tp) == held > 0
    assert lora_bank_bytes(PRESETS[name], tp) == 0 and lora_slots(PRESETS[name]) == 0  # LoRA off: nothing


def test_the_lora_bank_takes_its_share_from_the_kv_pool_and_is_named_when_the_model_does_not_fit():
    plain = size_pools(deployment(), GPUs())
    cfg = deployment()
    cfg = msgspec.structs.replace(cfg, model=_with_lora(cfg.model, adapters=4, max_loras=2, rank=64))
    sized = size_pools(cfg, GPUs())
    bank = lora_bank_bytes(cfg.model, 1)
    assert bank > 4 * 450 * 2**20  # four rank-64 adapters of an 8B model on every projection: ~0.5 GiB each
    block = rank_block_bytes(cfg.model, sized.cfg.decode, 0)
    lost = plain.cfg.decode.num_blocks - sized.cfg.decode.num_blocks
    assert bank // block <= lost <= (bank + activation_bytes(cfg.model, sized.cfg.decode)) // block + 1
    tight = msgspec.structs.replace(deployment("qwen3-32b", d="cuda:0"), model=_with_lora(PRESETS["qwen3-32b"], 8,
                                                                                            rank=64))
    refused = size_pools(tight, GPUs(free=48 * GIB, total=48 * GIB))
    assert refused.problems and "the LoRA bank" in refused.problems[0] and "--max-lora-rank 64" in refused.problems[0]
