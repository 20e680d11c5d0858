"""Where vLLM keeps a block's KV, and which byte regions one transfer moves.

Pure code: no vLLM, no NIXL, no device. vLLM places every layer's KV for a KV cache
group in one backing allocation; layer ``l`` of block ``b`` starts at
``offset + l * layer_stride + b * block_stride``. :func:`describe` reads each
layer's offset, block stride and the axes of a block's bytes (:class:`LayerRegion`)
from the per-layer views vLLM hands ``register_kv_caches``, in any of vLLM's layouts
(``LAYOUTS``: FlashAttention's ``[2, blocks, block_size, heads, head_size]`` and its
HND stride order, FlashInfer's ``[blocks, 2, ...]``, vLLM 0.32's ``[B, H, N, C]`` pages
(the CPU's too) and MLA's latent pages); :func:`map_blocks` turns (P blocks, D blocks)
into merged (P offset, D offset, nbytes) regions, one descriptor per run that is
contiguous on both sides, for every layer or one layer group (layer streaming).

Where a page has a heads axis, a P rank and a D rank of different TP sizes move the
heads they share (``heads=``), as pushkv's own writers do between their pools: one run
a page when the heads are outermost in it (HND, the CPU's pages), one per token and
K/V otherwise (NHD).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence

import msgspec


class LayerRegion(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One layer's pages inside the backing allocation (bytes from its base).

    ``dims``: a block's bytes in this layer as axes ``(size, byte stride)``, outermost first,
    the innermost contiguous (stride 1); () = one dense page of ``page_bytes``. FlashAttention's
    ``[2, blocks, block_size, heads, head_size]`` keeps K and V of a block ``stride(0)`` apart,
    so its dims start with ``(2, that stride)``. ``head_axis``: the index in ``dims`` of the KV
    heads (-1: none, e.g. MLA's latent pages)."""

    offset: int
    block_stride: int
    page_bytes: int
    head_bytes: int = 0  # one KV head's bytes of the page; 0: heads unknown (whole pages only)
    dims: tuple[tuple[int, int], ...] = ()
    head_axis: int = -1


