"""A staging area's slots, and which of them a staged WRITE takes (pure: no torch, no NIXL).

A writer's staging area (``writer/staging.py``) is laid out as its pool, so its slot ``s`` holds one
block's bytes in the regions of every layer group. A **cell** is one layer group of one slot. How
an area hands its cells out depends on who fills them:

- **cut** (P's area): each layer group's cells have their own allocator over the area's slot
  indices, so a WRITE takes cells only in the layer groups it carries. A layer-streamed part of one
  group takes that group's cells for its blocks, not its blocks in every group (which left
  (groups - 1)/groups of what it took empty); a whole WRITE, or a chunk's part, still takes every
  group's. A block's cells in two groups may then sit in different slots: a span that carries
  several groups is split into one span per group, each from its own slots.
- **whole** (D's area): one allocator, each slot taken in every group. D names its slots to P in
  its ``Register`` as one block list for every layer group (the protocol's), and it needs all of
  them from its registration until the last copy into its blocks, so cutting would buy it nothing.

``Placement`` says what a WRITE needs (per cut, the distinct blocks it carries there) and, once
``AreaSlots`` granted it, its spans over the slots and the copies that fill them. ``SlotQueue`` is
the one queue of waits for an area's cells, P's posts and D's registrations alike.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Generic, Optional, Sequence, TypeVar, Union

from pushkv.protocol.allocator import BlockAllocator

Grant = list[list[int]]  # per cut: the slots taken in it
# A WRITE's span: (pool blocks, the peer's blocks, tokens, layer groups; None: every group)
Span = tuple[Sequence[int], Sequence[int], int, Optional[tuple[int, ...]]]
CellCopy = tuple[list[int], list[int], tuple[int, ...]]  # (pool blocks, their slots, layer groups)


class AreaSlots:
    """The cells of an area of ``blocks`` slots in ``groups`` layer groups, cut per group or whole."""

    def __init__(self, blocks: int, groups: int, cut: bool):
        if groups < 1:
            raise ValueError(f"an area of {groups} layer groups")
        self.groups, self.cut = groups, cut
        self.parts = [BlockAllocator(blocks) for _ in range(groups if cut else 1)]
        self.peak_cells = 0  # the most cells in use at once

    @property
    def num_blocks(self) -> int:
        return self.parts[0].num_blocks

    @property
    def num_cells(self) -> int:
        return self.num_blocks * self.groups

    @property
    def free_cells(self) -> int:
        return sum(a.num_free for a in self.parts) * (1 if self.cut else self.groups)

    @property
    def num_free(self) -> int:
        """Slots free in every layer group: the room a whole WRITE has now."""
        return min(a.num_free for a in self.parts)

    def cut_of(self, group: int) -> int:
        return group if self.cut else 0

    def allocate(self, need: Sequence[int]) -> Optional[Grant]:
        """``need[c]`` slots in each cut ``c``, all or none (None: one cut has too few free)."""
        self._check_need(need)
        if any(n > a.num_free for n, a in zip(need, self.parts)):
            return None
        grant = [a.allocate(n) or [] for n, a in zip(need, self.parts)]
        self.peak_cells = max(self.peak_cells, self.num_cells - self.free_cells)
        return grant

    def free(self, grant: Grant) -> None:
        """Give a grant back (ValueError for one that is not ours, and nothing changes)."""
        if len(grant) != len(self.parts):
            raise ValueError(f"a grant of {len(grant)} cuts for an area of {len(self.parts)}")
        for slots, a in zip(grant, self.parts):  # (checked first: BlockAllocator.free changes nothing on error)
            if len(set(slots)) != len(slots) or any(not 0 <= s < a.num_blocks for s in slots):
                raise ValueError(f"free: slots {slots} are not a grant of an area of {a.num_blocks}")
        for slots, a in zip(grant, self.parts):
            a.free(slots)

    def fits(self, need: Sequence[int]) -> bool:
        """Whether the whole area could ever meet ``need``."""
        return len(need) == len(self.parts) and all(0 <= n <= self.num_blocks for n in need)

    def _check_need(self, need: Sequence[int]) -> None:
        if not self.fits(need):
            raise ValueError(f"a wait for {list(need)} slots in an area of {self.num_blocks} "
                             f"({len(self.parts)} cuts)")

    def check(self) -> None:
        for a in self.parts:
            a.check()


@dataclass(frozen=True)
class Placement:
    """What a staged WRITE of ``spans`` takes in an area (``need``: slots per cut) and, granted,
    where its bytes go (``place``)."""

    spans: tuple[Span, ...]
    groups: int
    cut: bool
    carried: tuple[tuple[int, ...], ...]  # per layer group: the distinct pool blocks the spans carry there

    @property
    def need(self) -> list[int]:
        if self.cut:
            return [len(b) for b in self.carried]
        return [len(_union(self.carried))]

    @property
    def cells(self) -> int:
        """The cells it fills (one per layer group of each block it carries there)."""
        return sum(len(b) for b in self.carried)

    @property
    def cells_taken(self) -> int:
        """The cells it takes: what it fills when cut, every group of each block when whole."""
        return self.cells if self.cut else self.need[0] * self.groups

    def place(self, grant: Grant) -> tuple[list[Span], list[CellCopy]]:
        """The spans with their pool blocks replaced by the granted slots, and the copies of the
        pool blocks into those slots, one per layer group (each cell copied once)."""
        if [len(s) for s in grant] != self.need:
            raise ValueError(f"a grant of {[len(s) for s in grant]} slots for a need of {self.need}")
        slot_of: list[dict[int, int]] = []
        if self.cut:
            slot_of = [dict(zip(b, s)) for b, s in zip(self.carried, grant)]
        else:
            whole = dict(zip(_union(self.carried), grant[0]))
            slot_of = [whole] * self.groups
        spans: list[Span] = []
        for blocks, dst, n, gs in self.spans:
            if not self.cut:
                spans.append(([whole[b] for b in blocks], dst, n, gs))
                continue
            for g in range(self.groups) if gs is None else gs:
                spans.append(([slot_of[g][b] for b in blocks], dst, n, (g,)))
        copies: list[CellCopy] = [(list(b), [slot_of[g][x] for x in b], (g,))
                              for g, b in enumerate(self.carried) if b]
        return spans, copies


def placement(spans: Sequence[Span], block_size: int, groups: int, cut: bool) -> Placement:
    """Where a WRITE's ``spans`` need cells: each span's blocks (those its tokens reach) in the
    layer groups it carries. ValueError for a layer group the area does not have."""
    carried: list[dict[int, None]] = [{} for _ in range(groups)]
    out: list[Span] = []
    for blocks, dst, n, gs in spans:
        if gs is not None and any(not 0 <= g < groups for g in gs):
            raise ValueError(f"a span of layer groups {gs} in an area of {groups}")
        blocks = list(blocks[:-(-n // block_size)])
        for g in range(groups) if gs is None else gs:
            carried[g].update(dict.fromkeys(blocks))
        out.append((blocks, dst, n, gs))
    return Placement(tuple(out), groups, cut, tuple(tuple(c) for c in carried))


def _union(per_group: Sequence[Sequence[int]]) -> list[int]:
    return list(dict.fromkeys(b for blocks in per_group for b in blocks))


W = TypeVar("W")
Need = Union[int, Sequence[int]]


class SlotQueue(Generic[W]):
    """Waits for an area's cells, served in arrival order: the first wait takes its ``need`` once
    every cut has that much free, and no later wait overtakes it (a large transfer is never starved
    by small ones). A wait is whatever its side carries (P: a post to make; D: a registration to
    send); the queue only counts slots. ``waits`` counts the asks that could not be granted at once."""

    def __init__(self, slots: AreaSlots):
        self.slots = slots
        self._waits: deque[tuple[W, list[int]]] = deque()
        self.waits = 0

    def __len__(self) -> int:
        return len(self._waits)

    def __contains__(self, wait: object) -> bool:
        return any(w is wait for w, _ in self._waits)

    def ask(self, wait: W, need: Need) -> None:
        """Queue ``wait`` for ``need`` slots per cut (an int: that many in every cut). ValueError
        for a need the whole area cannot meet (it would wait forever): the side says what to raise."""
        per_cut = [need] * len(self.slots.parts) if isinstance(need, int) else list(need)
        if not self.slots.fits(per_cut):
            raise ValueError(f"a wait for {need} slots in an area of {self.slots.num_blocks}")
        if self._waits or any(n > a.num_free for n, a in zip(per_cut, self.slots.parts)):
            self.waits += 1
        self._waits.append((wait, per_cut))

    def grant(self) -> Optional[tuple[W, Grant]]:
        """The first wait with its slots, taken now; None while it does not fit (or none waits)."""
        if not self._waits:
            return None
        got = self.slots.allocate(self._waits[0][1])
        if got is None:
            return None
        return self._waits.popleft()[0], got

    def give_back(self, grant: Grant) -> None:
        self.slots.free(grant)

    def drop(self, which: Callable[[W], bool]) -> list[W]:
        """Remove (and return, in order) the waits ``which`` picks: cancelled, expired."""
        gone = [w for w, _ in self._waits if which(w)]
        if gone:
            self._waits = deque((w, n) for w, n in self._waits if not which(w))
        return gone
