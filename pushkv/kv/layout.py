"""Physical layout of one rank's KV pool.

The pool is cut into **regions**, one per (layer group, head group), laid out
back to back (layer group outer):

- layer groups split layers by attention kind: one group when every layer
  attends the same way, two (full attention, then sliding window) for a hybrid
  model, so a window group can skip the blocks before the window and still move
  a run of blocks as one region;
- head groups split the rank's local KV heads into equal runs of
  ``head_group`` heads: the heads one peer rank shares with this one, so a TP
  mismatch still moves whole regions.

A region is ``[physical blocks, group layers, kv_planes, group heads, sub_block,
head_dim]``: block-major across its layers, so a run of consecutive blocks is one
descriptor per region. A logical block (the allocation unit, ``block_size``
tokens, what block tables name) is ``block_size / sub_block`` consecutive
physical sub-blocks: logical block ``b`` is sub-blocks ``b*m .. b*m + m-1``. With
both sides cut into sub-blocks of the smaller block size, P 16 / D 32 moves as
whole sub-blocks too.

``kv_planes`` is 2 (K and V) for GQA/MHA; 1 for an MLA-style latent cache, whose
one "head" (``total_kv_heads == 1``) every TP rank holds in full.

With one region the pool tensor is 6-d, ``pool_shape(lay)``; otherwise flat, and
``layer_views`` gives each layer's view: ``[sub-blocks, planes, heads, sub_block,
head_dim]``, or with several head groups ``[sub-blocks, planes, groups,
group heads, sub_block, head_dim]`` (it works on either).
"""
from __future__ import annotations

import math
from functools import lru_cache

import msgspec

from pushkv.config import TransferPlan
from pushkv.kinds import Direction
from pushkv.messages import KVLayoutDesc

KVLayout = KVLayoutDesc  # the wire struct is the layout; helpers below


# ------------------------------------------------------------------ geometry
def layer_groups(lay: KVLayout) -> tuple[tuple[int, ...], ...]:
    """Layers of each group, in pool order: full attention first, then sliding window; with
    ``layer_split`` (layer-streamed push, no window layers) the layers cut into that many runs
    of consecutive layers, so each run's KV is whole regions a WRITE can move on its own."""
    return _groups(lay.num_layers, tuple(lay.window_layers) if lay.window > 0 else (), lay.layer_split)


@lru_cache(maxsize=256)
def _groups(num_layers: int, window_layers: tuple[int, ...], split: int = 0) -> tuple[tuple[int, ...], ...]:
    win = set(window_layers)
    full = tuple(l for l in range(num_layers) if l not in win)
    windowed = tuple(l for l in range(num_layers) if l in win)
    if split > 1 and not windowed:
        return split_layers(num_layers, split)
    return tuple(g for g in (full, windowed) if g)


