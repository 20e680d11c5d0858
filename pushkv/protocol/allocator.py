"""Paged KV block allocator that keeps a request's blocks contiguous when it can.

Free space is a sorted list of disjoint runs ``[start, end)``. ``allocate(n)``
first looks for the lowest run that fits ``n`` whole (one transfer descriptor
for the request); failing that it takes the lowest free ids, run by run, so the
result is still a few ascending runs. A fresh pool therefore hands out
``0..n-1``, ``n..2n-1``, ... Freed ids are merged back with their neighbours.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Iterable, Optional, Sequence


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._num_blocks = num_blocks
        self._used = bytearray(num_blocks)  # 1 = allocated
        self._starts: list[int] = [0] if num_blocks else []
        self._ends: list[int] = [num_blocks] if num_blocks else []
        self._num_free = num_blocks

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self._num_blocks - self._num_free

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self._num_free

    def allocate(self, n: int) -> Optional[list[int]]:
        """``n`` block ids (ascending), or None when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self._num_free:
            return None
        if n == 0:
            return []
        starts, ends = self._starts, self._ends
        for i in range(len(starts)):  # first fit: one run if any is long enough
            if ends[i] - starts[i] >= n:
                s = starts[i]
                starts[i] += n
                if starts[i] == ends[i]:
                    del starts[i], ends[i]
                return self._mark(range(s, s + n), n)
        ids: list[int] = []  # fragmented: lowest ids first
        need = n
        k = 0
        while need:
            take = min(need, ends[k] - starts[k])
            ids.extend(range(starts[k], starts[k] + take))
            starts[k] += take
            need -= take
            if starts[k] == ends[k]:
                k += 1
        del starts[:k], ends[:k]
        return self._mark(ids, n)

    def _mark(self, ids: Iterable[int], n: int) -> list[int]:
        ids = list(ids)
        for b in ids:
            self._used[b] = 1
        self._num_free -= n
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return blocks. Unknown, free or repeated ids raise ValueError; nothing changes then."""
        ids = list(ids)
        seen: set[int] = set()
        for b in ids:
            if not isinstance(b, int) or not 0 <= b < self._num_blocks:
                raise ValueError(f"free: unknown block id {b!r} (pool has {self._num_blocks})")
            if not self._used[b]:
                raise ValueError(f"free: block {b} is not allocated (double free?)")
            if b in seen:
                raise ValueError(f"free: block {b} given twice")
            seen.add(b)
        for b in ids:
            self._used[b] = 0
        self._num_free += len(ids)
        for s, e in _runs(sorted(ids)):
            self._insert_run(s, e)

    def _insert_run(self, s: int, e: int) -> None:
        starts, ends = self._starts, self._ends
        i = bisect_left(starts, s)
        join_left = i > 0 and ends[i - 1] == s
        join_right = i < len(starts) and starts[i] == e
        if join_left and join_right:
            ends[i - 1] = ends[i]
            del starts[i], ends[i]
        elif join_left:
            ends[i - 1] = e
        elif join_right:
            starts[i] = s
        else:
            starts.insert(i, s)
            ends.insert(i, e)

    def free_runs(self) -> list[tuple[int, int]]:
        """Free space as ``(start, end)`` runs, ascending (diagnostics, tests)."""
        return list(zip(self._starts, self._ends))

    def check(self) -> None:
        """Assert the accounting invariant: free runs and used ids partition the pool."""
        free = [False] * self._num_blocks
        prev_end = -1
        for s, e in zip(self._starts, self._ends):
            assert 0 <= s < e <= self._num_blocks, f"bad run [{s}, {e})"
            assert s > prev_end, f"runs overlap or touch unmerged at {s}"
            prev_end = e
            for b in range(s, e):
                free[b] = True
        for b in range(self._num_blocks):
            assert free[b] != bool(self._used[b]), f"block {b} is both or neither free and used"
        assert sum(free) == self._num_free, "num_free out of sync"


def _runs(sorted_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive ids as ``[start, end)`` runs."""
    out: list[tuple[int, int]] = []
    for b in sorted_ids:
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0], b + 1)
        else:
            out.append((b, b + 1))
    return out


def runs(ids: Sequence[int]) -> int:
    """Number of maximal ascending consecutive runs in ``ids`` as given (descriptor estimate)."""
    n = 0
    prev = None
    for b in ids:
        if prev is None or b != prev + 1:
            n += 1
        prev = b
    return n
