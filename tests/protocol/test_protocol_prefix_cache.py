"""Prefix cache: the hash chain, the index with reference counts, LRU eviction (tables)."""
import hashlib
import random

import pytest

from pushkv.protocol import prefix_cache
from pushkv.protocol.prefix_cache import ROOT_HASH, PrefixCache, block_hashes, event_hash, root_of

BS = 4


def test_chain_names_the_whole_prefix():
    a = block_hashes(list(range(12)), BS)
    assert len(a) == 3
    assert block_hashes(list(range(12)) + [99, 98], BS) == a  # a partial block has no hash
    assert block_hashes(list(range(3)), BS) == []
    b = block_hashes([7] + list(range(1, 12)), BS)  # first block differs: every later hash differs
    assert all(x != y for x, y in zip(a, b))
    c = block_hashes(list(range(8)) + [0, 9, 10, 11], BS)  # only the last block differs
    assert c[:2] == a[:2] and c[2] != a[2]
    # the same block of tokens after another prefix is another block
    assert block_hashes(list(range(4, 8)), BS) != [a[1]]
    assert block_hashes(list(range(4, 8)), BS, parent=a[0]) == [a[1]]
    # extending a chain from a block-aligned start gives the same hashes as hashing it whole
    assert block_hashes(list(range(12)), BS, parent=a[0], start=4) == a[1:]
    assert block_hashes(list(range(8)), 8) != a[:1]  # another block size, other names
    assert a == block_hashes(tuple(range(12)), BS)  # stable, tuple or list
    assert ROOT_HASH == 0


def test_prompts_whose_digests_agree_in_64_bits_stay_apart(monkeypatch):
    """A name is the whole sha256 digest, as vLLM keys its cache: with the first 8 bytes only, two prompts built to
    collide there (a birthday search, 2^32 tries) named one block, and the second was served the first's KV. Here a
    sha256 whose every digest starts alike stands in for such a pair; KV events still carry 64 bits."""
    real = hashlib.sha256

    class Forged:
        def __init__(self, data=b""):
            self.d = real(data).digest()

        def digest(self):
            return bytes(8) + self.d[8:]

    monkeypatch.setattr(prefix_cache.hashlib, "sha256", Forged)
    a, b = block_hashes([1, 2, 3, 4], BS), block_hashes([5, 6, 7, 8], BS)
    assert a != b
    c = PrefixCache(4)
    blocks = c.acquire([], 1)
    c.insert(blocks[0], a[0])
    c.release(blocks)
    assert c.match(b) == [] and c.match(a) == blocks
    assert event_hash(a[0]) < 1 << 64 and event_hash(a[0]) == a[0] & (1 << 64) - 1


def test_a_cache_salt_roots_a_chain_of_its_own():
    """vLLM's cache_salt: no salt is the shared root; each salt roots another chain, so every block differs."""
    assert root_of("") == root_of() == ROOT_HASH
    roots = {root_of(x) for x in ("a", "b", "tenant-1", "\u00e9")}
    assert len(roots) == 4 and ROOT_HASH not in roots and root_of("a") == root_of("a")
    plain, salted = block_hashes(list(range(12)), BS), block_hashes(list(range(12)), BS, root_of("a"))
    assert all(x != y for x, y in zip(plain, salted)) and len(salted) == 3


@pytest.mark.parametrize("bs,start", [(0, 0), (-1, 0), (4, 2)])
def test_chain_bad_arguments(bs, start):
    with pytest.raises(ValueError):
        block_hashes(list(range(8)), bs, start=start)


def H(*xs):
    """Hashes of a prompt of blocks named by one int each (the block's token value)."""
    return block_hashes([x for x in xs for _ in range(BS)], BS)


# ops on a pool of 6 blocks, named requests:
#   ("get", name, blocks hashed by H(*prefix), n): match, then acquire n; expect (hit count, ids or None)
#   ("put", name, k): insert the first k blocks of the request under their hashes
#   ("rel", name): release the request's blocks
# then the state after: (num_free, num_cached, num_evictable)
CASES = [
    ("miss_then_hit", [
        ("get", "a", (1, 2), 3, (0, [0, 1, 2])), ("put", "a", 2), ("rel", "a"),
        ("get", "b", (1, 2), 3, (2, [0, 1, 2])),  # block 2 was not indexed: back to the allocator
    ], (3, 2, 0)),
    ("partial_prefix", [
        ("get", "a", (1, 2), 2, (0, [0, 1])), ("put", "a", 2), ("rel", "a"),
        ("get", "b", (1, 5), 2, (1, [0, 2])),
    ], (4, 2, 1)),
    ("uncached_blocks_free_at_once", [
        ("get", "a", (1, 2), 4, (0, [0, 1, 2, 3])), ("put", "a", 1), ("rel", "a"),
    ], (6, 1, 1)),
    ("shared_while_both_hold", [
        ("get", "a", (1,), 2, (0, [0, 1])), ("put", "a", 1),
        ("get", "b", (1,), 2, (1, [0, 2])), ("rel", "a"),
    ], (4, 1, 0)),  # block 0 still held by b: not evictable
    ("evict_lru_when_short", [
        ("get", "a", (1, 2), 2, (0, [0, 1])), ("put", "a", 2), ("rel", "a"),
        ("get", "b", (3, 4), 2, (0, [2, 3])), ("put", "b", 2), ("rel", "b"),
        # 2 free + 4 evictable; 4 fresh needs 2 evicted: a's, released first (last block first)
        ("get", "c", (9,), 4, (0, [0, 1, 4, 5])),
        ("get", "d", (1,), 1, (0, [3])),  # a's prefix is gone; b's last block is evicted next
    ], (1, 1, 1)),
    ("a_hit_is_not_evicted_for_its_own_request", [
        ("get", "a", (1, 2, 3), 3, (0, [0, 1, 2])), ("put", "a", 3), ("rel", "a"),
        # 3 free + 3 evictable, hit 3 of them: 3 fresh come from the free ones
        ("get", "b", (1, 2, 3), 6, (3, [0, 1, 2, 3, 4, 5])),
    ], (0, 3, 0)),
    ("too_big_changes_nothing", [
        ("get", "a", (1,), 1, (0, [0])), ("put", "a", 1), ("rel", "a"),
        ("get", "b", (1,), 7, (1, None)),
    ], (6, 1, 1)),
    ("hit_counts_out_of_evictable", [
        ("get", "a", (1, 2), 2, (0, [0, 1])), ("put", "a", 2), ("rel", "a"),
        ("get", "x", (), 4, (0, [2, 3, 4, 5])),
        # 0 free, 2 evictable, both hit: 1 fresh would have to evict a hit block -> refused
        ("get", "b", (1, 2), 3, (2, None)),
        ("get", "c", (1,), 2, (1, [0, 1])),  # hit block 0, evict block 1 for the fresh one
    ], (0, 1, 0)),
    ("same_prefix_computed_twice_first_stays", [
        ("get", "a", (1,), 1, (0, [0])), ("get", "b", (1,), 1, (0, [1])),
        ("put", "a", 1), ("put", "b", 1), ("rel", "b"), ("rel", "a"),
    ], (6, 1, 1)),
]