class KVMemory(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A worker's KV cache as the writer sees it: one region per distinct layer."""

    nbytes: int
    num_blocks: int
    layers: tuple[LayerRegion, ...]
    total_kv_heads: int = 0  # the model's (every rank's together); 0: unknown (same TP only)
    block_tokens: int = 0  # tokens per block (layer streaming moves token spans as blocks); 0: unknown
    dev_id: int = -1  # the CUDA device holding it; -1: host memory

    def same_pages(self, other: "KVMemory") -> bool:
        """P and D must agree on layer count and page size (a block's page
        is copied whole: same block size, heads, head size, dtype and TP slice)."""
        return not self.pages_difference(other)

    def pages_difference(self, other: "KVMemory") -> str:
        """What makes ``other``'s pages unlike this side's, both values named ("" if alike): the
        first of layer count, block size, the model's KV heads, page bytes and page axes."""
        if len(self.layers) != len(other.layers):
            return f"{len(self.layers)} KV layers here, {len(other.layers)} there (not the same model)"
        if self.block_tokens and other.block_tokens and self.block_tokens != other.block_tokens:
            return (f"block size {self.block_tokens} tokens here, {other.block_tokens} there (P and D need the "
                    "same --block-size)")
        if self.total_kv_heads and other.total_kv_heads and self.total_kv_heads != other.total_kv_heads:
            return f"{self.total_kv_heads} KV heads here, {other.total_kv_heads} there (not the same model)"
        for i, (mine, theirs) in enumerate(zip(self.layers, other.layers)):
            if mine.page_bytes != theirs.page_bytes:
                return (f"layer {i}'s page is {mine.page_bytes} bytes here, {theirs.page_bytes} there (block size, "
                        "head size, dtype (--dtype, --kv-cache-dtype) or TP size differ)")
            if _shape(mine) != _shape(theirs):
                return (f"layer {i}'s page axes are {_shape(mine)} here, {_shape(theirs)} there (another "
                        "attention backend's layout)")
        return ""

    def same_heads(self, other: "KVMemory") -> bool:
        """P and D of different TP sizes must agree on the model's heads and on every
        layer's bytes per head (each known): they move heads, not whole pages."""
        mine, theirs = [lr.head_bytes for lr in self.layers], [lr.head_bytes for lr in other.layers]
        return bool(self.total_kv_heads) and self.total_kv_heads == other.total_kv_heads and \
            mine == theirs and all(mine)

    def pairing_problem(self, tp: int, other: "KVMemory", other_tp: int, other_name: str) -> str:
        """Why this rank (of ``tp``) cannot move KV with ``other`` (a rank of ``other_tp``); "" if it can."""
        if tp == other_tp:
            why = self.pages_difference(other)
            if why:
                return f"peer {other_name}'s KV pages differ from this instance's: {why}"
        elif not self.same_heads(other):
            return (f"peer {other_name} has tp={other_tp}, this instance tp={tp}, and their KV heads cannot be "
                    f"paired: {other.total_kv_heads} against {self.total_kv_heads} heads (a different TP size "
                    "needs the heads known in each page)")
        return ""


def _shape(lr: LayerRegion) -> tuple:
    """A page's axes without their strides: two sides whose axes differ lay a page out differently."""
    return tuple(n for n, _ in lr.dims) if lr.dims else ()


# The axis that counts blocks and the one that counts heads, by vLLM's layouts (logical shapes):
LAYOUTS = {
    "flash_attn": (1, 3),  # [2, blocks, block_size, heads, head_size] (NHD; HND by strides)
    "flashinfer": (0, 3),  # [blocks, 2, block_size, heads, head_size] (NHD; HND by strides)
    "pages": (0, 1),  # vLLM 0.32's [B, H, N, C] per-layer views, the CPU's [blocks, heads, block_size, 2*head]
    "mla": (0, -1),  # [blocks, block_size, latent]: one latent page every rank holds alike
}


def layout_of(t, layout: str = "") -> str:
    """Which of ``LAYOUTS`` a view is: ``layout`` if given, else from its shape."""
    if layout:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r} (known: {sorted(LAYOUTS)})")
        return layout
    shape = tuple(t.shape)
    if len(shape) == 5:
        if shape[0] == 2 and shape[1] == 2:
            raise ValueError(f"KV view shaped {shape} is FlashAttention's or FlashInfer's: name the layout")
        if shape[0] == 2:
            return "flash_attn"
        if shape[1] == 2:
            return "flashinfer"
    if len(shape) == 4:
        return "pages"
    if len(shape) == 3:
        return "mla"
    raise ValueError(f"KV view shaped {shape}: not a layout pushkv knows ({sorted(LAYOUTS)})")


