"""D's ledger of a staged transfer's parts (``--staging pushkv``; pure: numpy, no torch, no NIXL).

With layer streaming P WRITEs a request's KV into D's staging slots as parts, one per layer
group (or chunk), each carrying a ``PartWritten`` notification that NIXL delivers after the
part's data. D copies each part's bytes from its slots into its blocks as soon as every producer
rank's part carrying them has landed, while later parts are still on the wire, so that once the
last WRITE lands only its own bytes are left to copy.

The ledger counts **cells**: one layer group of one of the request's written blocks (the
prompt's blocks past D's cached prefix). A part marks the cells whose tokens it covers whole
(a block an end token cuts is not whole yet, unless it is the prompt's last); a cell is ready
once every producer marked it, and is handed out once (``landed``); ``rest`` hands out every
cell not handed out yet, for the copy after the last WRITE. Bad peer input (an unknown rank, a
group or tokens out of range) changes nothing and is answered with None.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from pushkv.kv import layout as L
from pushkv.messages import KVLayoutDesc
from pushkv.transport.grid import DescGrid
from pushkv.transport.staging_plan import Pairs, block_pairs, group_regions

Cells = list[tuple[int, list[int]]]  # (layer group, indices into the written blocks, ascending)
Span = tuple[int, int, int]  # (layer group, or -1 for every group; first token; end token)


class PartLedger:
    """One staged transfer on one D rank: ``producers`` (P ranks) write ``groups`` layer groups
    of the prompt's ``num_tokens`` tokens, in blocks of ``block_size``, from block
    ``first_block`` on (the cached prefix is never written)."""

    def __init__(self, producers: Sequence[int], groups: int, block_size: int, num_tokens: int,
                 first_block: int = 0):
        if groups < 1 or block_size < 1 or not producers:
            raise ValueError(f"a ledger of {groups} groups, blocks of {block_size}, producers {list(producers)}")
        self.block_size, self.num_tokens, self.first_block = block_size, num_tokens, first_block
        blocks = max(0, L.blocks_for(num_tokens, block_size) - first_block)
        self._rank = {r: i for i, r in enumerate(producers)}
        self._marked = np.zeros((len(producers), groups, blocks), dtype=bool)
        self._out = np.zeros((groups, blocks), dtype=bool)  # handed out (copied, or being copied)

    @property
    def blocks(self) -> int:
        return self._out.shape[1]

    @property
    def cells_out(self) -> int:
        return int(self._out.sum())

    def landed(self, rank: int, spans: Sequence[Span]) -> Optional[Cells]:
        """Producer ``rank``'s part carrying ``spans`` landed: the cells every producer has now
        written and none handed out yet (they are handed out now), or None for a part that
        cannot be one of ours (nothing changes)."""
        i = self._rank.get(rank)
        groups = self._out.shape[0]
        if i is None or not spans:
            return None
        marks: list[tuple[slice, int, int]] = []
        for g, t0, t1 in spans:
            if not -1 <= g < groups or not 0 <= t0 <= t1 <= self.num_tokens:
                return None
            bs = self.block_size
            b0 = -(-t0 // bs) - self.first_block  # the first block the part starts at its start
            b1 = (t1 // bs if t1 < self.num_tokens else L.blocks_for(t1, bs)) - self.first_block
            marks.append((slice(None) if g < 0 else slice(g, g + 1), max(0, b0), max(0, min(self.blocks, b1))))
        for rows, b0, b1 in marks:
            if b0 < b1:
                self._marked[i, rows, b0:b1] = True
        return self._hand_out(self._marked.all(axis=0) & ~self._out)

    def rest(self) -> Cells:
        """Every cell not handed out yet (now handed out): what the copy after the last WRITE moves."""
        return self._hand_out(~self._out)

    def _hand_out(self, ready: np.ndarray) -> Cells:
        self._out |= ready
        return [(g, np.flatnonzero(ready[g]).tolist()) for g in range(ready.shape[0]) if ready[g].any()]


def cell_pairs(lay: KVLayoutDesc, pool: DescGrid, area: DescGrid, blocks: Sequence[int], slots: Sequence[int],
               cells: Cells) -> Pairs:
    """The copies of ``cells`` between the written ``blocks`` (the pool's) and their ``slots`` (the
    area's, pairwise): each cell's layer group's regions, one copy per run contiguous on both sides."""
    out: Pairs = []
    for g, idx in cells:
        out += block_pairs(lay, pool, area, [blocks[i] for i in idx], [slots[i] for i in idx],
                           group_regions(lay, [g]))
    return out
