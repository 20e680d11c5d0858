"""Layer streaming for the vLLM connector (imports no vLLM).

The worker cuts its KV layers into ``groups`` runs of consecutive layers (``kv.layout.split_layers``,
the same cut pushkv's own pools use). :class:`LayerMarks` (worker side) sees each layer's
``save_kv_layer``; after a group's last layer it records a completion (an inter-process CUDA event
on the GPU; nothing on the CPU, where the store is done when the layer returns) and sends one
``LayersStored`` per streaming request of the step to its writer. :class:`MarkWaiter` (writer side)
waits for each event in order off the writer's loop and hands the marks to it through an eventfd;
the writer feeds them to pushkv's rendezvous (``on_prefill_progress``), which posts part WRITEs of
whole blocks per group while later layers compute. :func:`write_regions` turns a part's or the last
WRITE's ``(group, first token, end token)`` spans into byte regions. D learns of the last part as
without streaming: the last WRITE's notification.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from typing import Callable, Optional, Sequence, Union

from pushkv.kv.layout import split_layers
from pushkv.protocol.actions import PostWrite
from pushkv.protocol.tp import page_heads
from pushkv.vllm import wire as w
from pushkv.vllm.regions import KVMemory, map_blocks

log = logging.getLogger(__name__)


def groups_of(num_layers: int, groups: int) -> tuple[tuple[int, ...], ...]:
    return split_layers(num_layers, max(1, groups))


def write_regions(src: KVMemory, a: PostWrite, dst: KVMemory, dst_blocks: Sequence[int], reg_tokens: int,
                  heads, groups: tuple[tuple[int, ...], ...]) -> list[tuple[int, int, int]]:
    """(P offset, D offset, nbytes) of one WRITE: every layer of every block, or its spans' layer
    groups and blocks. D's blocks are the prompt's last ones (``reg_tokens`` long on D's side)."""
    if not a.spans and a.token_start == 0 and a.last:
        return map_blocks(src, a.block_ids, dst, dst_blocks, heads)
    bt = src.block_tokens
    if bt <= 0:
        raise ValueError("a streamed WRITE needs the block size in tokens (KVMemory.block_tokens)")
    skip = -(-reg_tokens // bt) - len(dst_blocks)
    spans = a.spans or ((-1, a.token_start, a.token_start + a.num_tokens),)
    out: list[tuple[int, int, int]] = []
    for g, t0, t1 in spans:
        out += map_blocks(src, a.block_ids, dst, dst_blocks, heads, None if g < 0 else groups[g],
                          t0 // bt, -(-t1 // bt), skip=skip)
    return out


def regions_of(kv: KVMemory, a: PostWrite, rank: int, tp: int, total_kv_heads: int,
               groups: tuple[tuple[int, ...], ...]) -> Callable:
    """P rank ``rank`` (of ``tp``) posting ``a``: its regions into one registered D rank,
    ``of(reg, peer)`` (None: that rank holds no head of ours, or a part has nothing for it: its
    blocks are in D's own prefix cache, which D did not register; NIXL refuses an empty post)."""

    def of(reg, peer):
        heads = page_heads(rank, tp, reg.d_rank, reg.d_tp, total_kv_heads)
        if heads is False:
            return None
        regions = write_regions(kv, a, peer.layout, reg.block_ids, reg.num_tokens, heads, groups)
        return regions if regions or a.last else None

    return of


def event_opener(dev_id: int) -> Optional[Callable[[bytes], object]]:
    """How a writer on CUDA device ``dev_id`` opens a mark's event handle (None: host memory)."""
    if dev_id < 0:
        return None
    from pushkv.vllm.cuda_kv import open_event

    return lambda handle: open_event(dev_id, handle)


class LayerMarks:
    """Worker side: which layer ends a group, and the marks to send when it is saved."""

    def __init__(self, layer_index: dict[str, int], groups: int, send: Callable[[w.LayersStored], None],
                 record: Optional[Callable[[], bytes]] = None):
        n = 1 + max(layer_index.values(), default=-1)
        self.groups = groups_of(n, groups)
        last = {g[-1]: i for i, g in enumerate(self.groups)}
        self.ends = {name: last[i] for name, i in layer_index.items() if i in last}
        self.send, self.record = send, record
        self.streams: dict[str, tuple[str, list[int], int]] = {}  # this step's: req id -> (tid, blocks, tokens)

    def step(self, streams: dict[str, tuple[str, list[int], int]]) -> None:
        self.streams = streams

    def saved(self, layer_name: str) -> None:
        g = self.ends.get(layer_name)
        if g is None or not self.streams:
            return
        event = self.record() if self.record is not None else b""
        for rid, (tid, blocks, tokens) in self.streams.items():
            self.send(w.LayersStored(rid, tid, g, tuple(blocks), tokens, event))


Ordered = Union[w.LayersStored, w.StreamPreempted]


class MarkWaiter:
    """Writer side: waits for each mark's event in order on a thread; the loop reads the marks
    whose event completed (``fd`` turns readable) with :meth:`ready`. A mark without an event
    (the CPU), or a ``StreamPreempted``, is ready once every mark submitted before it is (at once
    while no event is waited for). A wait that fails yields the mark with the reason."""

    def __init__(self, open_event: Optional[Callable[[bytes], object]] = None):
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._open = open_event
        self._events: dict[bytes, object] = {}
        self._q: "queue.SimpleQueue[Optional[Ordered]]" = queue.SimpleQueue()
        self._done: deque[tuple[Ordered, str]] = deque()
        self._thread: Optional[threading.Thread] = None

    def submit(self, mark: Ordered) -> None:
        event = getattr(mark, "event", b"")
        if self._thread is None and not event:  # nothing waited for: in order now
            self._finish(mark, "")
            return
        if event and self._open is None:
            self._finish(mark, "a CUDA event for a writer of host memory")
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pushkv-mark-waiter", daemon=True)
            self._thread.start()
        self._q.put(mark)  # behind the marks still waited for

    def _run(self) -> None:
        while True:
            mark = self._q.get()
            if mark is None:
                return
            why = ""
            if not getattr(mark, "event", b""):
                self._finish(mark, why)
                continue
            try:
                assert isinstance(mark, w.LayersStored)
                ev = self._events.get(mark.event)
                if ev is None:
                    ev = self._events[mark.event] = self._open(mark.event)  # type: ignore[misc]
                ev.synchronize()  # type: ignore[attr-defined]
            except Exception as e:  # a bad handle, a dead context: the stream fails, with why
                why = f"layer group {getattr(mark, 'group', -1)}'s completion event failed: {e}"
            self._finish(mark, why)

    def _finish(self, mark: Ordered, why: str) -> None:
        self._done.append((mark, why))
        os.eventfd_write(self.fd, 1)

    def ready(self) -> list[tuple[Ordered, str]]:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(5.0)
        os.close(self.fd)
