"""Build one tensor-parallel rank's model from a config: weights, then the model class."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from pushkv.config import ModelConfig
from pushkv.model.footprint import weight_bytes
from pushkv.model.load_progress import LoadProgress
from pushkv.model.mla import MLAModel
from pushkv.model.mla_weights import load_rank_mla, mla_names
from pushkv.model.shard import shard_plan
from pushkv.model.transformer import Model
from pushkv.model.weights import (
    TORCH_DTYPES,
    DictSource,
    RandomSource,
    WeightSource,
    hf_names,
    load_rank,
    random_weights,
    taker,
)

log = logging.getLogger(__name__)

ENGINES = ("auto", "batched", "per-seq")


def param_names(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    return hf_names(cfg, mla_names if cfg.is_mla else None)


def build_model(cfg: ModelConfig, tp_rank: int = 0, tp_size: int = 1, device: str = "cpu",
                group=None, source: Optional[WeightSource] = None, max_num_seqs: int = 64,
                label: str = "", progress: Optional[LoadProgress] = None) -> Model:
    """This rank's model: weights from cfg.checkpoint, from source, or random from cfg.seed
    (drawn on the CPU, or on the device when cfg.random_init == "device"). The batched
    engine (pushkv.model.batched) runs steps on CUDA, or wherever cfg.engine says;
    max_num_seqs bounds the decode batches it captures as CUDA graphs. Loading shows its progress
    (``model.load_progress``, or ``progress``) under ``label`` (the process's name; default: the model
    and rank)."""
    if cfg.engine not in ENGINES:
        raise ValueError(f"unknown engine {cfg.engine!r}; known: {ENGINES}")
    if cfg.random_init not in ("cpu", "device"):
        raise ValueError(f"random_init must be 'cpu' or 'device', not {cfg.random_init!r}")
    if cfg.dtype not in TORCH_DTYPES:
        raise ValueError(f"unsupported dtype {cfg.dtype!r}")
    if cfg.sliding_window < 0 or any(not 0 <= i < cfg.num_layers for i in cfg.window_layers):
        raise ValueError(f"bad sliding window {cfg.sliding_window} / layers {cfg.window_layers}")
    if (cfg.qk_rope_dim if cfg.is_mla else cfg.head_dim) % 2:
        raise ValueError(f"RoPE dims ({cfg.qk_rope_dim if cfg.is_mla else cfg.head_dim}) must be even")
    plan = shard_plan(cfg, tp_rank, tp_size)
    if tp_size > 1 and group is None and not torch.distributed.is_initialized():
        raise ValueError("tp_size > 1 needs an initialised torch.distributed group")
    if source is None:
        if cfg.checkpoint:
            from pushkv.model.checkpoint import checkpoint_source

            source = checkpoint_source(cfg)
        elif cfg.random_init == "device":
            source = RandomSource(cfg, device, param_names(cfg))
        else:
            source = DictSource(random_weights(cfg, param_names(cfg)))
    if progress is None:
        progress = LoadProgress(label or f"{cfg.name} rank {tp_rank}/{tp_size}", weight_bytes(cfg, tp_size))
    if cfg.is_mla:
        weights = load_rank_mla(cfg, plan, taker(cfg, source, device, progress))
    else:
        weights = load_rank(cfg, plan, source, device, progress)
    progress.finish()
    log.info("model %s rank %d/%d: %d layers, q heads %d, kv heads %d from %d%s",
             cfg.name, tp_rank, tp_size, cfg.num_layers, plan.q_heads, plan.kv_heads, plan.kv_start,
             " (MLA latent, replicated)" if cfg.is_mla else "")
    model = (MLAModel if cfg.is_mla else Model)(cfg, plan, weights, device, group)
    if cfg.lora.enabled:  # (a bank even without adapters yet: a runtime load puts its adapter in it)
        from pushkv.model.lora import load_adapters

        model.lora_bank = load_adapters(cfg, plan, device)
        log.info("LoRA adapters %s loaded (max rank %d)", [m.name for m in cfg.lora.modules], cfg.lora.max_rank)
    # on CUDA "auto" is the batched engine, MLA's torch path (pushkv.model.batched._layers_mla) included: on an H200
    # its absorbed decode attention took 0.20 ms a row against the per-sequence engine's 3.35 at a context of 16k
    # (docs/results/2026-12-05-deepseek-gpu)
    if cfg.engine == "batched" or (cfg.engine == "auto" and model.device.type == "cuda"):
        model.enable_batched(max_num_seqs)
    return model
