"""Log lines that a flood could repeat (refused peers, refused keys, refused requests): which are written.

Ground: imports nothing of pushkv, so the pure request machine and the socket guards share it.
"""
from __future__ import annotations

LOG_FIRST = 10  # such lines are logged one by one; after that every LOG_EVERY-th (a scanner must not flood the log)
LOG_EVERY = 100


def worth_logging(n: int) -> bool:
    """Whether the n-th of a kind of line is logged: the first LOG_FIRST, then every LOG_EVERY-th (each line
    says how many so far)."""
    return n <= LOG_FIRST or n % LOG_EVERY == 0
