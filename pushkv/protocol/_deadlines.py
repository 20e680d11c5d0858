"""A deadline heap with lazy deletion, shared by the protocol machines."""
from __future__ import annotations

import heapq
from typing import Callable, Generic, Hashable, Optional, TypeVar

K = TypeVar("K", bound=Hashable)


class Deadlines(Generic[K]):
    """``(deadline, key)`` pairs; a key's newest arm wins, older arms are skipped.

    ``current(key)`` returns the deadline the owner still holds for ``key`` (or
    None), so entries re-armed or removed elsewhere never fire.
    """

    def __init__(self, current: Callable[[K], Optional[float]]):
        self._heap: list[tuple[float, int, K]] = []
        self._seq = 0
        self._current = current

    def arm(self, key: K, deadline: float) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, key))

    def due(self, now: float) -> list[K]:
        out: list[K] = []
        seen: set[K] = set()
        while self._heap and self._heap[0][0] <= now:
            deadline, _, key = heapq.heappop(self._heap)
            if key not in seen and self._current(key) == deadline:
                seen.add(key)
                out.append(key)
        return out

    def next(self) -> Optional[float]:
        while self._heap:
            deadline, _, key = self._heap[0]
            if self._current(key) == deadline:
                return deadline
            heapq.heappop(self._heap)
        return None
