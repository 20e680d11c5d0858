"""pushkv's own staging of a GPU pool through pinned host memory (``--staging pushkv``).

UCX over TCP cannot reach GPU memory: its ``cuda_copy`` lane stages each fragment of a WRITE
through host memory inside its progress calls, one small synchronous copy at a time, on both
sides. On a GPU busy with prefill or decode kernels each of those copies waits for the GPU
(measured on an H200: a WRITE took 0.8-1.1 s while D decoded against 0.3 s idle, and D's
writer loop was held meanwhile, so D saw the bytes 0.5-0.9 s late).

Here each writer keeps a **staging area**: pinned host memory laid out as its pool but with
fewer blocks (``--staging-mib``), its blocks ("slots") handed out per layer group or whole
(``transport/stage_slots.py``). NIXL registers the area instead of the pool (as host memory), so
every transfer moves host to host and the protocol, grids and mapping are those of a pool of that
many blocks:
- P's area is cut per layer group: a WRITE takes cells (one layer group of one slot) only in the
  layer groups it carries (a layer-streamed part, its own group's). P copies each WRITE's cells
  from the pool into its area on a copy stream, as soon as the WRITE is planned, and posts it from
  them once its loop sees the copy done (``Copying``); the cells go back when the WRITE ends;
- D registers whole slots of its area with P instead of its pool's blocks (one list for every
  layer group, as the Register carries), and copies them into its
  blocks on its copy stream as they land: each layer group (or chunk) a part carried once every
  producer rank's part has landed (its ``PartWritten`` notification, which NIXL delivers after
  the part's data), and the rest once every producer's last WRITE has; it reports the KV
  received (and frees the slots) when that last copy is done (``writer/stage_in.py``).
Both loops poll the copies' events; neither waits on them.

A transfer waits for cells when the area is full (P: before its link queue; D: before its
registration), in one first-come queue per area (``SlotQueue``), and one larger than the whole
area fails at once, saying so. Which bytes are copied is pure (``transport/staging_plan.py``,
``transport/staged_parts.py``).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Generic, Iterator, TypeVar

import msgspec

from pushkv.kv import layout as L
from pushkv.messages import KVLayoutDesc
from pushkv.transport.grid import grid_of
from pushkv.transport.stage_slots import AreaSlots, CellCopy, SlotQueue
from pushkv.transport.staged_parts import Cells, cell_pairs
from pushkv.transport.staging_plan import Pairs, block_pairs, group_regions

log = logging.getLogger(__name__)


class StagingArea:
    """A pinned host area of ``blocks`` blocks of the pool's layout, its cells (``slots``: cut per
    layer group, P's, or whole, D's) with the queue of transfers waiting for them (``queue``: each
    side's waits), and a copy stream between it and the pool (a host pool's area copies at once:
    the CPU path CI runs)."""

    def __init__(self, pool_tensor: Any, device: str, pool_layout: KVLayoutDesc, blocks: int, cut: bool = False):
        import torch

        self._torch = torch
        self.pool_layout = pool_layout
        self.layout = msgspec.structs.replace(pool_layout, num_blocks=blocks)
        self.pool_grid, self.grid = grid_of(pool_layout), grid_of(self.layout)
        self.gpu = pool_tensor.reshape(-1).view(torch.uint8)  # the pool's bytes (it is contiguous)
        on_gpu = device != "cpu"
        self.host = torch.empty(L.pool_bytes(self.layout), dtype=torch.uint8, pin_memory=on_gpu)
        self.stream = torch.cuda.Stream(device=torch.device(device)) if on_gpu else None
        self.base_addr = self.host.data_ptr()
        self.nbytes = self.host.numel()
        self.hold_s = 0.0  # tests (faults.py's hold): each copy out reported running this long after its issue
        self.slots = AreaSlots(blocks, len(L.layer_groups(self.layout)), cut)
        self.queue: SlotQueue[Any] = SlotQueue(self.slots)
        self.copies = 0

    @property
    def blocks(self) -> int:
        return self.layout.num_blocks

    # -- copies -----------------------------------------------------------------------
    def pairs(self, blocks, slots, groups=None) -> Pairs:
        regions = None if groups is None else group_regions(self.layout, groups)
        return block_pairs(self.layout, self.pool_grid, self.grid, blocks, slots, regions)

    def copies_pairs(self, copies: list[CellCopy]) -> Pairs:
        """The copies a placed WRITE's cells need (``stage_slots.Placement.place``)."""
        return [p for blocks, slots, groups in copies for p in self.pairs(blocks, slots, groups)]

    def cell_pairs(self, blocks, slots, cells: Cells) -> Pairs:
        """The copies of some layer groups of some blocks (``transport/staged_parts.py``)."""
        return cell_pairs(self.layout, self.pool_grid, self.grid, blocks, slots, cells)

    def copy_out(self, pairs: Pairs) -> Any:
        """Start copying pool bytes into the area; returns the copy's ``Copy`` (None: done)."""
        copy = self._copy(pairs, to_host=True)
        return HeldCopy(copy, time.monotonic() + self.hold_s) if self.hold_s else copy

    def copy_in(self, pairs: Pairs) -> Any:
        """Start copying area bytes into the pool; returns the copy's ``Copy`` (None: done)."""
        return self._copy(pairs, to_host=False)

    def _copy(self, pairs: Pairs, to_host: bool) -> Any:
        torch = self._torch
        self.copies += len(pairs)
        if self.stream is None:
            self._copy_pairs(pairs, to_host)
            return None
        with torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            self._copy_pairs(pairs, to_host)
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
        return Copy(start, end)

    def _copy_pairs(self, pairs: Pairs, to_host: bool) -> None:
        """Each (pool offset, area offset, bytes) copied, on the current stream (a host pool's: at once)."""
        non_blocking = self.stream is not None
        for po, so, n in pairs:
            pool, area = self.gpu[po:po + n], self.host[so:so + n]
            dst, src = (area, pool) if to_host else (pool, area)
            dst.copy_(src, non_blocking=non_blocking)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # no copy may outlive the memory it reads or writes
        self.host = self.gpu = None  # type: ignore[assignment]


