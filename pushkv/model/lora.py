"""LoRA adapters in the forward pass, as vLLM serves them (``--enable-lora --lora-modules NAME=PATH``).

Every adapter of the deployment is loaded on every rank at start (``load_adapters``), in the model's dtype, its
scale folded into B, sliced for this rank and fused as the base weights are: q, k and v into one ``qkv`` pair whose
A stacks the three A's and whose B is block-diagonal over the rank's q, k and v rows (gate and up alike into
``gate_up``); the row-parallel o and down take this rank's columns of A, so their deltas are partial sums that the
projection's all-reduce adds up with the base's. An adapter is a slot (1, 2...: the order of ``--lora-modules``),
the same on every instance, and a step's ``SeqWork.lora`` names the slot of each sequence (0: the base model).

One step's rows per adapter are a ``LoraStep``; each adapted projection adds ``(x A^T) B^T`` to the rows of each
adapter that adapts it, after the base projection, in the step's dtype (PEFT's unmerged computation). A decode step
with an adapter in it runs eagerly, not from a CUDA graph.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from pushkv.config import ModelConfig
from pushkv.dtypes import TORCH_DTYPES
from pushkv.messages import SeqWork
from pushkv.model.lora_files import WEIGHTS_FILE, AdapterInfo, read_adapter
from pushkv.model.shard import ShardPlan

LayerLora = dict[str, tuple[torch.Tensor, torch.Tensor]]  # "qkv" | "o" | "gate_up" | "down" -> (A, B)


def load_adapters(cfg: ModelConfig, plan: ShardPlan, device: str) -> dict[int, list[LayerLora]]:
    """Every adapter of ``cfg.lora`` for this rank, by slot."""
    out = {}
    for slot, mod in enumerate(cfg.lora.modules, 1):
        info = read_adapter(mod.name, mod.path, cfg, cfg.lora.max_rank)
        out[slot] = load_adapter(info, cfg, plan, device)
    return out


def load_adapter(info: AdapterInfo, cfg: ModelConfig, plan: ShardPlan, device: str) -> list[LayerLora]:
    """One adapter's per-layer (A, B) pairs for this rank (see the module doc)."""
    from safetensors import safe_open

    dtype, hd = TORCH_DTYPES[cfg.dtype], cfg.head_dim
    q_rows = (plan.q_start * hd, (plan.q_start + plan.q_heads) * hd)
    kv_rows = (plan.kv_start * hd, (plan.kv_start + plan.kv_heads) * hd)
    width = cfg.dense_intermediate_size if cfg.is_moe else cfg.intermediate_size
    per = width // plan.tp_size
    i_rows = (plan.tp_rank * per, plan.tp_rank * per + per)
    layers: list[LayerLora] = [{} for _ in range(cfg.num_layers)]
    with safe_open(os.path.join(info.path, WEIGHTS_FILE), "pt") as f:
        def get(layer: int, module: str, ab: str) -> Optional[torch.Tensor]:
            key = info.tensors.get((layer, module, ab))
            return None if key is None else f.get_tensor(key).to(torch.float32)

        for layer, lw in enumerate(layers):
            for kind, parts in (("qkv", (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows))),
                                ("gate_up", (("gate_proj", i_rows), ("up_proj", i_rows)))):
                pair = _column_parallel(get, layer, parts, info.scale)
                if pair is not None:
                    lw[kind] = pair
            for kind, module, cols in (("o", "o_proj", q_rows), ("down", "down_proj", i_rows)):
                a, b = get(layer, module, "A"), get(layer, module, "B")
                if a is not None and b is not None:
                    lw[kind] = (a[:, cols[0]:cols[1]], b * info.scale)
            for kind, pair in lw.items():
                lw[kind] = tuple(t.to(device=device, dtype=dtype).contiguous() for t in pair)  # type: ignore[assignment]
    return layers


def _column_parallel(get, layer: int, parts, scale: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """A fused projection's pair: the A's of the parts adapted stacked, B block-diagonal over this rank's rows of
    each part (zero where a part is not adapted); None where no part is."""
    got = [(get(layer, module, "A"), get(layer, module, "B"), rows) for module, rows in parts]
    adapted = [(a, b, rows) for a, b, rows in got if a is not None and b is not None]
    if not adapted:
        return None
    total = sum(r1 - r0 for _, (r0, r1) in parts)
    a_all = torch.cat([a for a, _, _ in adapted])
    b_all = torch.zeros(total, a_all.shape[0])
    row = col = 0
    for a, b, (r0, r1) in got:
        if a is not None and b is not None:
            b_all[row:row + r1 - r0, col:col + a.shape[0]] = b[r0:r1] * scale
            col += a.shape[0]
        row += r1 - r0
    return a_all, b_all


class LoraStep:
    """One step's rows of each adapter in it (``SeqWork.lora``), packed as the step packs its sequences' tokens."""

    def __init__(self, adapters: dict[int, list[LayerLora]], seqs: Sequence[SeqWork], device: torch.device):
        rows: dict[int, list[int]] = {}
        at = 0
        for s in seqs:
            n = len(s.token_ids)
            if s.lora:
                rows.setdefault(s.lora, []).extend(range(at, at + n))
            at += n
        self.parts = [(adapters[slot], None if len(r) == at else torch.tensor(r, device=device))
                      for slot, r in rows.items()]

    @staticmethod
    def of(adapters: dict[int, list[LayerLora]], seqs: Sequence[SeqWork],
           device: torch.device) -> Optional["LoraStep"]:
        """The step's adapters, or None where none of its sequences has one (ValueError for a slot not loaded)."""
        slots = {s.lora for s in seqs if s.lora}
        if not slots:
            return None
        unknown = slots - set(adapters)
        if unknown:
            raise ValueError(f"LoRA slots {sorted(unknown)} are not loaded here (loaded: {sorted(adapters)})")
        return LoraStep(adapters, seqs, device)

    def add(self, layer: int, kind: str, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y`` (the base projection of ``x``, [T, out]) with each adapter's delta added to its rows, in place."""
        for layers, rows in self.parts:
            pair = layers[layer].get(kind)
            if pair is None:
                continue
            a, b = pair
            if rows is None:
                y.addmm_(x.mm(a.t()), b.t())
            else:
                y.index_add_(0, rows, x.index_select(0, rows).mm(a.t()).mm(b.t()))
        return y
