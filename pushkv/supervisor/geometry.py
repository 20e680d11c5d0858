"""Launch-time check that a deployment's instances can run the model and that P
and D can move KV between their layouts.

Pure: no processes, no torch. ``pushkv up`` calls :func:`check_deployment`
from ``plan_deployment``, so a bad combination exits non-zero with the
mismatch named before any child starts, instead of failing in a worker or at
the first handshake.

What is supported: any block size >= 1 on either side (P and D need not
agree: both pools are cut into sub-blocks of gcd(P block, D block) tokens, so
P 16 / D 32 moves whole sub-blocks; a gcd below MIN_SUB_BLOCK tokens is refused,
as the model would then page in slivers); any TP size that shards the model
(query heads and MLP columns divide evenly; KV heads divide evenly, or, with
more ranks than KV heads, the rank count is a multiple of them: heads are then
replicated and only the lowest P rank holding a head writes it).
"""
from __future__ import annotations

import math

from pushkv.config import DTYPE_BYTES, DeploymentConfig, InstanceConfig, ModelConfig
from pushkv.kv.layout import instance_layout, layout_for
from pushkv.model.shard import shard_plan
from pushkv.protocol.mapping import check_compatible
from pushkv.protocol.tp import producers_for

MIN_SUB_BLOCK = 4  # tokens: the smallest common sub-block both pools may be cut into


def check_model(model: ModelConfig) -> None:
    """Geometry the model code itself would refuse, named up front."""
    if model.dtype not in DTYPE_BYTES:
        raise ValueError(f"model dtype {model.dtype!r} unsupported; expected one of {sorted(DTYPE_BYTES)}")
    if model.sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0, got {model.sliding_window}")
    bad = [l for l in model.window_layers if not 0 <= l < model.num_layers]
    if bad:
        raise ValueError(f"window_layers {bad} outside num_layers={model.num_layers}")
    if model.window_layers and not model.sliding_window:
        raise ValueError(f"window_layers {list(model.window_layers)} given but sliding_window is 0")
    if model.kv_lora_rank < 0 or model.qk_rope_dim < 0:
        raise ValueError("kv_lora_rank and qk_rope_dim must be >= 0")
    rope = model.qk_rope_dim if model.is_mla else model.head_dim
    if rope % 2:
        raise ValueError(f"RoPE dims ({rope}) must be even")
    if model.is_mla and model.checkpoint and not model.architecture.startswith("Deepseek"):
        raise ValueError("MLA-style models run on random weights, or from a DeepSeek-V2/V3 checkpoint")


def check_instance(model: ModelConfig, inst: InstanceConfig) -> None:
    """This instance's TP size shards the model, and its pool is usable."""
    who = f"{inst.role} instance"
    if inst.block_size < 1:
        raise ValueError(f"{who}: block_size must be >= 1, got {inst.block_size}")
    if inst.num_blocks < 0 or (inst.num_blocks == 0 and not inst.device.startswith("cuda")):
        raise ValueError(f"{who}: num_blocks must be >= 1 (0: sized from --gpu-memory-utilization, on CUDA "
                         f"only), got {inst.num_blocks} on {inst.device}")
    if inst.tp < 1:
        raise ValueError(f"{who}: tp must be >= 1, got {inst.tp}")
    try:
        for r in range(inst.tp):
            shard_plan(model, r, inst.tp)
            layout_for(model, inst.tp, r, inst.num_blocks, inst.block_size)
    except ValueError as e:
        raise ValueError(f"{who}: tp={inst.tp} cannot shard model {model.name!r}: {e}") from None


def check_pair(cfg: DeploymentConfig) -> None:
    """The pools' common sub-block is usable, and every D rank's producers have layouts
    the mapping can move between."""
    p, d, model = cfg.prefill, cfg.decode, cfg.model
    sub = math.gcd(p.block_size, d.block_size)
    if sub < min(MIN_SUB_BLOCK, p.block_size, d.block_size):
        raise ValueError(f"prefill block_size {p.block_size} and decode block_size {d.block_size} share "
                         f"sub-blocks of only {sub} token(s) (gcd); pick sizes whose gcd is >= {MIN_SUB_BLOCK} "
                         f"(e.g. one a multiple of the other)")
    total = model.cache_kv_heads
    for dr in range(d.tp):
        dst = instance_layout(cfg, d, dr)
        for pr in producers_for(dr, d.tp, p.tp, total):
            src = instance_layout(cfg, p, pr)
            try:
                check_compatible(src, dst)
            except ValueError as e:
                raise ValueError(f"prefill rank {pr} (tp={p.tp}, block {p.block_size}) -> decode rank {dr} "
                                 f"(tp={d.tp}, block {d.block_size}): {e}") from None


def check_deployment(cfg: DeploymentConfig) -> None:
    """Raise ValueError naming the first mismatch that would stop the deployment."""
    check_model(cfg.model)
    for inst in cfg.instances():
        check_instance(cfg.model, inst)
    if cfg.mode != "local":
        check_pair(cfg)
