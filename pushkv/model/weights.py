"""Weights: where they come from (random or checkpoint) and one rank's slice of them.

Every source speaks Hugging Face parameter names (``model.layers.N.self_attn.q_proj.weight``
...), so random presets and checkpoints go through the same slicing code.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from pushkv.config import ModelConfig
from pushkv.dtypes import TORCH_DTYPES
from pushkv.model.arch import moe_parts
from pushkv.model.shard import ShardPlan


class WeightSource(Protocol):
    def has(self, name: str) -> bool: ...

    def get(self, name: str, dim: int = 0, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """The named tensor, sliced to [start, end) along dim (rows 0, columns 1)."""


def hf_names(cfg: ModelConfig, attn_names=None) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of the architecture, in a fixed order, with its full shape.
    attn_names(cfg, prefix) names a layer's attention parameters when they are not the
    dense ones (MLA: pushkv.model.mla_weights.mla_names)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab_size, d))]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", (d,)))
        if attn_names is not None:
            out += attn_names(cfg, p + "self_attn.")
        else:
            out += [
                (p + "self_attn.q_proj.weight", (cfg.num_heads * hd, d)),
                (p + "self_attn.k_proj.weight", (cfg.num_kv_heads * hd, d)),
                (p + "self_attn.v_proj.weight", (cfg.num_kv_heads * hd, d)),
                (p + "self_attn.o_proj.weight", (d, cfg.num_heads * hd)),
            ]
        if cfg.qk_norm and not cfg.is_mla:
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        if cfg.qkv_bias:
            out += [(p + "self_attn.q_proj.bias", (cfg.num_heads * hd,)),
                    (p + "self_attn.k_proj.bias", (cfg.num_kv_heads * hd,)),
                    (p + "self_attn.v_proj.bias", (cfg.num_kv_heads * hd,))]
        out.append((p + "post_attention_layernorm.weight", (d,)))
        out += _mlp_names(cfg, p, i)
    out.append(("model.norm.weight", (d,)))
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", (cfg.vocab_size, d)))
    return out


def _swiglu_names(x: str, i: int, d: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
    return [(x + names[0] + ".weight", (i, d)), (x + names[1] + ".weight", (i, d)), (x + names[2] + ".weight", (d, i))]


def _mlp_names(cfg: ModelConfig, p: str, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """A layer's SwiGLU, or its router and experts (each a SwiGLU of intermediate_size); DeepSeek's first
    ``dense_layers`` a SwiGLU of dense_intermediate_size, its router's correction bias and its shared experts."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    if not cfg.is_moe:
        return _swiglu_names(p + "mlp.", i, d)
    if layer < cfg.dense_layers:
        return _swiglu_names(p + "mlp.", cfg.dense_intermediate_size, d)
    m = moe_parts(cfg.architecture)
    out: list[tuple[str, tuple[int, ...]]] = [(f"{p}{m.block}.gate.weight", (cfg.num_experts, d))]
    if cfg.routing.bias:
        out.append((f"{p}{m.block}.gate.e_score_correction_bias", (cfg.num_experts,)))
    for e in range(cfg.num_experts):
        out += _swiglu_names(f"{p}{m.block}.experts.{e}.", i, d, (m.gate, m.up, m.down))
    if cfg.shared_intermediate_size:
        out += _swiglu_names(f"{p}{m.block}.{m.shared}.", cfg.shared_intermediate_size, d)
        if cfg.shared_gate:
            out.append((f"{p}{m.block}.{m.shared_gate}.weight", (1, d)))
    return out