def _page_dims(t, block_axis: int, head_axis: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """A block's axes in bytes, outermost first (size-1 axes dropped, the element's bytes the
    innermost axis), and where the heads axis went (-1: none)."""
    elem = t.element_size()
    axes = [(int(t.shape[i]), int(t.stride(i)) * elem, i == head_axis) for i in range(t.dim())
            if i != block_axis and (t.shape[i] > 1 or i == head_axis)]
    axes.append((elem, 1, False))
    axes.sort(key=lambda a: -a[1])
    dims = tuple((n, s) for n, s, _ in axes)
    head = next((i for i, a in enumerate(axes) if a[2]), -1)
    return dims, head


def describe(views: dict, base_addr: int, nbytes: int, kv_heads: int = 0, total_kv_heads: int = 0,
             layout: str = "", block_tokens: int = 0, dev_id: int = -1) -> KVMemory:
    """Describe vLLM's per-layer KV views (torch tensors in one of ``LAYOUTS``, any stride
    order) that live in ``[base_addr, base_addr + nbytes)``. Layers that share a view
    (KV sharing) are listed once, in address order (vLLM's layer order). ``kv_heads``: this
    rank's KV heads; pages with a heads axis of that size can be split by head. Raises
    ValueError for a view outside the allocation or a layout we do not know."""
    seen: dict[int, LayerRegion] = {}
    num_blocks = None
    for name, t in views.items():
        kind = layout_of(t, layout)
        block_axis, head_axis = LAYOUTS[kind]
        start = t.data_ptr() - base_addr
        if start < 0 or start >= nbytes:
            raise ValueError(f"layer {name}: KV view at {t.data_ptr():#x} is outside the shared "
                             f"allocation [{base_addr:#x}, +{nbytes}) (was the allocation hook used?)")
        blocks = int(t.shape[block_axis])
        if num_blocks is not None and blocks != num_blocks:
            raise ValueError(f"layer {name}: {blocks} blocks, other layers have {num_blocks}")
        num_blocks = blocks
        heads_known = head_axis >= 0 and kv_heads > 0 and t.shape[head_axis] == kv_heads
        dims, head = _page_dims(t, block_axis, head_axis if heads_known else -1)
        page = 1
        for n, _ in dims:
            page *= n
        head_bytes = page // kv_heads if heads_known else (page if kind == "mla" and kv_heads == 1 else 0)
        region = LayerRegion(start, int(t.stride(block_axis)) * t.element_size(), page, head_bytes, dims, head)
        last = start + (num_blocks - 1) * region.block_stride + sum((n - 1) * s for n, s in dims)
        if last >= nbytes:
            raise ValueError(f"layer {name}: pages run past the end of the shared allocation")
        seen.setdefault(start, region)
    if not seen:
        raise ValueError("no KV cache layers to register")
    return KVMemory(nbytes, num_blocks or 0, tuple(seen[k] for k in sorted(seen)), total_kv_heads,
                    block_tokens, dev_id)


def layer_index(views: dict, base_addr: int) -> dict[str, int]:
    """Each view's layer index in :func:`describe`'s order (layers sharing a view share it)."""
    starts = sorted({t.data_ptr() - base_addr for t in views.values()})
    where = {s: i for i, s in enumerate(starts)}
    return {name: where[t.data_ptr() - base_addr] for name, t in views.items()}


@lru_cache(maxsize=1024)
def page_runs(lr: LayerRegion, head: int = -1, count: int = 0) -> tuple[tuple[int, int], ...]:
    """The (offset from the block's start, nbytes) runs of one block in this layer, ascending:
    the whole page, or heads ``[head, head + count)`` of it."""
    if not lr.dims:
        if head < 0:
            return ((0, lr.page_bytes),)
        return ((head * lr.head_bytes, count * lr.head_bytes),)
    if head >= 0 and lr.head_axis < 0:  # no heads axis: the one "head" is the whole page (MLA)
        if (head, count) != (0, 1):
            raise ValueError(f"heads [{head}, +{count}) of a page without a heads axis")
        head = -1
    axes = [(0, n, s) for n, s in lr.dims]  # (first index, count, byte stride)
    if head >= 0:
        axes[lr.head_axis] = (head, count, lr.dims[lr.head_axis][1])
    run, start, i = 1, 0, len(axes) - 1  # fold the contiguous innermost axes into one run
    while i >= 0 and axes[i][2] == run:
        first, n, stride = axes[i]
        start += first * stride
        run *= n
        i -= 1
        if n != lr.dims[i + 1][0]:  # a head slice: the axes outside it repeat the run
            break
    return tuple(sorted((o + start, run) for o in _offsets(axes[:i + 1])))


@lru_cache(maxsize=1024)
def _pair_runs(src: tuple[tuple[int, int], ...], dst: tuple[tuple[int, int], ...],
               layer: int) -> tuple[tuple[int, int, int], ...]:
    """The same bytes in order on both sides, cut where either side's run ends (a head slice
    whole on one side and per token on the other): (src offset, dst offset, nbytes)."""
    if sum(n for _, n in src) != sum(n for _, n in dst):
        raise ValueError(f"layer {layer}: P moves {sum(n for _, n in src)} B of a block, D takes "
                         f"{sum(n for _, n in dst)} B")
    out, i, j, si, dj = [], 0, 0, 0, 0  # run indices and bytes used of each
    while i < len(src):
        n = min(src[i][1] - si, dst[j][1] - dj)
        out.append((src[i][0] + si, dst[j][0] + dj, n))
        si, dj = si + n, dj + n
        if si == src[i][1]:
            i, si = i + 1, 0
        if dj == dst[j][1]:
            j, dj = j + 1, 0
    return tuple(out)


def _offsets(axes) -> list[int]:
    out = [0]
    for first, n, s in axes:
        out = [o + (first + k) * s for o in out for k in range(n)]
    return out


def cached_problem(block_tokens: int, num_blocks: int, num_tokens: int, cached_tokens: int) -> str:
    """Why P cannot honour a D registration whose prefix cache holds the prompt's first
    ``cached_tokens`` tokens ("" if it can): they must be whole blocks (D's blocks are P's, same
    size), leave at least one token to WRITE (it carries D's notification), and D's ``num_blocks``
    registered blocks must be exactly the rest of the prompt's (P's WRITEs skip that many)."""
    if not cached_tokens:
        return ""
    if block_tokens <= 0:
        return f"cached_tokens={cached_tokens}, but this KV memory does not say its block size"
    if cached_tokens < 0 or cached_tokens % block_tokens:
        return f"cached_tokens={cached_tokens} is not whole blocks of {block_tokens} tokens"
    if cached_tokens >= num_tokens:
        return f"cached_tokens={cached_tokens} leaves nothing of the {num_tokens}-token prompt to write"
    rest = -(-num_tokens // block_tokens) - cached_tokens // block_tokens
    if num_blocks != rest:
        return (f"{num_blocks} blocks registered for tokens [{cached_tokens}, {num_tokens}), "
                f"which fill {rest} blocks of {block_tokens}")
    return ""


def map_blocks(src: KVMemory, src_blocks: Sequence[int], dst: KVMemory, dst_blocks: Sequence[int],
               heads: Optional[tuple[int, int, int]] = None, layers: Optional[Sequence[int]] = None,
               first_block: int = 0, end_block: Optional[int] = None,
               skip: Optional[int] = None) -> list[tuple[int, int, int]]:
    """(src offset, dst offset, nbytes) regions that copy ``src_blocks[i]`` to
    ``dst_blocks[i]`` in every layer (or in ``layers``), merged where both sides are contiguous.
    ``heads``: ``(src head, dst head, count)``, each side's own head indices: copy
    those heads of each page (P and D of different TP sizes); None: whole pages.
    ``first_block``/``end_block``: only P's blocks ``src_blocks[first_block:end_block]``
    (a layer-streamed part); ``skip``: how many of P's first blocks D does not take (default: the
    lists aligned at their ends, below).

    ``dst_blocks`` may be shorter than ``src_blocks``: D registers only the
    blocks it did not find in its own prefix cache, which are the request's
    last ones, so the lists are aligned at their ends."""
    if heads is None and not src.same_pages(dst):
        raise ValueError("P and D KV pages differ: "
                         f"{[lr.page_bytes for lr in src.layers]} vs {[lr.page_bytes for lr in dst.layers]}")
    if heads is not None and not src.same_heads(dst):
        raise ValueError("P and D KV heads differ (or are not known in the pages): "
                         f"{src.total_kv_heads} heads of {[lr.head_bytes for lr in src.layers]} B vs "
                         f"{dst.total_kv_heads} of {[lr.head_bytes for lr in dst.layers]} B")
    if skip is None:
        if len(dst_blocks) > len(src_blocks):
            raise ValueError(f"D registered {len(dst_blocks)} blocks, P has only {len(src_blocks)}")
        skip = len(src_blocks) - len(dst_blocks)
    end = min(len(src_blocks), skip + len(dst_blocks), len(src_blocks) if end_block is None else end_block)
    lo = max(first_block, skip)
    pairs = [(src_blocks[i], dst_blocks[i - skip]) for i in range(lo, end)]
    for side, mem, k in (("P", src, 0), ("D", dst, 1)):
        bad = [p[k] for p in pairs if not 0 <= p[k] < mem.num_blocks]
        if bad:
            raise ValueError(f"{side} block ids out of range [0, {mem.num_blocks}): {bad[:4]}")
    idx = range(len(src.layers)) if layers is None else layers
    raw: list[tuple[int, int, int]] = []
    for li in idx:
        sl, dl = src.layers[li], dst.layers[li]
        s_runs = page_runs(sl) if heads is None else page_runs(sl, heads[0], heads[2])
        d_runs = page_runs(dl) if heads is None else page_runs(dl, heads[1], heads[2])
        both = _pair_runs(s_runs, d_runs, li)
        for sb, db in pairs:
            s0, d0 = sl.offset + sb * sl.block_stride, dl.offset + db * dl.block_stride
            raw.extend((s0 + so, d0 + do, n) for so, do, n in both)
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
