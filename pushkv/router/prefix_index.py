"""The router's approximate map of which instance holds which prompt prefix.

Pure: no sockets. The router records where it sent what (``record``: the chained block hashes of
a prompt, and on D of prompt + answer, as ``protocol.prefix_cache`` names them) and asks, for a
new prompt, how many leading blocks each instance probably still holds (``overlap``). It never
hears of evictions: it keeps, per instance, as many hashes as the instance's pool has blocks (it
can cache no more), in the order the instance would evict them (an LRU, where a request's last blocks
go before its first, as ``PrefixCache.release`` queues them), and a guess that was wrong costs only a
worse placement (the instance computes or receives what it lacks). The router counts how far its
guesses were off (``RouterMetrics``: predicted against the hits the instances reported).

Hashes depend on the block size, so each block size the deployment uses has its chain
(``hashes``, computed once per request and size).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

from pushkv.protocol.prefix_cache import block_hashes, root_of

CAPACITY = 1 << 18  # hashes remembered per instance at most (x ~100 bytes each: ~25 MB), whatever its pool


class PrefixIndex:
    def __init__(self, capacity: int = CAPACITY):
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._held: dict[str, OrderedDict[int, None]] = {}  # engine id -> its hashes, the first it would evict first

    def __len__(self) -> int:
        return sum(len(h) for h in self._held.values())

    def record(self, engine_id: str, hashes: Sequence[int], pool: Optional[int] = None) -> None:
        """``engine_id`` now holds the blocks named by ``hashes`` (a chain from the root), the most recently used of
        what it holds; ``pool``: its pool's blocks, the most it can keep cached (the least recent go past it)."""
        held = self._held.setdefault(engine_id, OrderedDict())
        for h in reversed(hashes):  # the chain's head last: an instance evicts a request's last blocks first
            held[h] = None
            held.move_to_end(h)
        bound = min(pool, self.capacity) if pool else self.capacity
        while len(held) > bound:
            held.popitem(last=False)

    def overlap(self, engine_id: str, hashes: Sequence[int]) -> int:
        """Leading blocks of the chain that ``engine_id`` probably holds."""
        held = self._held.get(engine_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def forget(self, engine_id: str) -> None:
        """The instance is gone or restarted: its cache is empty."""
        self._held.pop(engine_id, None)


def hashes(tokens: Sequence[int], block_size: int, cache: dict[int, list[int]], cache_salt: str = "",
           lora: str = "") -> list[int]:
    """The chain of ``tokens`` at ``block_size`` from the root of the request's ``cache_salt`` (as its schedulers
    chain it), memoised in ``cache`` (one request's)."""
    got = cache.get(block_size)
    if got is None:
        got = cache[block_size] = block_hashes(tokens, block_size, root_of(cache_salt, lora))
    return got


def usable_hit_tokens(overlap_blocks: int, prompt_tokens: int, block_size: int, unit: int) -> int:
    """What an instance would take from its cache of ``overlap_blocks`` leading blocks, as its
    scheduler does: never the block of the last prompt token (its logits give the first token),
    whole ``unit``s (D: a transfer starts on a block of both sides)."""
    blocks = min(overlap_blocks, max(prompt_tokens - 1, 0) // block_size)
    return blocks * block_size // unit * unit