class DictSource:
    """Full tensors held in memory (random presets; tests)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name, dim=0, start=0, end=None):
        t = self.tensors[name]
        return t.narrow(dim, start, (t.shape[dim] if end is None else end) - start)


def _is_bias(name: str) -> bool:
    return name.endswith(".bias")


def random_weights(cfg: ModelConfig, names=None) -> dict[str, torch.Tensor]:
    """Full float32 weights drawn from cfg.seed on a CPU generator: the same bytes in
    every process. Projections use std 1/sqrt(fan_in) so each layer changes the residual
    stream as much as the embedding does and greedy output is not a trivial echo. Tied
    embeddings are drawn 1/sqrt(hidden) smaller: at std 1, e_t . e_t dwarfs everything
    and the model only ever repeats its last token."""
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    out = {}
    for name, shape in names or hf_names(cfg):
        if len(shape) == 1:
            # a bias drawn small (not ones, a norm's weight): zero would leave its load path untested
            out[name] = torch.randn(shape, generator=gen) * 0.1 if _is_bias(name) else torch.ones(shape)
        elif name == "model.embed_tokens.weight":
            std = 1 / math.sqrt(cfg.hidden_size) if cfg.tie_embeddings else 1.0
            out[name] = torch.randn(shape, generator=gen) * std
        else:
            out[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
    return out


class RandomSource:
    """Random weights drawn on demand on the load device, in the model dtype: a real-sized
    model (8B, 32B) is ready in seconds and never holds a float32 copy. Each tensor comes
    from its own generator seeded by (cfg.seed, name), so every process on the same kind
    of device draws the same bytes whatever it loads first; ranks slice the full tensor.
    Scales as random_weights (which draws on the CPU: different bytes)."""

    def __init__(self, cfg: ModelConfig, device: str, names=None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.shapes = dict(names or hf_names(cfg))
        self.dtype = TORCH_DTYPES[cfg.dtype]

    def has(self, name: str) -> bool:
        return name in self.shapes

    def get(self, name, dim=0, start=0, end=None):
        shape = self.shapes[name]
        if len(shape) == 1 and not _is_bias(name):
            t = torch.ones(shape, dtype=self.dtype, device=self.device)
        else:
            gen = torch.Generator(device=self.device).manual_seed(
                (self.cfg.seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
            if name == "model.embed_tokens.weight":
                std = 1 / math.sqrt(self.cfg.hidden_size) if self.cfg.tie_embeddings else 1.0
            else:
                std = 0.1 if len(shape) == 1 else 1 / math.sqrt(shape[1])
            t = torch.randn(shape, generator=gen, dtype=self.dtype, device=self.device).mul_(std)
        return t.narrow(dim, start, (t.shape[dim] if end is None else end) - start)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [d]
    qkv: torch.Tensor  # [(q_heads + 2 kv_heads) * head_dim, d], local heads
    q_norm: Optional[torch.Tensor]  # [head_dim]
    k_norm: Optional[torch.Tensor]
    o: torch.Tensor  # [d, q_heads * head_dim], row-sharded (partial sums)
    post_norm: torch.Tensor  # [d]
    gate_up: torch.Tensor  # [2 * inter_local, d]; MoE: [experts, 2 * inter_local, d]
    down: torch.Tensor  # [d, inter_local], row-sharded (partial sums); MoE: [experts, d, inter_local]
    qkv_bias: Optional[torch.Tensor] = None  # [(q_heads + 2 kv_heads) * head_dim] (Qwen2)
    router: Optional[torch.Tensor] = None  # [experts, d], replicated: a MoE layer's expert scores
    shared_gate_up: Optional[torch.Tensor] = None  # [2 * shared_local, d]: an MoE layer's shared expert
    shared_down: Optional[torch.Tensor] = None  # [d, shared_local], row-sharded (partial sums)
    shared_gate: Optional[torch.Tensor] = None  # [1, d], replicated: its sigmoid gate (Qwen2-MoE)
    index: int = 0  # the layer's place in the model (a LoRA adapter's tensors are found by it)


@dataclass
class RankWeights:
    embed: torch.Tensor  # [vocab, d], replicated
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, d], replicated (may alias embed)


def load_rank(cfg: ModelConfig, plan: ShardPlan, src: WeightSource, device: str = "cpu",
              progress: Optional[Callable[[int], None]] = None) -> RankWeights:
    """Slice this rank's share out of src and cast to cfg.dtype on device (``progress`` is told
    each slice's bytes)."""
    take = taker(cfg, src, device, progress)
    hd = cfg.head_dim

    if cfg.is_mla:
        raise ValueError("MLA weights load through pushkv.model.mla_weights.load_rank_mla")
    q_rows = (plan.q_start * hd, (plan.q_start + plan.q_heads) * hd)
    kv_rows = (plan.kv_start * hd, (plan.kv_start + plan.kv_heads) * hd)
    i_rows = (plan.inter_start, plan.inter_start + plan.inter_size)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layers.append(LayerWeights(
            index=i,
            input_norm=take(p + "input_layernorm.weight"),
            qkv=torch.cat([take(a + "q_proj.weight", 0, *q_rows),
                           take(a + "k_proj.weight", 0, *kv_rows),
                           take(a + "v_proj.weight", 0, *kv_rows)]),
            q_norm=take(a + "q_norm.weight") if cfg.qk_norm else None,
            k_norm=take(a + "k_norm.weight") if cfg.qk_norm else None,
            o=take(a + "o_proj.weight", 1, *q_rows),
            qkv_bias=torch.cat([take(a + "q_proj.bias", 0, *q_rows), take(a + "k_proj.bias", 0, *kv_rows),
                                take(a + "v_proj.bias", 0, *kv_rows)]) if cfg.qkv_bias else None,
            **(moe_slices(cfg, take, p, i_rows) | shared_slices(cfg, plan, take, p) if cfg.is_moe
               else mlp_slices(take, p, i_rows)),
        ))
    return with_embeddings(cfg, take, layers)


