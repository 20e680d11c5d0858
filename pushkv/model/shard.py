"""Tensor-parallel geometry: which heads and MLP columns one rank holds.

Pure arithmetic, no torch.distributed. Attention is sharded by query heads;
each rank's query heads must use exactly its own KV heads, so when there are
more ranks than KV heads each rank holds one (replicated) KV head.
"""
from __future__ import annotations

from dataclasses import dataclass

from pushkv.config import ModelConfig


@dataclass(frozen=True)
class ShardPlan:
    tp_rank: int
    tp_size: int
    q_start: int  # first global query head of this rank
    q_heads: int  # query heads on this rank
    kv_start: int  # first global KV head of this rank
    kv_heads: int  # KV heads on this rank
    inter_start: int  # first MLP intermediate column
    inter_size: int  # MLP intermediate columns on this rank

    @property
    def group(self) -> int:
        """Query heads per KV head, locally."""
        return self.q_heads // self.kv_heads


def shard_plan(cfg: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> ShardPlan:
    """Raise ValueError for any geometry that cannot be sharded over tp_size ranks."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"bad tensor-parallel rank {tp_rank} of {tp_size}")
    nh, nkv = cfg.num_heads, cfg.num_kv_heads
    if nh <= 0 or nkv <= 0 or nh % nkv:
        raise ValueError(f"num_heads={nh} must be a positive multiple of num_kv_heads={nkv}")
    if nh % tp_size:
        raise ValueError(f"num_heads={nh} is not divisible by tp_size={tp_size}")
    if cfg.intermediate_size % tp_size:
        raise ValueError(
            f"intermediate_size={cfg.intermediate_size} is not divisible by tp_size={tp_size}")
    if tp_size <= nkv:
        if nkv % tp_size:
            raise ValueError(f"num_kv_heads={nkv} is not divisible by tp_size={tp_size}")
        kv_heads = nkv // tp_size
        kv_start = tp_rank * kv_heads
    else:
        # More ranks than KV heads: each rank's query heads must fall in one KV group.
        if tp_size % nkv:
            raise ValueError(
                f"tp_size={tp_size} > num_kv_heads={nkv} needs tp_size to be a multiple of it")
        kv_heads = 1
        kv_start = tp_rank * nkv // tp_size
    q_heads = nh // tp_size
    inter = cfg.intermediate_size // tp_size
    plan = ShardPlan(tp_rank, tp_size, tp_rank * q_heads, q_heads, kv_start, kv_heads,
                     tp_rank * inter, inter)
    group = nh // nkv
    # Every local query head must map to a local KV head.
    for h in range(plan.q_start, plan.q_start + q_heads):
        if not plan.kv_start <= h // group < plan.kv_start + kv_heads:
            raise ValueError(f"query head {h} of rank {tp_rank} has no local KV head")
    return plan
