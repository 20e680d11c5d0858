"""Layer-group completion marks that cross processes: the worker records, the writer waits.

One copy for pushkv's workers (``pushkv/worker/marks.py``) and vLLM's (``pushkv/vllm/stream.py``).
On a GPU the worker records an inter-process CUDA event once a layer group has queued its K/V
stores (:class:`EventRing`) and sends its handle at once: the worker never waits for the device,
and no thread of the worker (one that waited saw a 16k prefill's marks only at the step's end)
stands between the device finishing the group and the writer hearing of it. The writer
opens each handle once (:func:`open_event`) and waits for the marks in order on its own thread
(:class:`MarkWaiter`), handing the completed ones to its loop through an eventfd. On the CPU a mark
carries no event: the store is done when the layer returns, so it is ready at once.
"""
from __future__ import annotations

import os
import queue
import threading
from collections import deque
from typing import Any, Callable, Optional

EVENT_RING = 64  # events reused in turn: re-recording one only moves its wait later, never earlier


class EventRing:
    """Worker side: inter-process events recorded in turn on the current stream."""

    def __init__(self, device, size: int = EVENT_RING):
        import torch

        with torch.cuda.device(device):
            self.events = [torch.cuda.Event(interprocess=True) for _ in range(size)]
            for e in self.events:
                e.record()  # created now, on this device, not in the forward
            self.handles = [bytes(e.ipc_handle()) for e in self.events]
        self.i = 0

    def record(self) -> bytes:
        """Record the next event after what the current stream has queued; its handle."""
        i, self.i = self.i, (self.i + 1) % len(self.events)
        self.events[i].record()
        return self.handles[i]


def open_event(dev_id: int, handle: bytes):
    import torch

    return torch.cuda.Event.from_ipc_handle(torch.device("cuda", dev_id), handle)


def device_index(device: str) -> int:
    """The CUDA ordinal of a torch device string ("cuda:1" -> 1, "cuda" -> 0), -1 for the CPU."""
    if not device.startswith("cuda"):
        return -1
    return int(device.partition(":")[2] or 0)


def event_opener(dev_id: int) -> Optional[Callable[[bytes], object]]:
    """How a writer on CUDA device ``dev_id`` opens a mark's event handle (None: host memory)."""
    if dev_id < 0:
        return None
    return lambda handle: open_event(dev_id, handle)


class MarkWaiter:
    """Writer side: waits for each mark's event (``mark.event``, a handle) in order on a thread; the
    loop reads the marks whose event completed (``fd`` turns readable) with :meth:`ready`. A mark
    without an event (the CPU, or another message that must keep its place among the marks, such
    as the vLLM connector's ``StreamPreempted``) is ready once every mark submitted before it is (at
    once while no event is waited for). A wait that fails yields the mark with the reason
    (``mark.group`` names it)."""

    def __init__(self, open_event: Optional[Callable[[bytes], object]] = None):
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._open = open_event
        self._events: dict[bytes, object] = {}
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._done: deque[tuple[Any, str]] = deque()
        self._thread: Optional[threading.Thread] = None

    def submit(self, mark: Any) -> None:
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
                ev = self._events.get(mark.event)
                if ev is None:
                    ev = self._events[mark.event] = self._open(mark.event)  # type: ignore[misc]
                ev.synchronize()  # type: ignore[attr-defined]
            except Exception as e:  # a bad handle, a dead context: the stream fails, with why
                why = f"layer group {getattr(mark, 'group', -1)}'s completion event failed: {e}"
            self._finish(mark, why)

    def _finish(self, mark: Any, why: str) -> None:
        self._done.append((mark, why))
        os.eventfd_write(self.fd, 1)

    def ready(self) -> list[tuple[Any, str]]:
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
