"""``--gpu-memory-utilization``: each CUDA instance's KV pool sized from its GPUs' memory, as vLLM
sizes its KV cache, and ``--num-blocks`` as the override (vLLM's ``--num-gpu-blocks-override``).

vLLM's rule: an instance may use ``utilization x total`` bytes of its GPU; the GPU must have that
much free when it starts; what the weights, the activations and the CUDA runtime do not take is
the KV cache. Here the rule is applied per GPU before any child starts, so the pool's size is
decided once, by the supervisor, and travels in the planned config like every other planned
field (the scheduler's allocator, the writer's pool and the worker's view all read the same count):

- the GPU's free and total memory come from the driver (``pushkv.cuda_driver``, no torch);
- ranks that share a GPU (P and D on one ``--device``) share its budget evenly;
- one rank's weights are counted from the model's geometry (its TP shard, embeddings and the LM
  head replicated, as ``model.weights`` loads them), its activations estimated from
  ``max_batch_tokens`` and ``max_num_seqs``, and each of its two processes (worker and writer)
  holds a CUDA context.

A model whose weights leave no room, or whose pool cannot hold one request of the longest length
(``--max-model-len``), is refused here, before anything loads, naming the flags that fix it. The
functions below are pure but for ``size_pools``' ``memory`` argument.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import msgspec

from pushkv.config import DeploymentConfig, InstanceConfig, ModelConfig, rank_device
from pushkv.cuda_driver import DriverError
from pushkv.kv.layout import block_bytes, layout_for
from pushkv.model.footprint import lora_bank_bytes, lora_slots, weight_bytes

GIB = 1 << 30
CONTEXT_BYTES = 768 << 20  # one process's CUDA context, kernels and allocator slack (a rank runs two)
PROCESSES_PER_RANK = 2  # the worker (weights, activations) and the writer (the pool)
LOGIT_COPIES = 3  # float32 logits and the sampler's working copies of them

MemoryInfo = Callable[[int], "tuple[int, int]"]  # visible GPU ordinal -> (free, total) bytes


def activation_bytes(model: ModelConfig, inst: InstanceConfig) -> int:
    """One rank's peak step memory, estimated: every token of the largest step held across the
    widest layer (residual, norms, q/k/v, attention out, the MLP's gate/up/down columns of each
    chosen expert), and float32 logits of every sequence with the sampler's copies."""
    d, hd, tp = model.hidden_size, model.head_dim, inst.tp
    q, kv = model.num_heads // tp, max(1, model.num_kv_heads // tp)
    mlp = 3 * model.intermediate_size // tp * max(1, model.experts_per_token)
    lora = lora_slots(model) * 3 * model.lora.max_rank * 2  # x A^T over every slot, and its masked copy
    per_token = (4 * d + (q + 2 * kv) * hd + mlp + lora) * model.dtype_bytes
    return inst.max_batch_tokens * per_token + LOGIT_COPIES * inst.max_num_seqs * model.vocab_size * 4


def rank_block_bytes(model: ModelConfig, inst: InstanceConfig, rank: int) -> int:
    return block_bytes(layout_for(model, inst.tp, rank, 1, inst.block_size))


def gpu_of(inst: InstanceConfig, rank: int) -> int:
    return int(rank_device(inst, rank).split(":")[1])


@dataclass(frozen=True)
class Sizing:
    cfg: DeploymentConfig  # every pool sized (unchanged where --num-blocks gave the count)
    problems: list[str]  # [] = go; else each names the flags that fix it
    sized: tuple[str, ...] = ()  # the instances (by name) whose pool was sized from memory


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def auto_sized(inst: InstanceConfig) -> bool:
    """This instance's pool is to be sized from memory (``num_blocks`` 0: no ``--num-blocks``)."""
    return inst.num_blocks == 0


