"""Log lines that a flood could repeat (refused peers, refused keys, refused requests): which are written.

Ground: imports nothing of pushkv, so the pure request machine and the socket guards share it.
"""
from __future__ import annotations

from collections import Counter

LOG_FIRST = 10  # such lines are logged one by one; after that every LOG_EVERY-th (a scanner must not flood the log)
LOG_EVERY = 100


def worth_logging(n: int) -> bool:
    """Whether the n-th of a kind of line is logged: the first LOG_FIRST, then every LOG_EVERY-th (each line
    says how many so far)."""
    return n <= LOG_FIRST or n % LOG_EVERY == 0


class Kinds:
    """Counts of a process's per-request log lines by kind (a late allocation, a client gone, a failed leg):
    ``seen(kind)`` counts one and says whether to write it (``worth_logging``); its line says the count."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def seen(self, kind: object) -> int:
        """The kind's count with this one, or 0 where this one's line is not written."""
        self.counts[kind] += 1
        n = self.counts[kind]
        return n if worth_logging(n) else 0
