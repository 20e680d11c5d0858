"""LoRA adapters in the forward pass, as vLLM serves them (``--enable-lora --lora-modules NAME=PATH``).

Every adapter of the deployment is loaded on every rank at start (``load_adapters``), in the model's dtype, its
scale folded into B, sliced for this rank and fused as the base weights are: q, k and v into one ``qkv`` pair whose
A stacks the three A's and whose B is block-diagonal over the rank's q, k and v rows (gate and up alike into
``gate_up``); the row-parallel o and down take this rank's columns of A, so their deltas are partial sums that the
projection's all-reduce adds up with the base's. An adapter is a slot (1, 2...: the order of ``--lora-modules``),
the same on every instance, and a step's ``SeqWork.lora`` names the slot of each sequence (0: the base model).

The adapters sit stacked by slot in a ``LoraBank``; a step's ``LoraStep`` holds each row's slot, and each adapted
projection adds ``(x A^T) B^T`` of the row's own adapter after the base projection, in the step's dtype (PEFT's
unmerged computation), as two matmuls over every slot with the other slots' columns masked off: no gather and no
host read, so decode steps through adapters replay CUDA graphs of their own (``batched.BatchedForward``).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from pushkv.config import ModelConfig
from pushkv.dtypes import TORCH_DTYPES
from pushkv.messages import SeqWork
from pushkv.model.footprint import lora_slots
from pushkv.model.lora_files import WEIGHTS_FILE, AdapterInfo, read_adapter
from pushkv.model.shard import ShardPlan

LayerLora = dict[str, tuple[torch.Tensor, torch.Tensor]]  # "qkv" | "o" | "gate_up" | "down" -> (A, B)


def load_adapters(cfg: ModelConfig, plan: ShardPlan, device: str) -> "LoraBank":
    """Every adapter of ``cfg.lora`` for this rank, in slots 1, 2... of a bank."""
    bank = LoraBank(cfg.num_layers, cfg.lora.max_rank, device, TORCH_DTYPES[cfg.dtype], lora_slots(cfg))
    for slot, mod in enumerate(cfg.lora.modules, 1):
        info = read_adapter(mod.name, mod.path, cfg, cfg.lora.max_rank)
        bank.put(slot, load_adapter(info, cfg, plan, device))
    return bank


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


# the columns of one slot in a kind's stacked pair, in ranks: q, k and v each up to --max-lora-rank (gate and up too)
KIND_PARTS = {"qkv": 3, "gate_up": 2, "o": 1, "down": 1}


class LoraBank:
    """Every adapter of this rank stacked by slot, per (layer, kind): A [capacity * W, in] and B [out, capacity * W],
    W the kind's columns at --max-lora-rank, slot s in columns [(s - 1) W, s W) (zero past the adapter's own rank,
    and where no adapter is loaded). A step multiplies its rows by every slot's A, keeps each row's own slot's columns
    and multiplies by B: two matmuls a projection whatever adapters the step mixes, with no gather and no host
    read, so a decode step through adapters replays a CUDA graph (its rows' slots an input of the graph). Loading into
    a slot writes in place; ``put`` says when it had to reallocate (more slots, or a kind no adapter had), which the
    graphs captured before cannot see."""

    def __init__(self, num_layers: int, max_rank: int, device, dtype, capacity: int = 0):
        self.max_rank, self.device, self.dtype = max_rank, torch.device(device), dtype
        self.layers: list[LayerLora] = [{} for _ in range(num_layers)]
        self.capacity = capacity  # slots each kind's pair is made with (footprint.lora_slots: what sizing counted)
        self.loaded: set[int] = set()

    def width(self, kind: str) -> int:
        return KIND_PARTS[kind] * self.max_rank

    def pair(self, layer: int, kind: str) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        return self.layers[layer].get(kind)

    def put(self, slot: int, adapter: list[LayerLora]) -> bool:
        """``adapter`` (load_adapter's pairs) into ``slot``; True where a tensor was reallocated."""
        grew = slot > self.capacity
        if grew:
            self._resize(max(slot, 2 * self.capacity))
        self._zero(slot)
        for layer, pairs in enumerate(adapter):
            for kind, (a, b) in pairs.items():
                if kind not in self.layers[layer]:
                    n = self.capacity * self.width(kind)
                    self.layers[layer][kind] = (torch.zeros(n, a.shape[1], device=self.device, dtype=self.dtype),
                                                torch.zeros(b.shape[0], n, device=self.device, dtype=self.dtype))
                    grew = True
                big_a, big_b = self.layers[layer][kind]
                c0 = (slot - 1) * self.width(kind)
                big_a[c0:c0 + a.shape[0]].copy_(a)
                big_b[:, c0:c0 + a.shape[0]].copy_(b)
        self.loaded.add(slot)
        return grew

    def clear(self, slot: int) -> None:
        if slot in self.loaded:
            self._zero(slot)
            self.loaded.discard(slot)

    def _zero(self, slot: int) -> None:
        for pairs in self.layers:
            for kind, (a, b) in pairs.items():
                c0 = (slot - 1) * self.width(kind)
                a[c0:c0 + self.width(kind)].zero_()
                b[:, c0:c0 + self.width(kind)].zero_()

    def _resize(self, capacity: int) -> None:
        """Every pair at ``capacity`` slots, all or none: the new tensors are all made before any replaces its old
        one, so running out of memory midway (the load fails) leaves the bank, and the graphs captured on it, as
        they were."""
        grown = []
        for pairs in self.layers:
            for kind, (a, b) in pairs.items():
                n = capacity * self.width(kind)
                grown.append((pairs, kind, torch.zeros(n, a.shape[1], device=self.device, dtype=self.dtype),
                              torch.zeros(b.shape[0], n, device=self.device, dtype=self.dtype)))
        for pairs, kind, big_a, big_b in grown:
            a, b = pairs[kind]
            big_a[:a.shape[0]].copy_(a)
            big_b[:, :b.shape[1]].copy_(b)
            pairs[kind] = (big_a, big_b)
        self.capacity = capacity


# a step of a few rows adds its deltas through the two-launch Triton form (kernels/triton_lora.py): None, on CUDA;
# True or False, everywhere or nowhere (the tests under Triton's interpreter; experiments/lora_bench.py's variants)
KERNELS: Optional[bool] = None


def _kernel_tokens() -> int:
    from pushkv.model.kernels import triton_lora

    return triton_lora.TOKENS


class LoraStep:
    """One step's adapters: each row's slot (0: the base model), on the device. ``add`` keeps each row's own slot's
    columns of ``x`` A^T (a mask made once a step per kind) and adds them times B^T to the base projection."""

    def __init__(self, bank: LoraBank, slots: Optional[torch.Tensor] = None, rows: Sequence[int] = (),
                 device: Optional[torch.device] = None):
        self.bank = bank
        self._slots, self._rows = slots, rows  # the rows' slots on the device, or made from ``rows`` when first used
        used = [r for r in rows if r]  # the slots the rows use, from the lowest to the highest (None: not known here)
        self._span = (min(used), max(used)) if used else None
        self.device = slots.device if slots is not None else torch.device(device or "cpu")
        self._masks: dict[str, torch.Tensor] = {}
        self.kernels = self.device.type == "cuda" if KERNELS is None else KERNELS

    @property
    def slots(self) -> torch.Tensor:
        """Each row's slot on the device: a graph's input, the batched step's upload (``take``), or copied from the
        rows when first used (the per-sequence engine). Never made where unused: a step that replays a graph reads
        its own, and a copy from pageable memory would hold the host until the GPU had finished the step before."""
        if self._slots is None:
            self._slots = torch.tensor(self._rows, dtype=torch.int32, device=self.device)
        return self._slots

    def take(self, slots: torch.Tensor) -> None:
        """The rows' slots, already on the device (the batched step's one upload of its plan)."""
        self._slots = slots

    @staticmethod
    def of(bank: Optional[LoraBank], seqs: Sequence[SeqWork], device: torch.device) -> Optional["LoraStep"]:
        """The step's rows' slots, packed as the step packs its sequences' tokens, or None where none of its
        sequences has an adapter (ValueError for a slot not loaded)."""
        used = {s.lora for s in seqs if s.lora}
        if not used:
            return None
        if bank is None or used - bank.loaded:
            loaded = bank.loaded if bank is not None else set()
            raise ValueError(f"LoRA slots {sorted(used - loaded)} are not loaded here (loaded: {sorted(loaded)})")
        rows = [s.lora for s in seqs for _ in range(len(s.token_ids))]
        return LoraStep(bank, rows=rows, device=device)

    def fresh(self) -> None:
        """Forget the masks: the next step makes them from ``slots`` again (a graph's step: its slots are new)."""
        self._masks.clear()

    def span(self) -> tuple[int, int]:
        """The slots the step's rows use, as a range [first, last] of the bank's (where the step's rows are known on
        the host: a step that runs eagerly); else every slot. Torch's form multiplies by those slots' columns only."""
        return self._span or (1, self.bank.capacity)

    def mask(self, kind: str, dtype: torch.dtype) -> torch.Tensor:
        got = self._masks.get(kind)
        if got is None:
            w, (first, last) = self.bank.width(kind), self.span()
            col = torch.arange((first - 1) * w, last * w, device=self.slots.device, dtype=torch.int32) // w + 1
            got = self._masks[kind] = (self.slots[:, None] == col[None, :]).to(dtype)
        return got

    def add(self, layer: int, kind: str, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y`` (the base projection of ``x``, [T, out]) with each row's adapter's delta added, in place."""
        pair = self.bank.pair(layer, kind)
        if pair is None:
            return y
        a, b = pair
        if self.kernels and x.shape[0] <= _kernel_tokens() and x.stride(1) == 1 and y.stride(1) == 1:
            from pushkv.model.kernels import triton_lora

            return triton_lora.add_delta(y, x, a, b, self.slots, self.bank.width(kind))
        w, (first, last) = self.bank.width(kind), self.span()
        a, b = a[(first - 1) * w:last * w], b[:, (first - 1) * w:last * w]  # views: the used slots' columns
        return y.addmm_(x.mm(a.t()).mul_(self.mask(kind, x.dtype)), b.t())