def taker(cfg: ModelConfig, src: WeightSource, device: str, progress: Optional[Callable[[int], None]] = None):
    """take(name, dim, start, end): a slice of a source tensor, in cfg.dtype on device; ``progress``
    is told the bytes of each slice taken."""
    dtype = TORCH_DTYPES[cfg.dtype]

    def take(name, dim=0, start=0, end=None, as_dtype=None):
        """``as_dtype``: this one kept in that dtype, not the model's."""
        if not src.has(name):
            raise KeyError(f"weight {name!r} missing from the checkpoint")
        t = src.get(name, dim, start, end).to(device=device, dtype=as_dtype or dtype).contiguous()
        if progress is not None:
            progress(t.numel() * t.element_size())
        return t

    return take


def mlp_slices(take, p: str, i_rows: tuple[int, int]) -> dict:
    """Post-attention norm and this rank's SwiGLU columns/rows of layer prefix ``p``."""
    gate_up, down = swiglu_slices(take, p + "mlp.", i_rows)
    return dict(post_norm=take(p + "post_attention_layernorm.weight"), gate_up=gate_up, down=down)


def swiglu_slices(take, x: str, i_rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's gate and up rows (stacked) and down columns of the SwiGLU at prefix ``x``."""
    return (torch.cat([take(x + "gate_proj.weight", 0, *i_rows), take(x + "up_proj.weight", 0, *i_rows)]),
            take(x + "down_proj.weight", 1, *i_rows))


def tp_columns(width: int, plan: ShardPlan, what: str) -> tuple[int, int]:
    """This rank's share [start, end) of ``width`` intermediate columns (ValueError if they do not split evenly)."""
    if width % plan.tp_size:
        raise ValueError(f"{what}={width} is not divisible by tp_size={plan.tp_size}")
    n = width // plan.tp_size
    return plan.tp_rank * n, plan.tp_rank * n + n


def moe_slices(cfg: ModelConfig, take, p: str, i_rows: tuple[int, int]) -> dict:
    """A MoE layer: the router whole, and every expert's SwiGLU sliced as a dense MLP's is (TP
    across each expert's intermediate columns), stacked on a leading expert axis."""
    m = moe_parts(cfg.architecture)
    x = [f"{p}{m.block}.experts.{e}." for e in range(cfg.num_experts)]
    return dict(
        post_norm=take(p + "post_attention_layernorm.weight"),
        router=take(f"{p}{m.block}.gate.weight"),
        gate_up=torch.stack([torch.cat([take(e + m.gate + ".weight", 0, *i_rows),
                                        take(e + m.up + ".weight", 0, *i_rows)]) for e in x]),
        down=torch.stack([take(e + m.down + ".weight", 1, *i_rows) for e in x]),
    )


def shared_slices(cfg: ModelConfig, plan: ShardPlan, take, p: str) -> dict:
    """An MoE layer's shared expert (DeepSeek's, Qwen2-MoE's): its SwiGLU sliced as a dense MLP's, and its gate
    whole; none where the model has none."""
    if not cfg.shared_intermediate_size:
        return {}
    m = moe_parts(cfg.architecture)
    gate_up, down = swiglu_slices(take, f"{p}{m.block}.{m.shared}.",
                                  tp_columns(cfg.shared_intermediate_size, plan, "the shared expert's width"))
    return dict(shared_gate_up=gate_up, shared_down=down,
                shared_gate=take(f"{p}{m.block}.{m.shared_gate}.weight") if cfg.shared_gate else None)


def with_embeddings(cfg: ModelConfig, take, layers) -> "RankWeights":
    embed = take("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_embeddings else take("lm_head.weight")
    return RankWeights(embed, layers, take("model.norm.weight"), lm_head)
