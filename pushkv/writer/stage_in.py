"""D's copies from its staging area into its pool (``--staging pushkv``).

A staged transfer's slots are copied into its blocks in pieces, on the area's copy stream: each
part's cells once every producer rank's part carrying them has landed
(``transport/staged_parts.PartLedger``), while later parts are on the wire, and the rest once
every producer's last WRITE has. One transfer's copies run in order on that one stream, so its
last copy's event done means every copy into its blocks is. Only then is it answered: the KV
received, or, for a transfer that failed while a copy ran, its failure (its blocks must not go
back to the scheduler while a copy still writes them). The loop polls the events; it never
waits on them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

from pushkv.protocol import actions as A
from pushkv.transport.staged_parts import Cells
from pushkv.writer import staging
from pushkv.writer.staging import StagingArea

Key = tuple[str, int]


@dataclass
class Ending:
    """A transfer whose last copy into its blocks runs: answered, and its slots given back, once
    that copy is done. ``received`` None: it failed (``reason``); a cancel that comes while it is
    received sets ``reason`` too."""

    slots: Optional[list[int]]
    received: Optional[A.Received] = None
    reg: Any = None  # the writer's record of it (what its KVReceived carries)
    reason: str = ""
    lost: str = ""  # KVFailed.lost
    started: float = 0.0  # wall time of the last copy's start
    event: Any = None


class StageIn:
    """The copies into one writer's pool from its staging ``area``, per transfer."""

    def __init__(self, area: StagingArea):
        self.area = area
        self._running: dict[Key, Any] = {}  # a live transfer's newest part copy, not seen done yet
        self.ending: dict[Key, Ending] = {}

    def __bool__(self) -> bool:
        return bool(self._running or self.ending)

    def copy(self, key: Key, blocks, slots, cells: Cells) -> None:
        """Start copying ``cells`` of the transfer's ``slots`` into its written ``blocks``."""
        event = self.area.copy_in(self.area.cell_pairs(blocks, slots, cells))
        if event is not None:
            self._running[key] = event

    def finish(self, key: Key, ending: Ending, blocks=(), slots=(), cells: Optional[Cells] = None) -> None:
        """The transfer is over: after copying ``cells`` (a received one's rest; a failed one's
        none), answer it (``ended``) once every copy into its blocks is done."""
        if cells:
            self.copy(key, blocks, slots, cells)
        ending.event = self._running.pop(key, None)  # the stream's order: the newest copy ends last
        self.ending[key] = ending

    def running(self, key: Key) -> bool:
        """Whether a copy into the transfer's blocks may still run."""
        event = self._running.get(key)
        if event is not None and staging.done(event):
            del self._running[key]
            event = None
        return event is not None or key in self.ending

    def ended(self) -> Iterator[tuple[Key, Ending]]:
        """The transfers whose copies are all done, each once (and the finished part copies forgotten)."""
        for key in [k for k, e in self._running.items() if staging.done(e)]:
            del self._running[key]
        for key, e in list(self.ending.items()):
            if staging.done(e.event):
                del self.ending[key]
                yield key, e