class Copy:
    """One ``_copy``'s pair of CUDA events on the copy stream: ``end`` is what ``done``/``wait``
    ask; with ``start`` it gives the copy's time on the device once done (``device_s``), which
    against the wall time the loop saw it done says when the GPU began it (a copy issued from
    the writer's CUDA context may wait for the worker's kernels before it runs)."""

    __slots__ = ("start", "end")

    def __init__(self, start: Any, end: Any):
        self.start, self.end = start, end

    def query(self) -> bool:
        return bool(self.end.query())

    def synchronize(self) -> None:
        self.end.synchronize()

    def device_s(self) -> float:
        """Seconds between the copy's start and end on the device (only once it is done)."""
        return float(self.start.elapsed_time(self.end)) / 1e3


class HeldCopy:
    """A copy reported running until ``until`` (monotonic seconds) whatever the device says
    (``StagingArea.hold_s``: the fault ``hold-<process>-stage_out`` of ``faults.py``), so that a host
    area's copy, done when issued, keeps its WRITE waiting as a GPU's copy stream would."""

    __slots__ = ("inner", "until")

    def __init__(self, inner: Any, until: float):
        self.inner, self.until = inner, until

    def query(self) -> bool:
        return done(self.inner) and time.monotonic() >= self.until

    def synchronize(self) -> None:
        wait(self.inner)
        time.sleep(max(0.0, self.until - time.monotonic()))


def device_s(event: Any) -> float:
    """A finished copy's time on the device (0: a host area's copy, done at once)."""
    return event.device_s() if isinstance(event, Copy) else 0.0


T = TypeVar("T")


class Copying(Generic[T]):
    """What waits for its copy (a P WRITE for its bytes to be in the area), in the order the
    copies were issued on the one copy stream; the loop takes what is ready each turn and never
    waits on a copy."""

    def __init__(self) -> None:
        self._q: deque[tuple[T, Any]] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[T]:
        return (item for item, _ in self._q)

    def add(self, item: T, copy: Any) -> None:
        self._q.append((item, copy))

    def ready(self) -> Iterator[T]:
        """The items whose copy is done, in issue order, up to the first still running (a later
        one never overtakes it: on one stream it cannot end first, and the order is the link's)."""
        while self._q and done(self._q[0][1]):
            yield self._q.popleft()[0]


def done(event: Any) -> bool:
    """Whether a copy ``copy_out``/``copy_in`` started has finished (never blocks)."""
    return event is None or bool(event.query())


def wait(event: Any) -> None:
    """Block until a copy has finished (P's post path: the WRITE must not read a half copy)."""
    if event is not None:
        event.synchronize()