def size_pools(cfg: DeploymentConfig, memory: MemoryInfo) -> Sizing:
    """The planned ``cfg`` with every pool of ``num_blocks`` 0 sized from its GPUs (``memory``
    is asked once per GPU), or the problems that refuse it."""
    insts = cfg.instances()
    sized = [i for i in insts if auto_sized(i)]
    if not sized:
        return Sizing(cfg, [])
    on_cpu = [i.name for i in sized if not i.device.startswith("cuda")]
    if on_cpu:  # user_config never asks this; a config file may
        return Sizing(cfg, [f"{', '.join(on_cpu)}: num_blocks 0 (sized from --gpu-memory-utilization) needs a CUDA "
                            "device; a cpu pool is --num-blocks N"])
    util = cfg.gpu_memory_utilization
    sharing: dict[int, int] = {}  # GPU -> ranks of this host on it
    for inst in insts:
        if inst.device.startswith("cuda"):
            for r in range(inst.tp):
                sharing[gpu_of(inst, r)] = sharing.get(gpu_of(inst, r), 0) + 1
    problems: list[str] = []
    share: dict[int, int] = {}
    for gpu in sorted({gpu_of(i, r) for i in sized for r in range(i.tp)}):
        try:
            free, total = memory(gpu)
        except DriverError as e:
            problems.append(f"--gpu-memory-utilization: cuda:{gpu}'s memory is unknown ({e}); give --num-blocks N, "
                            "or check the GPU with nvidia-smi")
            continue
        budget = int(util * total)
        if free < budget:
            problems.append(
                f"--gpu-memory-utilization {util}: cuda:{gpu} has {_gib(free)} free of {_gib(total)}, less than "
                f"the {_gib(budget)} asked; lower it to {int(free / total * 100) / 100} or less, or free the GPU "
                "(nvidia-smi shows what holds it)")
        share[gpu] = budget // sharing[gpu]
    if problems:
        return Sizing(cfg, problems)
    counts: dict[str, int] = {}
    max_len = cfg.max_model_len or cfg.model.max_position
    for inst in sized:
        blocks = []
        for r in range(inst.tp):
            gpu = gpu_of(inst, r)
            weights, act = weight_bytes(cfg.model, inst.tp), activation_bytes(cfg.model, inst)
            lora = lora_bank_bytes(cfg.model, inst.tp)  # the LoRA adapters' slots, at --max-lora-rank
            weights += lora
            kv = share[gpu] - weights - act - PROCESSES_PER_RANK * CONTEXT_BYTES
            if kv < rank_block_bytes(cfg.model, inst, r):
                lora_note = (f" (of which {_gib(lora)} the LoRA bank: --max-loras or the adapters given, at "
                             f"--max-lora-rank {cfg.model.lora.max_rank})" if lora else "")
                spread = f", on cuda:{gpu} with {sharing[gpu] - 1} other rank(s)" if sharing[gpu] > 1 else ""
                problems.append(
                    f"{inst.name}: the model does not fit: rank {r}'s share of cuda:{gpu} is {_gib(share[gpu])} "
                    f"(--gpu-memory-utilization {util}{spread}), and its weights take {_gib(weights)}{lora_note}, "
                    f"activations {_gib(act)} and CUDA contexts {_gib(PROCESSES_PER_RANK * CONTEXT_BYTES)}, "
                    "leaving none for KV; raise -tp, give each instance its own GPUs, lower --max-batch-tokens, or "
                    "raise --gpu-memory-utilization")
                break
            blocks.append(kv // rank_block_bytes(cfg.model, inst, r))
        else:
            n = min(blocks)
            if n * inst.block_size < max_len:
                problems.append(
                    f"{inst.name}: its KV pool holds {n * inst.block_size} tokens ({n} blocks of {inst.block_size}, "
                    f"--gpu-memory-utilization {util}), fewer than one request of --max-model-len {max_len}; lower "
                    "--max-model-len, raise --gpu-memory-utilization or -tp, or fix the pool with --num-blocks")
            counts[inst.engine_id or inst.name] = n
    if problems:
        return Sizing(cfg, problems)
    return Sizing(_with_blocks(cfg, counts), [], tuple(i.name for i in sized))


def _with_blocks(cfg: DeploymentConfig, counts: dict[str, int]) -> DeploymentConfig:
    def one(inst: InstanceConfig) -> InstanceConfig:
        n = counts.get(inst.engine_id or inst.name)
        return msgspec.structs.replace(inst, num_blocks=n) if n is not None and auto_sized(inst) else inst

    changes: dict = {role: one(getattr(cfg, role)) for role in ("prefill", "decode", "local")}
    if cfg.prefills:
        changes["prefills"] = tuple(one(i) for i in cfg.prefills)
    if cfg.decodes:
        changes["decodes"] = tuple(one(i) for i in cfg.decodes)
    return msgspec.structs.replace(cfg, **changes)


def pool_note(cfg: DeploymentConfig, inst: InstanceConfig, sized_by_memory: bool) -> str:
    """What startup says of one instance's pool: blocks, GiB per rank, and tokens of context."""
    tokens = inst.num_blocks * inst.block_size
    max_len = cfg.max_model_len or cfg.model.max_position
    gib = inst.num_blocks * rank_block_bytes(cfg.model, inst, 0) / GIB
    how = (f"--gpu-memory-utilization {cfg.gpu_memory_utilization}" if sized_by_memory
           else "--num-blocks" if inst.device.startswith("cuda") else "--num-blocks (cpu)")
    return (f"KV pool {inst.name}: {inst.num_blocks} blocks x {inst.block_size} tokens = {tokens} tokens of context "
            f"({tokens / max_len:.2f} x --max-model-len {max_len}), {gib:.2f} GiB per rank on {inst.device} "
            f"(tp {inst.tp}; {how})")
