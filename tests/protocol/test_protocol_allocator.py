"""BlockAllocator: contiguous runs, all-or-nothing, and accounting invariants."""
import random

import pytest

from pushkv.protocol.allocator import BlockAllocator, runs


# (pool size, ops, expected result of the last allocate, free runs after)
# op: ("a", n) allocate / ("f", ids) free by literal ids / ("F", k) free the k-th allocation
CASES = [
    ("fresh_is_consecutive", 10, [("a", 3)], [0, 1, 2], [(3, 10)]),
    ("second_follows_first", 10, [("a", 3), ("a", 4)], [3, 4, 5, 6], [(7, 10)]),
    ("exact_fit", 4, [("a", 4)], [0, 1, 2, 3], []),
    ("too_many_is_none", 4, [("a", 5)], None, [(0, 4)]),
    ("zero", 4, [("a", 0)], [], [(0, 4)]),
    ("freed_hole_reused_first_fit", 10, [("a", 3), ("a", 3), ("F", 0), ("a", 2)], [0, 1], [(2, 3), (6, 10)]),
    # hole of 3 at 0..2 too small for 4: first fit skips it for the tail run
    ("first_fit_skips_small_hole", 10, [("a", 3), ("a", 3), ("F", 0), ("a", 4)], [6, 7, 8, 9], [(0, 3)]),
    # no run fits: lowest ids across runs, ascending
    ("fragmented_lowest_first", 8, [("a", 2), ("a", 2), ("a", 2), ("a", 2), ("F", 0), ("F", 2), ("a", 3)],
     [0, 1, 4], [(5, 6)]),
    ("merge_both_sides", 6, [("a", 2), ("a", 2), ("a", 2), ("F", 0), ("F", 2), ("F", 1)], None, [(0, 6)]),
    ("all_or_nothing_when_fragmented", 6, [("a", 2), ("a", 2), ("a", 2), ("F", 0), ("F", 2), ("a", 5)],
     None, [(0, 2), (4, 6)]),
]


@pytest.mark.parametrize("name,size,ops,last,free_runs", CASES, ids=[c[0] for c in CASES])
def test_allocate_table(name, size, ops, last, free_runs):
    a = BlockAllocator(size)
    allocs = []
    result = None
    for op, arg in ops:
        if op == "a":
            result = a.allocate(arg)
            allocs.append(result)
        elif op == "F":
            a.free(allocs[arg])
            result = None
        else:
            a.free(arg)
            result = None
        a.check()
    assert result == last
    assert a.free_runs() == free_runs
    assert a.num_free == sum(e - s for s, e in free_runs)


BAD_FREES = [
    ("double_free", [0], "not allocated"),
    ("never_allocated", [7], "not allocated"),
    ("out_of_range", [10], "unknown block id 10"),
    ("negative", [-1], "unknown block id -1"),
    ("repeated_in_call", [1, 1], "block 1 given twice"),
    ("partly_bad_changes_nothing", [2, 9], "block 9"),
]


@pytest.mark.parametrize("name,ids,msg", BAD_FREES, ids=[c[0] for c in BAD_FREES])
def test_bad_free_raises_and_changes_nothing(name, ids, msg):
    a = BlockAllocator(10)
    got = a.allocate(4)
    if name == "double_free":
        a.free([0])
        got = [1, 2, 3]
    before = (a.num_free, a.free_runs())
    with pytest.raises(ValueError, match=msg):
        a.free(ids)
    assert (a.num_free, a.free_runs()) == before
    a.check()
    a.free(got)
    assert a.num_free == 10


def test_can_allocate_and_properties():
    a = BlockAllocator(5)
    assert a.num_blocks == 5 and a.can_allocate(5) and not a.can_allocate(6)
    a.allocate(2)
    assert a.num_free == 3 and a.num_used == 2 and not a.can_allocate(4)
    with pytest.raises(ValueError):
        a.allocate(-1)


@pytest.mark.parametrize("ids,expected", [([], 0), ([3], 1), ([0, 1, 2], 1), ([0, 2, 3], 2), ([3, 2], 2)])
def test_runs(ids, expected):
    assert runs(ids) == expected


def test_random_churn_keeps_invariant():
    rng = random.Random(7)
    a = BlockAllocator(64)
    held = []
    for _ in range(400):
        if held and rng.random() < 0.45:
            a.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 12)
            got = a.allocate(n)
            if got is None:
                assert not a.can_allocate(n)
            else:
                assert got == sorted(got) and len(got) == n
                held.append(got)
        a.check()
    for ids in held:
        a.free(ids)
    a.check()
    assert a.free_runs() == [(0, 64)]
