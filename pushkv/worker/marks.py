"""Layer marks: P's worker tells its writer each layer group of a step is in the pool.

Layer-streamed push (``--push-stream layer``) cuts both pools into layer groups
(``kv.layout.layer_groups``). While a step with streaming prompts runs, the model calls
``on_layer(layer)`` once a layer has queued its K/V store; after the last layer of a group
the worker records a completion mark: on CUDA an event on the compute stream, on the CPU
nothing (the store has already happened). A sender thread waits for each mark in order
and sends ``LayersStored`` to the writer over its own socket, so the forward never waits
and the writer, an isolated process, learns of the group by message. Its WRITE then reads
bytes the event has proven stored, while later layers compute.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional, Sequence

import zmq

from pushkv import messages as m

log = logging.getLogger(__name__)


def group_ends(groups: Sequence[Sequence[int]]) -> dict[int, int]:
    """Last layer of each group -> the group's index (layers run in order within a step)."""
    return {max(g): i for i, g in enumerate(groups) if g}


class LayerMarks:
    """The worker's side: ``hook(step)`` gives the model's ``on_layer``; ``close()`` ends the sender."""

    def __init__(self, endpoint: str, groups: Sequence[Sequence[int]], device: str, max_msg_bytes: int = 0):
        self.ends = group_ends(groups)
        self.device = device
        self._q: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()  # (start, event, step, group, ...)
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(endpoint, max_msg_bytes), name="layer-marks",
                                        daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise RuntimeError(f"layer marks sender failed to start: {self._error}")

    def hook(self, step_id: int, entries: tuple[m.StreamKV, ...]) -> Callable[[int], None]:
        cuda = self.device != "cpu"
        start = None
        if cuda:  # the step's first launch on the device: each mark's event is timed from it
            import torch

            start = (torch.cuda.Event(enable_timing=True), time.time())
            start[0].record()

        def on_layer(layer: int) -> None:
            g = self.ends.get(layer)
            if g is None:
                return
            event = None
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
            self._q.put((start, event, step_id, g, entries, time.time()))

        return on_layer

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)

    def _run(self, endpoint: str, max_msg_bytes: int) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        try:
            if self.device != "cpu":
                import torch

                torch.cuda.set_device(self.device)
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            if max_msg_bytes:
                sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
            sock.connect(endpoint)
        except BaseException as e:  # noqa: BLE001 -- reported to the constructor
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                item = self._q.get()
                if item is None:
                    return
                start, event, step_id, group, entries, recorded = item
                gpu_done = 0.0
                if event is not None:
                    event.synchronize()  # the group's stores are done on the device
                    gpu_done = start[1] + start[0].elapsed_time(event) / 1e3
                sock.send(m.encode(m.LayersStored(step_id, group, entries, recorded, gpu_done, time.time())))
        except Exception:  # a dead writer ends streaming, not the worker: the WRITE at prefill end still runs
            log.exception("layer marks sender stopped")
        finally:
            sock.close(0)
