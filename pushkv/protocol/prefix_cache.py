"""Prefix cache: a block-hash index over the paged pool, with ref-counted blocks and LRU eviction.

A full block of ``block_size`` tokens is named by a hash chained over its token ids and the
previous block's hash, so equal hashes mean equal token prefixes up to and including that
block (the KV of a block depends on every token before it). ``block_hashes`` computes the
chain; it is stable across processes (sha256, no seeded ``hash()``), so two instances, or a
router, name the same prefix the same way at the same block size. A name is the whole digest
(256 bits), as vLLM keys its cache: cut to 64 bits, two prompts built to collide (2^32 tries)
could be served each other's KV. KV events carry its low 64 bits (``event_hash``).

``PrefixCache`` owns the instance's ``BlockAllocator`` and adds three things to it:

- a reference count per allocated block: a block may serve several requests at once (a shared
  prompt prefix); it goes back only when the last of them releases it;
- an index ``hash -> block`` of blocks whose KV is known to be complete (the owner inserts a
  block only once the step that computed it, or the transfer that filled it, has ended);
- an LRU of cached blocks nobody references. They keep their KV and can be hit again; when a
  request needs more blocks than the allocator has free, the least recently released are
  evicted (forgotten by the index and returned to the allocator).

A block that anyone references is never evicted, so a block a transfer may still read or
write (the scheduler releases a request's blocks only once every writer has answered) keeps
its KV. ``num_free`` counts free and evictable blocks: both can be handed out.

Pure: no sockets, no clock; table-tested in tests/protocol/test_protocol_prefix_cache.py.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

from pushkv.protocol.allocator import BlockAllocator

ROOT_HASH = 0  # the "previous block" of a prompt's first block
HASH_BYTES = 32  # a name is a whole sha256 digest


def root_of(cache_salt: str = "", lora: str = "") -> int:
    """The "previous block" a prompt's chain starts from: ROOT_HASH, or for vLLM's ``cache_salt`` a hash of it,
    so that only requests that give the same salt share cached blocks (a tenant's prefixes stay its own); a request
    through a LoRA adapter chains from a hash of the adapter's name (and its salt): its K and V are the adapter's."""
    if not cache_salt and not lora:
        return ROOT_HASH
    if not lora:
        return int.from_bytes(hashlib.sha256(b"pushkv cache_salt\0" + cache_salt.encode()).digest(), "little")
    name = lora.encode()
    return int.from_bytes(hashlib.sha256(b"pushkv lora\0" + len(name).to_bytes(4, "little") + name
                                         + cache_salt.encode()).digest(), "little")


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH, start: int = 0) -> list[int]:
    """Chained hashes of the full blocks of ``tokens[start:]`` (``start`` block-aligned), the
    first chained to ``parent``: the hash of the block before ``start`` (ROOT_HASH at 0)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if start % block_size:
        raise ValueError(f"start {start} is not a multiple of the block size {block_size}")
    n = (len(tokens) - start) // block_size
    # one buffer of little-endian int64 ids, sliced per block: 3x faster than packing each block
    ids = array("q", tokens[start:start + n * block_size])
    if sys.byteorder != "little":
        ids.byteswap()
    buf, width = ids.tobytes(), block_size * 8
    out: list[int] = []
    h = parent
    for i in range(n):
        body = h.to_bytes(HASH_BYTES, "little") + buf[i * width:(i + 1) * width]
        h = int.from_bytes(hashlib.sha256(body).digest(), "little")
        out.append(h)
    return out


def event_hash(h: int) -> int:
    """A block's name as KV events carry it: its low 64 bits (vLLM publishes its sha256 names cut to 64 bits
    alike)."""
    return h & 0xFFFF_FFFF_FFFF_FFFF


class PrefixCache:
    """Ref-counted blocks over a ``BlockAllocator``, with a hash index and LRU eviction.

    ``enabled=False`` keeps the counting (``acquire`` / ``release`` behave as allocate / free)
    but never indexes a block, so nothing is ever hit or kept after release.
    """

    def __init__(self, num_blocks: int, enabled: bool = True):
        self.alloc = BlockAllocator(num_blocks)
        self.enabled = enabled
        self._refs: dict[int, int] = {}  # allocated block -> references (0: cached, in the LRU)
        self._by_hash: dict[int, int] = {}  # hash -> cached block
        self._hash_of: dict[int, int] = {}  # cached block -> its hash
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, oldest first
        self.evictions = 0
        # what the index did, for KV events (protocol/kv_events.py): None (the default) keeps nothing; a list gets
        # ("stored", hash, parent, tokens, salt, lora), ("removed", hash) and ("cleared",) until its owner takes them
        self.journal: Optional[list[tuple]] = None

    # -- sizes ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.alloc.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks a request could get now: free, or cached and unreferenced (evictable)."""
        return self.alloc.num_free + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Blocks in the index (referenced or not)."""
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    # -- lookup --------------------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` (changes nothing)."""
        out: list[int] = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    # -- a request's blocks -------------------------------------------------------------
    def can_acquire(self, hits: Sequence[int], n: int, keep: int = 0) -> bool:
        """Would ``acquire(hits, n)`` succeed and leave at least ``keep`` blocks free or evictable? (Changes
        nothing: a scheduler's watermark asks before it evicts anything.)"""
        evictable = len(self._lru) - sum(1 for b in hits if b in self._lru)
        return n - len(hits) + keep <= self.alloc.num_free + evictable

    def acquire(self, hits: Sequence[int], n: int) -> Optional[list[int]]:
        """A request's ``n`` blocks: ``hits`` (cached blocks, from ``match``, in order) first, then
        ``n - len(hits)`` fresh ones, evicting unreferenced cached blocks LRU-first if the
        allocator is short. None (and nothing changed) if they do not fit."""
        hits = list(hits)
        if len(hits) > n:
            raise ValueError(f"acquire: {len(hits)} hit blocks for a request of {n}")
        for b in hits:
            if b not in self._hash_of:
                raise ValueError(f"acquire: block {b} is not cached")
        fresh = n - len(hits)
        # hit blocks that sit in the LRU stop being evictable once taken: count them out
        evictable = len(self._lru) - sum(1 for b in hits if b in self._lru)
        if fresh > self.alloc.num_free + evictable:
            return None
        for b in hits:
            self._refs[b] += 1
            self._lru.pop(b, None)
        while self.alloc.num_free < fresh:
            self._evict_one()
        new = self.alloc.allocate(fresh)
        assert new is not None  # counted above
        for b in new:
            self._refs[b] = 1
        return hits + new

    def allocate(self, n: int) -> Optional[list[int]]:
        """``n`` fresh blocks (no hits): ``acquire((), n)``."""
        return self.acquire((), n)

    def _evict_one(self) -> None:
        b, _ = self._lru.popitem(last=False)
        h = self._hash_of.pop(b)
        del self._by_hash[h]
        del self._refs[b]
        self.alloc.free([b])
        self.evictions += 1
        if self.journal is not None:
            self.journal.append(("removed", h))

    def insert(self, block: int, h: int, parent: Optional[int] = None, tokens: Sequence[int] = (),
               salt: str = "", lora: Optional[tuple[int, str]] = None) -> bool:
        """Index ``block`` (referenced, its KV complete) under hash ``h``. False (nothing changes)
        when the cache is off, the block is indexed already, or another block holds ``h``
        (two requests computed the same prefix at once: the first one indexed stays). ``parent``
        (the block before it: None for a prompt's first), ``tokens``, ``salt`` and ``lora`` (the request's adapter's
        slot and name) go to the journal."""
        if self._refs.get(block, 0) < 1:
            raise ValueError(f"insert: block {block} is not held by any request")
        if not self.enabled or block in self._hash_of or h in self._by_hash:
            return False
        self._by_hash[h] = block
        self._hash_of[block] = h
        if self.journal is not None:
            self.journal.append(("stored", h, parent, tuple(tokens), salt, lora))
        return True

    def take_journal(self) -> list[tuple]:
        """What the index did since the last take (empty where no journal is kept)."""
        if not self.journal:
            return []
        out, self.journal = self.journal, []
        return out

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block. A block nobody references any more stays cached
        (LRU, evictable) if it is indexed, else goes back to the allocator. Given a request's
        table in order, its last blocks are evicted first: a prefix stays useful longest.
        Unknown or repeated ids raise ValueError; nothing changes then."""
        blocks = list(blocks)
        seen: set[int] = set()
        for b in blocks:
            if self._refs.get(b, 0) < 1:
                raise ValueError(f"release: block {b!r} is not held (double free?)")
            if b in seen:
                raise ValueError(f"release: block {b} given twice")
            seen.add(b)
        back: list[int] = []
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if b in self._hash_of:
                self._lru[b] = None
            else:
                del self._refs[b]
                back.append(b)
        if back:
            self.alloc.free(back)

    free = release  # the allocator's name, for callers that only count blocks

    def reset(self) -> int:
        """Forget every cached prefix (vLLM's reset_prefix_cache): unreferenced cached blocks go back to the
        allocator, referenced ones stay with their requests, no longer indexed (freed when they release them).
        The blocks forgotten."""
        forgotten = len(self._hash_of)
        back = list(self._lru)
        for b in back:
            del self._refs[b]
        self._lru.clear()
        self._by_hash.clear()
        self._hash_of.clear()
        if back:
            self.alloc.free(back)
        if self.journal is not None:
            self.journal.append(("cleared",))
        return forgotten

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def check(self) -> None:
        """Assert the invariants: every allocated block is referenced or cached-and-evictable,
        the index is a bijection, the LRU holds exactly the unreferenced cached blocks."""
        self.alloc.check()
        assert self.alloc.num_used == len(self._refs), "allocated blocks and counted blocks differ"
        assert len(self._by_hash) == len(self._hash_of), "index is not a bijection"
        for h, b in self._by_hash.items():
            assert self._hash_of.get(b) == h, f"block {b} and hash {h} disagree"
        for b, n in self._refs.items():
            assert n >= 0, f"block {b} has {n} references"
            assert (n == 0) == (b in self._lru), f"block {b}: {n} references, in LRU: {b in self._lru}"
            assert n > 0 or b in self._hash_of, f"block {b} unreferenced but not cached"