def split_layers(num_layers: int, parts: int) -> tuple[tuple[int, ...], ...]:
    """``range(num_layers)`` cut into ``min(parts, num_layers)`` runs of consecutive layers.

    From three runs up the first and the last are about half as long as the others: a
    layer-streamed WRITE can leave once the first run is stored, so a short one starts the link
    sooner, and what is left after the prompt's last layer (the last run's WRITE, its copy-in and
    check on D) is short too. The runs between are as equal as they divide, the earlier ones a
    layer longer."""
    parts = max(1, min(parts, num_layers))
    if parts < 3:
        return _even(0, num_layers, parts)
    edge = max(1, min(round(num_layers / (parts - 1) / 2), (num_layers - (parts - 2)) // 2))
    middle = _even(edge, num_layers - 2 * edge, parts - 2)
    return (tuple(range(edge)),) + middle + (tuple(range(num_layers - edge, num_layers)),)


def _even(first: int, count: int, parts: int) -> tuple[tuple[int, ...], ...]:
    size, extra = divmod(count, parts)
    out, start = [], first
    for i in range(parts):
        n = size + (i < extra)
        out.append(tuple(range(start, start + n)))
        start += n
    return tuple(out)


def window_group(lay: KVLayout) -> int:
    """Index of the sliding-window layer group, or -1 when no layer uses the window."""
    if lay.window <= 0 or not lay.window_layers:
        return -1
    return len(layer_groups(lay)) - 1


def unit(lay: KVLayout) -> int:
    """Tokens per physical sub-block."""
    return lay.sub_block or lay.block_size


def subs_per_block(lay: KVLayout) -> int:
    return lay.block_size // unit(lay)


def phys_blocks(lay: KVLayout) -> int:
    return lay.num_blocks * subs_per_block(lay)


def group_heads(lay: KVLayout) -> int:
    """Local heads per head group."""
    return lay.head_group or lay.kv_heads


def head_groups(lay: KVLayout) -> int:
    return lay.kv_heads // group_heads(lay)


# --------------------------------------------------------------------- bytes
def token_bytes(lay: KVLayout) -> int:
    """Bytes of one token of one head in one (layer, plane) slab."""
    return lay.head_dim * lay.dtype_bytes


def head_bytes(lay: KVLayout) -> int:
    """Bytes of one head of one sub-block in one (layer, plane) slab."""
    return unit(lay) * token_bytes(lay)


def slab_bytes(lay: KVLayout) -> int:
    """Bytes of one (sub-block, layer, plane) slab of one head group."""
    return group_heads(lay) * head_bytes(lay)


def layer_bytes(lay: KVLayout) -> int:
    """Bytes of one layer of one sub-block of one head group: every plane."""
    return lay.kv_planes * slab_bytes(lay)


def block_bytes(lay: KVLayout) -> int:
    """Bytes one logical block id holds, summed over every region."""
    return lay.num_layers * lay.kv_planes * lay.kv_heads * lay.block_size * token_bytes(lay)


def pool_bytes(lay: KVLayout) -> int:
    return lay.num_blocks * block_bytes(lay)


def region_block_bytes(lay: KVLayout, group: int) -> int:
    """Bytes of one sub-block in one region of layer group ``group`` (the stride between
    sub-block ids there)."""
    return len(layer_groups(lay)[group]) * layer_bytes(lay)


def region_bytes(lay: KVLayout, group: int) -> int:
    return phys_blocks(lay) * region_block_bytes(lay, group)


def region_base(lay: KVLayout, group: int, hgroup: int = 0) -> int:
    """Byte offset of region (layer group, head group) from the pool base."""
    before = sum(region_bytes(lay, g) for g in range(group)) * head_groups(lay)
    return before + hgroup * region_bytes(lay, group)


def layer_place(lay: KVLayout, layer: int) -> tuple[int, int, int]:
    """``(offset of sub-block 0 of head group 0, stride between sub-blocks, stride between
    head groups)`` of one layer, in bytes."""
    for g, layers in enumerate(layer_groups(lay)):
        if layer in layers:
            return (region_base(lay, g) + layers.index(layer) * layer_bytes(lay),
                    region_block_bytes(lay, g), region_bytes(lay, g))
    raise ValueError(f"layer {layer} outside num_layers={lay.num_layers}")


def offset(lay: KVLayout, block: int, layer: int = 0, kv: int = 0, head: int = 0, token: int = 0) -> int:
    """Byte offset of (physical sub-block, layer, plane, local head, token in the sub-block)."""
    base, stride, hstride = layer_place(lay, layer)
    g, h = divmod(head, group_heads(lay))
    return (base + g * hstride + block * stride + kv * slab_bytes(lay) + h * head_bytes(lay)
            + token * token_bytes(lay))


def pool_shape(lay: KVLayout) -> tuple[int, ...]:
    if len(layer_groups(lay)) == 1 and head_groups(lay) == 1:
        return (phys_blocks(lay), lay.num_layers, lay.kv_planes, lay.kv_heads, unit(lay), lay.head_dim)
    return (pool_bytes(lay) // lay.dtype_bytes,)


def expand_table(lay: KVLayout, table) -> list[int]:
    """Logical block ids -> physical sub-block ids, in token order."""
    m = subs_per_block(lay)
    if m == 1:
        return list(table)
    return [b * m + s for b in table for s in range(m)]


def layer_views(pool, lay: KVLayout) -> list:
    """Per-layer views of a pool tensor (6-d or flat, contiguous, the model's dtype):
    ``[sub-blocks, planes, heads, sub_block, head_dim]`` with one head group, else
    ``[sub-blocks, planes, groups, group heads, sub_block, head_dim]``."""
    flat = pool.reshape(-1)
    if flat.numel() * flat.element_size() != pool_bytes(lay):
        raise ValueError(f"pool of {flat.numel() * flat.element_size()} B does not match layout "
                         f"({pool_bytes(lay)} B)")
    esz = flat.element_size()
    hd, u, hg, ng = lay.head_dim, unit(lay), group_heads(lay), head_groups(lay)
    views = []
    for layer in range(lay.num_layers):
        base, stride, hstride = layer_place(lay, layer)
        size: tuple[int, ...] = (phys_blocks(lay), lay.kv_planes, ng, hg, u, hd)
        strides: tuple[int, ...] = (stride // esz, slab_bytes(lay) // esz, hstride // esz, u * hd, hd, 1)
        if ng == 1:
            size, strides = size[:2] + size[3:], strides[:2] + strides[3:]
        views.append(flat.as_strided(size, strides, flat.storage_offset() + base // esz))
    return views


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# ------------------------------------------------------------------- choosing
# No instance is cut over more ranks than this. A TP size past it, off the wire, is refused before
# anything loops over its ranks: a Register naming tp = 2**31 would otherwise hold a writer's loop
# for minutes in ``protocol.tp.consumers_for``.
MAX_TP = 1024


def rank_heads(tp: int, rank: int, total_kv_heads: int) -> tuple[int, int]:
    """``(first global head, count)`` held by ``rank`` of a ``tp``-way instance."""
    if tp < 1 or total_kv_heads < 1:
        raise ValueError(f"tp ({tp}) and total_kv_heads ({total_kv_heads}) must be >= 1")
    if tp > MAX_TP:
        raise ValueError(f"tp={tp} is past the largest TP size, {MAX_TP}")
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} out of range for tp={tp}")
    if tp <= total_kv_heads:
        if total_kv_heads % tp:
            raise ValueError(f"tp={tp} does not divide total_kv_heads={total_kv_heads}")
        per = total_kv_heads // tp
        return rank * per, per
    if tp % total_kv_heads:
        raise ValueError(
            f"tp={tp} > total_kv_heads={total_kv_heads} needs tp to be a multiple of it"
        )
    return rank * total_kv_heads // tp, 1


def layout_for(model, tp: int, rank: int, num_blocks: int, block_size: int,
               sub_block: int = 0, head_group: int = 0, layer_split: int = 0) -> KVLayout:
    """This rank's pool layout for a ModelConfig (no weights needed)."""
    total = model.cache_kv_heads
    head_start, kv_heads = rank_heads(tp, rank, total)
    if sub_block and (sub_block < 1 or block_size % sub_block):
        raise ValueError(f"sub_block={sub_block} does not divide block_size={block_size}")
    if head_group and (head_group < 1 or kv_heads % head_group):
        raise ValueError(f"head_group={head_group} does not divide the rank's {kv_heads} KV heads")
    return KVLayout(
        num_blocks=num_blocks, num_layers=model.num_layers, block_size=block_size,
        kv_heads=kv_heads, head_start=head_start, total_kv_heads=total,
        head_dim=model.cache_head_dim, dtype_bytes=model.dtype_bytes,
        window_layers=tuple(sorted(model.window_layers)) if model.sliding_window else (),
        window=model.sliding_window if model.window_layers else 0,
        kv_planes=model.kv_planes,
        sub_block=0 if sub_block == block_size else sub_block,
        head_group=0 if head_group == kv_heads else head_group,
        layer_split=layer_split if layer_split > 1 and not (model.sliding_window and model.window_layers) else 0,
    )


def transfer_geometry(cfg) -> tuple[int, int]:
    """``(sub_block, head_group)`` both sides of a P/D deployment use: the largest sub-block
    and head group that tile both sides' blocks and both sides' per-rank heads, so every
    (P rank, D rank) transfer is whole regions (gcd of the block sizes; gcd of the local
    head counts)."""
    total = cfg.model.cache_kv_heads
    hp = rank_heads(cfg.prefill.tp, 0, total)[1]
    hd = rank_heads(cfg.decode.tp, 0, total)[1]
    return math.gcd(cfg.prefill.block_size, cfg.decode.block_size), math.gcd(hp, hd)


def instance_layout(cfg, inst, rank: int) -> KVLayout:
    """Rank ``rank`` of instance ``inst`` in deployment ``cfg``: cut to match its peer."""
    if cfg.mode == "local" or inst.role == "local":
        return layout_for(cfg.model, inst.tp, rank, inst.num_blocks, inst.block_size)
    sub, hg = transfer_geometry(cfg)
    return layout_for(cfg.model, inst.tp, rank, inst.num_blocks, inst.block_size, sub, hg, transfer_of(cfg).split)


def plan_transfer(cfg) -> TransferPlan:
    """The deployment's transfer plan, decided from its flags, model and block sizes (the planner
    calls this once; every process reads the result, ``transfer_of``).

    A part WRITE starts and ends on a whole block of both sides (the lcm of the two block sizes).
    ``layer`` streams each of ``layer_groups`` as the worker marks it stored, ``chunk`` every group
    at once after each prefill chunk; a model with sliding-window layers falls back to one WRITE at
    prefill end (a window group moves only the blocks of the last window), as does ``chunk`` with
    unchunked prompts."""
    windowed = bool(cfg.model.sliding_window and cfg.model.window_layers)
    direction: Direction = "read" if cfg.mode == "pull" and cfg.pull_read != "write" else "write"
    asked = cfg.push_stream if cfg.mode == "push" else "off"
    split = cfg.push_stream_groups if asked == "layer" and cfg.push_stream_groups > 1 and not windowed else 0
    window_layers = tuple(sorted(cfg.model.window_layers)) if windowed else ()
    groups = len(_groups(cfg.model.num_layers, window_layers, split))
    plan = TransferPlan(split=split, groups=groups, direction=direction)
    if asked == "off":
        return plan
    if windowed:
        return msgspec.structs.replace(plan, fallback="sliding-window layers; one WRITE at prefill end")
    if asked == "chunk" and cfg.prefill.prefill_chunk <= 0:
        return msgspec.structs.replace(
            plan, fallback="--prefill-chunk is 0 (prompts are not chunked); one WRITE at prefill end")
    return msgspec.structs.replace(plan, stream=asked,
                                   unit=math.lcm(cfg.prefill.block_size, cfg.decode.block_size))


def transfer_of(cfg) -> TransferPlan:
    """What the deployment's transfers do: the plan the planner put in the config. A config that
    was never planned (a unit test's, an in-process tool's) gets it decided here, by the same rule."""
    return cfg.transfer if cfg.transfer is not None else plan_transfer(cfg)