@pytest.mark.parametrize("name,ops,after", CASES, ids=[c[0] for c in CASES])
def test_cache_table(name, ops, after):
    c = PrefixCache(6)
    held: dict[str, tuple[list[int], list[int]]] = {}
    for op in ops:
        if op[0] == "get":
            _, who, prefix, n, (want_hits, want_ids) = op
            hashes = H(*prefix)
            hits = c.match(hashes)
            assert len(hits) == want_hits, (op, hits)
            got = c.acquire(hits, n)
            assert got == want_ids, op
            if got is not None:
                held[who] = (got, hashes)
        elif op[0] == "put":
            blocks, hashes = held[op[1]]
            for b, h in zip(blocks[:op[2]], hashes):
                c.insert(b, h)
        else:
            c.release(held.pop(op[1])[0])
        c.check()
    assert (c.num_free, c.num_cached, c.num_evictable) == after


def test_disabled_never_hits_or_keeps():
    c = PrefixCache(4, enabled=False)
    ids = c.acquire([], 2)
    assert not c.insert(ids[0], 123)
    c.release(ids)
    assert c.match([123]) == [] and c.num_free == 4 and c.num_cached == 0
    c.check()


@pytest.mark.parametrize("bad", [[9], [0, 0], [-1]])
def test_bad_release_changes_nothing(bad):
    c = PrefixCache(4)
    ids = c.acquire([], 2)
    with pytest.raises(ValueError):
        c.release(bad)
    c.check()
    assert c.refs(ids[0]) == 1 and c.num_free == 2


def test_reset_forgets_every_prefix_and_frees_what_no_request_holds():
    """vLLM's reset_prefix_cache: nothing hits after it; a cached block nobody holds is free at once, one a request
    holds stays its own (its contents as they were) and comes back free when released."""
    c = PrefixCache(6)
    kept = c.acquire([], 2)
    held = c.acquire([], 2)
    for b, h in zip(kept + held, (11, 12, 21, 22)):
        assert c.insert(b, h)
    c.release(kept)  # cached, evictable
    assert c.num_cached == 4 and c.num_evictable == 2 and c.num_free == 4
    assert c.reset() == 4
    c.check()
    assert c.match([11, 12]) == [] and c.match([21]) == [] and c.num_cached == 0
    assert c.num_free == 4 and c.refs(held[0]) == 1  # the held blocks stay with their request
    c.release(held)
    c.check()
    assert c.num_free == 6 and c.num_cached == 0
    again = c.acquire([], 2)
    assert c.insert(again[0], 11) and c.match([11]) == [again[0]]  # it caches anew


def test_insert_needs_a_holder_and_acquire_a_cached_hit():
    c = PrefixCache(4)
    with pytest.raises(ValueError, match="not held"):
        c.insert(0, 1)
    with pytest.raises(ValueError, match="not cached"):
        c.acquire([2], 3)
    with pytest.raises(ValueError, match="hit blocks"):
        c.acquire([0, 1], 1)
    c.check()


def test_random_ops_keep_invariants():
    """Random traffic of shared-prefix prompts: the invariants hold after every op, a referenced
    block is never handed to another request as fresh, and every block comes back at the end."""
    rng = random.Random(7)
    c = PrefixCache(40)
    live: list[tuple[list[int], int]] = []  # (blocks, fresh-from index)
    owner: dict[int, int] = {}  # block -> request that got it fresh (while referenced)
    for step in range(2000):
        if live and (rng.random() < 0.45 or c.num_free < 8):
            blocks, _ = live.pop(rng.randrange(len(live)))
            c.release(blocks)
            for b in blocks:
                if c.refs(b) == 0:
                    owner.pop(b, None)
        else:
            prefix = [rng.randrange(3) for _ in range(rng.randrange(1, 5))]
            hashes = H(*prefix)
            hits = c.match(hashes)
            n = len(hashes) + rng.randrange(0, 3)
            got = c.acquire(hits, n)
            if got is None:
                continue
            for b in got[len(hits):]:
                assert b not in owner, f"block {b} handed out fresh while held"
                owner[b] = step
            for b, h in zip(got, hashes):
                c.insert(b, h)
            live.append((got, len(hits)))
        c.check()
    for blocks, _ in live:
        c.release(blocks)
    c.check()
    assert c.num_free == 40
