"""The router's approximate prefix index: tables of record / overlap / forget, the LRU bound, and
the hit rule it shares with the schedulers. Pure: no processes."""
from __future__ import annotations

import pytest

from pushkv.protocol.prefix_cache import PrefixCache, block_hashes
from pushkv.router.prefix_index import PrefixIndex, hashes, usable_hit_tokens

A = block_hashes(list(range(64)), 16)  # 4 blocks
B = block_hashes(list(range(32)) + [9] * 32, 16)  # shares A's first 2 blocks


# (records: (engine, chain)), query chain, engine -> leading blocks held
OVERLAP = [
    ([("d0", A)], A, "d0", 4),
    ([("d0", A)], B, "d0", 2),  # a common prefix, then a different block
    ([("d0", A)], A, "d1", 0),
    ([("d0", A[:2])], A, "d0", 2),
    ([("d0", B), ("d1", A)], A, "d0", 2),
    ([("d0", A[1:])], A, "d0", 0),  # a chain without its first block holds no prefix
    ([], A, "d0", 0),
]


@pytest.mark.parametrize("records,query,engine,want", OVERLAP)
def test_overlap(records, query, engine, want):
    idx = PrefixIndex()
    for e, chain in records:
        idx.record(e, chain)
    assert idx.overlap(engine, query) == want


def test_lru_bound_drops_the_least_recently_recorded_last_blocks_first():
    idx = PrefixIndex(capacity=5)
    idx.record("d0", A)  # 4 hashes
    idx.record("d0", B)  # B's first 2 are A's: refreshed, 2 new -> 6 > 5: A's last block goes (as D would evict it)
    assert len(idx) == 5
    assert idx.overlap("d0", A) == 3 and idx.overlap("d0", B) == 4
    idx.record("d1", A)  # the bound is each instance's
    assert len(idx) == 9 and idx.overlap("d1", A) == 4


def test_an_instance_is_predicted_to_hold_no_more_than_its_pool_caches():
    """Prompts that together outgrow an instance's pool: the instance evicts the least recently used (a request's
    last blocks first), and the index, bounded by the pool, predicts what is still there. Bounded by 2^18 hashes of
    every instance together, it predicted long-evicted prompts whole, and placement sent their repeats there."""
    bs, pool = 4, 10
    cache = PrefixCache(pool)
    idx = PrefixIndex()
    prompts = [[1000 * i + t for t in range(13)] for i in range(5)]  # 3 full blocks and a token: 4 blocks each
    order = [0, 1, 2, 0, 3, 4, 1]  # a repeat refreshes its blocks
    for i in order:  # as P's scheduler serves each: its hits, the rest computed, all indexed, released
        hs = block_hashes(prompts[i], bs)
        blocks = cache.acquire(cache.match(hs[:(len(prompts[i]) - 1) // bs]), len(hs) + 1)
        for b, h in zip(blocks, hs):
            cache.insert(b, h)
        cache.release(blocks)
        idx.record("p0", hs, pool)
    got = [idx.overlap("p0", block_hashes(p, bs)) for p in prompts]
    held = [len(cache.match(block_hashes(p, bs))) for p in prompts]
    assert held == [0, 3, 0, 3, 3]
    # within a block of it: the index cannot see the block each request takes for its last, partial one
    assert got == [1, 3, 0, 3, 3], got


def test_forget_empties_one_instance_only():
    idx = PrefixIndex()
    idx.record("d0", A)
    idx.record("d1", B)
    idx.forget("d0")
    assert idx.overlap("d0", A) == 0 and idx.overlap("d1", B) == 4
    assert len(idx) == 4
    with pytest.raises(ValueError):
        PrefixIndex(0)


# (overlap blocks, prompt tokens, block size, unit) -> tokens the scheduler would take
USABLE = [
    (4, 64, 16, 16, 48),  # the last prompt token's block is always computed
    (4, 65, 16, 16, 64),
    (3, 200, 16, 16, 48),
    (3, 200, 16, 32, 32),  # D with P at 32: whole units of 32
    (0, 64, 16, 16, 0),
    (5, 1, 16, 16, 0),
]


@pytest.mark.parametrize("blocks,prompt,bs,unit,want", USABLE)
def test_usable_hit_tokens(blocks, prompt, bs, unit, want):
    assert usable_hit_tokens(blocks, prompt, bs, unit) == want


def test_hashes_are_memoised_per_block_size():
    cache: dict = {}
    toks = list(range(64))
    assert hashes(toks, 16, cache) == A and hashes(toks, 32, cache) == block_hashes(toks, 32)
    assert set(cache) == {16, 32} and hashes([], 16, cache) is cache[16]
