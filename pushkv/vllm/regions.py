"""Where vLLM keeps a block's KV, and which byte regions one transfer moves.

Pure code: no vLLM, no NIXL. vLLM 0.32 places every layer's KV for a KV cache
group in one backing allocation; layer ``l`` of block ``b`` starts at
``offset + l * layer_stride + b * block_stride`` and, for the attention
backends we accept, is one dense page of ``page_bytes``. :func:`describe`
reads that from the per-layer views vLLM hands ``register_kv_caches``;
:func:`map_blocks` turns (P blocks, D blocks) into merged
(P offset, D offset, nbytes) regions, one descriptor per run that is
contiguous on both sides.

Where the page's outermost axis is the KV heads (the CPU backend's
``[heads, block_size, 2 * head_size]``), each head is ``head_bytes`` of the
page: a P rank and a D rank of different TP sizes then move the heads they
share (``heads=``), as pushkv's own writers do between their pools.
"""
from __future__ import annotations

from typing import Optional, Sequence

import msgspec

from pushkv.protocol.tp import page_heads


class LayerRegion(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One layer's pages inside the backing allocation (bytes from its base)."""

    offset: int
    block_stride: int
    page_bytes: int
    head_bytes: int = 0  # one KV head's bytes when heads are the page's outermost axis; 0: unknown


class KVMemory(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A worker's KV cache as the writer sees it: one region per distinct layer."""

    nbytes: int
    num_blocks: int
    layers: tuple[LayerRegion, ...]
    total_kv_heads: int = 0  # the model's (every rank's together); 0: unknown (same TP only)

    def same_pages(self, other: "KVMemory") -> bool:
        """P and D must agree on layer count and page size (a block's page
        is copied whole: same block size, heads, head size, dtype and TP slice)."""
        return [lr.page_bytes for lr in self.layers] == [lr.page_bytes for lr in other.layers]

    def same_heads(self, other: "KVMemory") -> bool:
        """P and D of different TP sizes must agree on the model's heads and on every
        layer's bytes per head (each known): they move heads, not whole pages."""
        mine, theirs = [lr.head_bytes for lr in self.layers], [lr.head_bytes for lr in other.layers]
        return bool(self.total_kv_heads) and self.total_kv_heads == other.total_kv_heads and \
            mine == theirs and all(mine)

    def pairing_problem(self, tp: int, other: "KVMemory", other_tp: int, other_name: str) -> str:
        """Why this rank (of ``tp``) cannot move KV with ``other`` (a rank of ``other_tp``); "" if it can."""
        if tp == other_tp:
            if not self.same_pages(other):
                return f"peer {other_name} KV pages differ (block size, heads, dtype or layers)"
        elif not self.same_heads(other):
            return (f"peer {other_name} has tp={other_tp}, this instance tp={tp}, and their KV heads cannot be "
                    f"paired: {other.total_kv_heads} against {self.total_kv_heads} heads (a different TP size "
                    "needs the heads known and outermost in each page)")
        return ""


def describe(views: dict, base_addr: int, nbytes: int, kv_heads: int = 0, total_kv_heads: int = 0) -> KVMemory:
    """Describe vLLM's per-layer KV views (torch tensors, block dim first)
    that live in ``[base_addr, base_addr + nbytes)``. Layers that share a view
    (KV sharing) are listed once. ``kv_heads``: this rank's KV heads; a page whose
    outermost axis has that size is split by head. Raises ValueError for a layout
    we cannot move as whole pages."""
    seen: dict[int, LayerRegion] = {}
    num_blocks = None
    for name, t in views.items():
        elem = t.element_size()
        start = t.data_ptr() - base_addr
        if start < 0 or start >= nbytes:
            raise ValueError(f"layer {name}: KV view at {t.data_ptr():#x} is outside the shared "
                             f"allocation [{base_addr:#x}, +{nbytes}) (was the allocation hook used?)")
        if t.dim() < 2 or not t[0].is_contiguous():
            raise ValueError(f"layer {name}: a block's page is not contiguous (shape {tuple(t.shape)}, "
                             f"stride {t.stride()}); only dense-page layouts are supported")
        if num_blocks is not None and t.shape[0] != num_blocks:
            raise ValueError(f"layer {name}: {t.shape[0]} blocks, other layers have {num_blocks}")
        num_blocks = t.shape[0]
        page = t[0].numel() * elem
        head_bytes = page // kv_heads if kv_heads and t.dim() > 2 and t.shape[1] == kv_heads else 0
        region = LayerRegion(start, t.stride(0) * elem, page, head_bytes)
        if start + (num_blocks - 1) * region.block_stride + region.page_bytes > nbytes:
            raise ValueError(f"layer {name}: pages run past the end of the shared allocation")
        seen.setdefault(start, region)
    if not seen:
        raise ValueError("no KV cache layers to register")
    return KVMemory(nbytes, num_blocks or 0, tuple(seen[k] for k in sorted(seen)), total_kv_heads)


def map_blocks(src: KVMemory, src_blocks: Sequence[int], dst: KVMemory, dst_blocks: Sequence[int],
               heads: Optional[tuple[int, int, int]] = None) -> list[tuple[int, int, int]]:
    """(src offset, dst offset, nbytes) regions that copy ``src_blocks[i]`` to
    ``dst_blocks[i]`` in every layer, merged where both sides are contiguous.
    ``heads``: ``(src head, dst head, count)``, each side's own head indices: copy
    those heads of each page (P and D of different TP sizes); None: whole pages.

    ``dst_blocks`` may be shorter than ``src_blocks``: D registers only the
    blocks it did not find in its own prefix cache, which are the request's
    last ones, so the lists are aligned at their ends."""
    if heads is None and not src.same_pages(dst):
        raise ValueError("P and D KV pages differ: "
                         f"{[lr.page_bytes for lr in src.layers]} vs {[lr.page_bytes for lr in dst.layers]}")
    if heads is not None and not src.same_heads(dst):
        raise ValueError("P and D KV heads differ (or are not the pages' outermost axis): "
                         f"{src.total_kv_heads} heads of {[lr.head_bytes for lr in src.layers]} B vs "
                         f"{dst.total_kv_heads} of {[lr.head_bytes for lr in dst.layers]} B")
    if len(dst_blocks) > len(src_blocks):
        raise ValueError(f"D registered {len(dst_blocks)} blocks, P has only {len(src_blocks)}")
    src_blocks = list(src_blocks)[len(src_blocks) - len(dst_blocks):]
    for side, mem, blocks in (("P", src, src_blocks), ("D", dst, dst_blocks)):
        bad = [b for b in blocks if not 0 <= b < mem.num_blocks]
        if bad:
            raise ValueError(f"{side} block ids out of range [0, {mem.num_blocks}): {bad[:4]}")
    raw = []
    for sl, dl in zip(src.layers, dst.layers):
        s0, d0, n = (0, 0, sl.page_bytes) if heads is None else \
            (heads[0] * sl.head_bytes, heads[1] * dl.head_bytes, heads[2] * sl.head_bytes)
        for sb, db in zip(src_blocks, dst_blocks):
            raw.append((sl.offset + sb * sl.block_stride + s0, dl.offset + db * dl.block_stride + d0, n))
    raw.sort()
    merged: list[tuple[int, int, int]] = []
    for s, d, n in raw:
        if merged:
            ps, pd, pn = merged[-1]
            if ps + pn == s and pd + pn == d:
                merged[-1] = (ps, pd, pn + n)
                continue
        merged.append((s, d, n))
    return merged


def write_regions(kv: KVMemory, rank: int, tp: int, total_kv_heads: int, block_ids: Sequence[int]):
    """P rank ``rank`` (of ``tp``) writing its ``block_ids``: the regions into one registered D rank,
    ``of(reg, peer)`` (None: that rank holds no head of ours)."""

    def of(reg, peer):
        heads = page_heads(rank, tp, reg.d_rank, reg.d_tp, total_kv_heads)
        return None if heads is False else map_blocks(kv, block_ids, peer.layout, reg.block_ids, heads)

    return of
