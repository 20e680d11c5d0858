"""One rank's weight loading as it goes, in GiB and seconds: a bar on a terminal, a log line every
``LOG_EVERY_S`` otherwise (a file, a pod's log), and one line with the total at the end.

The count is of the bytes this rank keeps (each slice in the model's dtype), so it ends at
``model.footprint.weight_bytes``; a slow checkpoint shows where it is instead of a silent stage.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Optional, TextIO

log = logging.getLogger(__name__)

GIB = 1 << 30
MIB = 1 << 20
BAR_EVERY_S = 0.25  # terminal redraws
LOG_EVERY_S = 5.0  # log lines when not on a terminal
BAR_WIDTH = 24


class LoadProgress:
    """Called with each slice's bytes as it lands; ``finish()`` says the total."""

    def __init__(self, label: str, total_bytes: int, out: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.monotonic, tty: Optional[bool] = None):
        self.label, self.total = label, max(1, total_bytes)
        self.out = out if out is not None else sys.stderr
        self.tty = self.out.isatty() if tty is None else tty
        self.clock = clock
        self.start = self.last = clock()
        self.done = 0

    def line(self, now: float) -> str:
        frac = min(1.0, self.done / self.total)
        head = f"{self.label}: loading weights"
        if self.tty:
            filled = int(frac * BAR_WIDTH)
            head += " [" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]"
        unit, scale = ("GiB", GIB) if self.total >= GIB else ("MiB", MIB)
        return f"{head} {self.done / scale:.2f}/{self.total / scale:.2f} {unit} ({frac:.0%}) {now - self.start:.1f} s"

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        now = self.clock()
        if now - self.last < (BAR_EVERY_S if self.tty else LOG_EVERY_S):
            return
        self.last = now
        if self.tty:
            self.out.write("\r" + self.line(now))
            self.out.flush()
        else:
            log.info("%s", self.line(now))

    def finish(self) -> str:
        took = self.clock() - self.start
        unit, scale = ("GiB", GIB) if self.done >= GIB else ("MiB", MIB)
        done = (f"{self.label}: weights loaded, {self.done / scale:.2f} {unit} in {took:.1f} s "
                f"({self.done / GIB / max(took, 1e-9):.2f} GiB/s)")
        if self.tty:
            self.out.write("\r" + self.line(self.clock()) + "\n")
            self.out.flush()
        log.info("%s", done)
        return done
