"""Layer marks: P's worker tells its writer each layer group of a step is in the pool.

Layer-streamed push (``--push-stream layer``) cuts both pools into layer groups
(``kv.layout.layer_groups``). While a step with streaming prompts runs, the model calls
``on_layer(layer)`` once a layer has queued its K/V store; after the last layer of a group
the worker sends ``LayersStored`` to its writer at once, over its own socket: on CUDA with
the handle of an inter-process event recorded after the group's stores
(``kv/layer_events.py``), which the writer waits for on its own thread; on the CPU with
none (the store has already happened). So the forward never waits, and no thread of the
worker stands between the device finishing a group and the writer hearing of it: a sender
thread here that waited for each event saw every one after the first only when a 16k
prefill's step ended (experiments/marks_probe.py), so every part but the first left after the
prefill. The writer's WRITE then reads bytes the event has proven stored, while later layers
compute.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import zmq

from pushkv import messages as m

log = logging.getLogger(__name__)


def group_ends(groups: Sequence[Sequence[int]]) -> dict[int, int]:
    """Last layer of each group -> the group's index (layers run in order within a step)."""
    return {max(g): i for i, g in enumerate(groups) if g}


class LayerMarks:
    """The worker's side: ``hook(step)`` gives the model's ``on_layer``; ``close()`` ends it.
    Used from the worker's thread only (its socket is that thread's)."""

    def __init__(self, endpoint: str, groups: Sequence[Sequence[int]], device: str, max_msg_bytes: int = 0):
        self.ends = group_ends(groups)
        self.ring = None
        self.failed = False  # no marks: streaming ends, the WRITE at prefill end still moves every group
        if device != "cpu":
            from pushkv.kv import layer_events

            try:
                self.ring = layer_events.EventRing(device)
            except Exception:  # a mark without its event would let a WRITE read unstored bytes: send none
                self.failed = True
                log.exception("layer marks: no inter-process CUDA events on %s; the KV leaves at prefill end",
                              device)
        self.sock: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        if max_msg_bytes:
            self.sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        self.sock.connect(endpoint)

    def hook(self, step_id: int, entries: tuple[m.StreamKV, ...]) -> Callable[[int], None]:
        def on_layer(layer: int) -> None:
            g = self.ends.get(layer)
            if g is None or self.failed:
                return
            event = self.ring.record() if self.ring is not None else b""
            try:
                self.sock.send(m.encode(m.LayersStored(step_id, g, entries, time.time(), event)), zmq.NOBLOCK)
            except zmq.ZMQError:  # a writer that cannot take marks ends streaming, not the step
                self.failed = True
                log.exception("layer marks: sending group %d of step %d failed; streaming stops", g, step_id)

        return on_layer

    def close(self) -> None:
        self.sock.close(0)
