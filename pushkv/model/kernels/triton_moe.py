"""The mixture-of-experts MLP on the GPU (Triton): tokens grouped by expert, one grouped GEMM
per projection. Equals ``pushkv.model.moe.moe_mlp`` (the torch reference).

A decode step routes a few tokens to a few experts each; a torch loop over experts pays a
launch (and a host sync for the group sizes) per expert and layer. Here the grouping is
device-side torch (no host sync): each token-slot (token, k-th choice) is sorted by expert and
placed in its expert's segment, padded to whole row blocks, and each row block knows its
expert. Then two launches a layer:

- ``_gate_up_kernel``: for each row block and column tile of the intermediate, gather the
  block's token rows, multiply by the expert's gate and up weights, and store
  ``silu(gate) * up`` per slot;
- ``_down_kernel``: that product times the expert's down projection, scaled by the slot's
  routing weight, stored per slot.

The k slots of a token are summed in torch (no atomics: the sum is deterministic). Only the
experts that tokens chose are read, each once per row block.
"""
from __future__ import annotations

import torch

from pushkv.extras import missing
from pushkv.model.moe import route

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:  # a CUDA torch build without Triton
    raise missing("triton", "pushkv's CUDA kernels") from e


@triton.jit
def _gate_up_kernel(H, W, Act, SlotIds, BlockExpert, n_slots, d, inter, k_top,
                    stride_h, stride_we, stride_wn, stride_act,
                    PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(BlockExpert + pid_m).to(tl.int64)
    if e < 0:  # a block past the last expert's segment
        return
    rows = pid_m * BM + tl.arange(0, BM)
    slots = tl.load(SlotIds + rows)
    valid = slots < n_slots  # padding rows of the expert's last block carry n_slots
    tok = (slots // k_top).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    w_base = W + e * stride_we
    for k0 in range(0, d, BK):
        k = k0 + kk
        a = tl.load(H + tok[:, None] * stride_h + k[None, :], mask=valid[:, None] & (k[None, :] < d), other=0.0)
        wmask = (cols[None, :] < inter) & (k[:, None] < d)
        wg = tl.load(w_base + cols[None, :] * stride_wn + k[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_base + (cols[None, :] + inter) * stride_wn + k[:, None], mask=wmask, other=0.0)
        acc_g += tl.dot(a, wg, input_precision=PREC)
        acc_u += tl.dot(a, wu, input_precision=PREC)
    # the reference rounds each projection to the model dtype before SiLU and the product
    g = acc_g.to(Act.dtype.element_ty).to(tl.float32)
    u = acc_u.to(Act.dtype.element_ty).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(Act.dtype.element_ty).to(tl.float32) * u
    tl.store(Act + slots[:, None].to(tl.int64) * stride_act + cols[None, :], act.to(Act.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < inter))


@triton.jit
def _down_kernel(Act, W, Weights, Out, SlotIds, BlockExpert, n_slots, d, inter,
                 stride_act, stride_we, stride_wn, stride_out,
                 PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(BlockExpert + pid_m).to(tl.int64)
    if e < 0:
        return
    rows = pid_m * BM + tl.arange(0, BM)
    slots = tl.load(SlotIds + rows)
    valid = slots < n_slots
    s64 = slots.to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    w_base = W + e * stride_we
    for k0 in range(0, inter, BK):
        k = k0 + kk
        a = tl.load(Act + s64[:, None] * stride_act + k[None, :], mask=valid[:, None] & (k[None, :] < inter),
                    other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + k[:, None], mask=(cols[None, :] < d) & (k[:, None] < inter),
                    other=0.0)
        acc += tl.dot(a, w, input_precision=PREC)
    wt = tl.load(Weights + slots, mask=valid, other=0.0).to(tl.float32)
    y = acc.to(Out.dtype.element_ty).to(tl.float32) * wt[:, None]
    tl.store(Out + s64[:, None] * stride_out + cols[None, :], y.to(Out.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < d))


def group_slots(experts: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] -> (slot ids [B * bm], block expert [B]): the token-slots (``t * k + j``)
    sorted by expert, each expert's run padded to whole blocks of ``bm`` rows (padding rows hold
    ``T * k``), and each block's expert (-1 past the last). ``B`` is the bound ``ceil(T k / bm) +
    E``, so nothing here waits for the device."""
    flat = experts.flatten()
    n = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    blocks = (counts + bm - 1) // bm
    ends = torch.cumsum(blocks, 0)
    starts = (ends - blocks) * bm  # each expert's first row
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    first_of = torch.cumsum(counts, 0) - counts
    pos = starts[by_expert] + torch.arange(n, device=flat.device) - first_of[by_expert]
    max_blocks = (n + bm - 1) // bm + num_experts
    slot_ids = torch.full((max_blocks * bm,), n, dtype=torch.int32, device=flat.device)
    slot_ids[pos] = order.to(torch.int32)
    block_expert = torch.searchsorted(ends, torch.arange(max_blocks, device=flat.device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return slot_ids, block_expert


def _tiles(n_slots: int) -> tuple[int, int, int]:
    """(rows, columns, depth) of a tile: small row blocks for a decode step's few slots per
    expert (less padding), larger ones for a prefill's many."""
    if n_slots <= 512:
        return 16, 64, 64
    return 64, 64, 64


def moe_mlp(h: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            k: int, renorm: bool) -> torch.Tensor:
    """As ``pushkv.model.moe.moe_mlp``: h [T, d] (normed), router [E, d], gate_up [E, 2 i, d],
    down [E, d, i] -> [T, d]."""
    T, d = h.shape
    E, two_i, _ = gate_up.shape
    inter = two_i // 2
    weights, experts = route(h, router, k, renorm)
    n = T * k
    bm, bn, bk = _tiles(n)
    slot_ids, block_expert = group_slots(experts, E, bm)
    h = h.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    act = torch.empty((n, inter), dtype=h.dtype, device=h.device)
    prec = "ieee" if h.dtype == torch.float32 else "tf32"
    grid = (block_expert.numel(), triton.cdiv(inter, bn))
    _gate_up_kernel[grid](h, gate_up, act, slot_ids, block_expert, n, d, inter, k,
                          h.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
                          PREC=prec, BM=bm, BN=bn, BK=bk)
    per_slot = torch.empty((n, d), dtype=h.dtype, device=h.device)
    grid = (block_expert.numel(), triton.cdiv(d, bn))
    _down_kernel[grid](act, down, weights.flatten().contiguous(), per_slot, slot_ids, block_expert, n, d, inter,
                       act.stride(0), down.stride(0), down.stride(1), per_slot.stride(0),
                       PREC=prec, BM=bm, BN=bn, BK=bk)
    return per_slot.view(T, k, d).sum(dim=1)
