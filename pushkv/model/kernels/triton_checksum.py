"""--kv-verify's checksums on CUDA: one Triton launch reads each checked sub-block of each
layer and head once, in place in the pool, and reduces it to one 64-bit sum.

Equal to ``pushkv.kv.checksum.unit_sums`` (the torch reference, which the CPU runs) bit for
bit: the same words (int32, or int16 for rows not a multiple of 4 bytes), the same weights
(``checksum.mix`` of the word's position, as wrapping int64 multiplies and arithmetic
shifts), the same mask of tokens past the prompt, sums modulo 2**64. Program (row, layer,
head): row = one sub-block of a checked unit; its partial sum goes to ``out[row, layer,
head]``, and torch adds the rows of a unit and the layers of a group (a few kB).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch

from pushkv.extras import missing

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:  # a CUDA torch build without Triton
    raise missing("triton", "pushkv's CUDA kernels") from e

from pushkv.kv import checksum as C
from pushkv.kv.layout import KVLayout, group_heads, head_bytes, layer_groups, layer_place, pool_bytes, slab_bytes, unit


@triton.jit
def _sums_kernel(pool_ptr, rows_ptr, units_ptr, layers_ptr, base_ptr, sstride_ptr, hstride_ptr, out_ptr,
                 num_tokens, n_layers, n_heads, spu, unit_tokens,
                 GH: tl.constexpr, PLANES: tl.constexpr, SUB: tl.constexpr, WORDS: tl.constexpr,
                 SLAB: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr,
                 C1: tl.constexpr, C2: tl.constexpr):
    row = tl.program_id(0)
    li = tl.program_id(1)
    h = tl.program_id(2)
    sub_id = tl.load(rows_ptr + row).to(tl.int64)
    u = tl.load(units_ptr + row // spu).to(tl.int64)
    layer = tl.load(layers_ptr + li).to(tl.int64)
    base = tl.load(base_ptr + li) + sub_id * tl.load(sstride_ptr + li) + (h // GH) * tl.load(hstride_ptr + li) \
        + (h % GH) * HEAD
    idx = tl.arange(0, BLOCK)
    o = idx // WORDS  # token in the sub-block
    w = idx % WORDS
    t = (row % spu) * SUB + o  # token in the unit
    live = (idx < SUB * WORDS) & (u * unit_tokens + t < num_tokens)
    acc = tl.zeros((BLOCK,), dtype=tl.int64)
    for p in tl.static_range(PLANES):
        x = tl.load(pool_ptr + base + p * SLAB + idx, mask=live, other=0).to(tl.int64)
        i = ((layer * PLANES + p) * unit_tokens + t) * WORDS + w
        k = i * C1
        k = k ^ (k >> 31)
        k = k * C2
        k = k ^ (k >> 29)
        acc += x * (k | 1)
    tl.store(out_ptr + (row * n_layers + li) * n_heads + h, tl.sum(acc, axis=0))


def _upload(lists: Sequence[Sequence[int]], device) -> list[torch.Tensor]:
    """Index arrays in one copy to the device (each a host -> device copy that waits: one, not
    several, on the path of D's first token), every array starting 16-byte aligned (Triton
    specialises pointers on it; an unaligned one compiles another variant)."""
    flat: list[int] = []
    spans = []
    for xs in lists:
        spans.append((len(flat), len(xs)))
        flat.extend(xs)
        flat.extend([0] * (len(flat) % 2))
    buf = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)
    return [buf[a:a + n] for a, n in spans]


@lru_cache(maxsize=64)
def _places(lay: KVLayout, device: str) -> list[torch.Tensor]:
    """The kernel's per-layer arrays (layer, base, sub-block and head strides in words) and each
    layer's group, on ``device``: the same for every request of a pool, so uploaded once."""
    wb = C.word_bytes(lay)
    groups = layer_groups(lay)
    layers = [layer for g in groups for layer in g]
    place = [layer_place(lay, layer) for layer in layers]
    return _upload([layers, [b // wb for b, _, _ in place], [st // wb for _, st, _ in place],
                    [hs // wb for _, _, hs in place], [g for g, ls in enumerate(groups) for _ in ls]], device)


def unit_sums(views, lay: KVLayout, table: Sequence[int], num_tokens: int, units: Sequence[int],
              unit_tokens: int) -> torch.Tensor:
    """``[groups, len(units), local heads]`` int64, as ``checksum.unit_sums``: one upload of the
    request's rows, one launch, one reduction of the rows and layers into (group, unit)."""
    C.check_unit_tokens(lay, unit_tokens)
    ngroups = len(layer_groups(lay))
    dev = views[0].device
    nu = len(units)
    out = torch.zeros(ngroups, nu, lay.kv_heads, dtype=torch.int64, device=dev)
    if not nu:
        return out
    wb = C.word_bytes(lay)
    esz = views[0].element_size()
    base0 = layer_place(lay, 0)[0]
    # the whole pool, flat from its first byte, as words (a view: nothing is copied)
    flat = torch.as_strided(views[0], (pool_bytes(lay) // esz,), (1,), views[0].storage_offset() - base0 // esz)
    words = flat.view(torch.int32 if wb == 4 else torch.int16)
    spu = unit_tokens // unit(lay)
    layers_t, base, sstride, hstride, group_of = _places(lay, str(dev))
    nl = len(layers_t)
    keep = [k for g in range(ngroups) for k in C.checked_units(lay, g, units, unit_tokens, num_tokens)]
    rows_list = C.sub_rows(lay, table, units, unit_tokens)
    rows, units_t, keep_t = _upload([rows_list, list(units), [int(k) for k in keep]], dev)
    row_words = lay.head_dim * lay.dtype_bytes // wb
    block = triton.next_power_of_2(unit(lay) * row_words)
    part = torch.empty(len(rows_list), nl, lay.kv_heads, dtype=torch.int64, device=dev)
    _sums_kernel[(len(rows_list), nl, lay.kv_heads)](
        words, rows, units_t, layers_t, base, sstride, hstride, part,
        num_tokens, nl, lay.kv_heads, spu, unit_tokens,
        GH=group_heads(lay), PLANES=lay.kv_planes, SUB=unit(lay), WORDS=row_words,
        SLAB=slab_bytes(lay) // wb, HEAD=head_bytes(lay) // wb, BLOCK=block, C1=C.C1, C2=C.C2)
    per_layer = part.view(nu, spu, nl, lay.kv_heads).sum(dim=1)  # [units, layers, heads]
    # each layer's sums into its group (int64 sums wrap modulo 2**64, as the reference's), masked
    # by whether the group checks the unit
    out.index_add_(0, group_of, per_layer.permute(1, 0, 2))
    out.mul_(keep_t.view(ngroups, nu, 1))
    return out
