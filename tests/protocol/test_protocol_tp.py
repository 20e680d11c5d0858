"""Tensor-parallel head ownership: who holds, who produces, who consumes."""
import itertools

import pytest

from pushkv.protocol.tp import consumers_for, head_overlap, is_producer, producers_for, rank_heads


@pytest.mark.parametrize(
    "tp,rank,total,expected",
    [
        (1, 0, 4, (0, 4)),
        (2, 1, 4, (2, 2)),
        (4, 3, 4, (3, 1)),
        (8, 0, 2, (0, 1)),
        (8, 3, 2, (0, 1)),
        (8, 4, 2, (1, 1)),
        (4, 3, 2, (1, 1)),
        (8, 7, 1, (0, 1)),
    ],
)
def test_rank_heads(tp, rank, total, expected):
    assert rank_heads(tp, rank, total) == expected


@pytest.mark.parametrize(
    "tp,rank,total,msg",
    [(3, 0, 4, "does not divide"), (6, 0, 4, "multiple"), (2, 2, 4, "out of range"), (0, 0, 4, ">= 1"),
     (2**31, 0, 8, "past the largest TP size")],
)
def test_rank_heads_errors(tp, rank, total, msg):
    with pytest.raises(ValueError, match=msg):
        rank_heads(tp, rank, total)


# (p_tp, d_tp, total, {d_rank: producers}, {p_rank: consumers}, {(p, d): overlap})
TABLES = [
    ("1to1", 1, 1, 4, {0: [0]}, {0: [0]}, {(0, 0): (0, 4)}),
    ("1to2", 1, 2, 4, {0: [0], 1: [0]}, {0: [0, 1]}, {(0, 0): (0, 2), (0, 1): (2, 2)}),
    ("2to1", 2, 1, 4, {0: [0, 1]}, {0: [0], 1: [0]}, {(0, 0): (0, 2), (1, 0): (2, 2)}),
    ("2to4", 2, 4, 4, {0: [0], 1: [0], 2: [1], 3: [1]}, {0: [0, 1], 1: [2, 3]},
     {(0, 1): (1, 1), (0, 2): None, (1, 3): (3, 1)}),
    ("4to2", 4, 2, 4, {0: [0, 1], 1: [2, 3]}, {0: [0], 1: [0], 2: [1], 3: [1]},
     {(2, 1): (2, 1), (2, 0): None}),
    # 2 heads, both sides replicate: P ranks 0,1 hold head 0 (0 produces), 2,3 hold head 1 (2 produces)
    ("4to8_replicated", 4, 8, 2,
     {0: [0], 3: [0], 4: [2], 7: [2]},
     {0: [0, 1, 2, 3], 1: [], 2: [4, 5, 6, 7], 3: []},
     {(0, 3): (0, 1), (1, 0): None, (2, 5): (1, 1), (0, 4): None}),
    ("8to4_replicated", 8, 4, 2, {0: [0], 1: [0], 2: [4], 3: [4]},
     {0: [0, 1], 4: [2, 3], 1: [], 7: []}, {(4, 2): (1, 1), (5, 2): None}),
    ("2to4_two_heads", 2, 4, 2, {0: [0], 3: [1]}, {0: [0, 1], 1: [2, 3]}, {(1, 2): (1, 1)}),
    ("2to1_two_heads", 2, 1, 2, {0: [0, 1]}, {0: [0], 1: [0]}, {(1, 0): (1, 1)}),
]


@pytest.mark.parametrize("name,p_tp,d_tp,total,prod,cons,overlap", TABLES, ids=[t[0] for t in TABLES])
def test_tp_tables(name, p_tp, d_tp, total, prod, cons, overlap):
    for d, expected in prod.items():
        assert producers_for(d, d_tp, p_tp, total) == expected, ("producers", d)
    for p, expected in cons.items():
        assert consumers_for(p, p_tp, d_tp, total) == expected, ("consumers", p)
    for (p, d), expected in overlap.items():
        assert head_overlap(p, p_tp, d, d_tp, total) == expected, ("overlap", p, d)


@pytest.mark.parametrize(
    "p_tp,d_tp,total",
    [(p, d, t) for p, d, t in itertools.product([1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8])],
)
def test_every_d_head_has_exactly_one_producer(p_tp, d_tp, total):
    for d in range(d_tp):
        start, count = rank_heads(d_tp, d, total)
        covered = []
        for p in range(p_tp):
            ov = head_overlap(p, p_tp, d, d_tp, total)
            assert (ov is not None) == (p in producers_for(d, d_tp, p_tp, total))
            assert (ov is not None) == (d in consumers_for(p, p_tp, d_tp, total))
            if ov is not None:
                ps, pc = rank_heads(p_tp, p, total)
                assert ps <= ov[0] and ov[0] + ov[1] <= ps + pc  # P holds what it writes
                covered.extend(range(ov[0], ov[0] + ov[1]))
        assert sorted(covered) == list(range(start, start + count))


@pytest.mark.parametrize("p_tp,total,producers", [
    (1, 4, [0]), (2, 4, [0, 1]), (4, 4, [0, 1, 2, 3]),
    (4, 2, [0, 2]),  # ranks 1 and 3 replicate heads 0 and 1
    (8, 2, [0, 4]),
    (2, 1, [0]), (4, 1, [0]),  # MLA-style latent: one "head", rank 0 writes it
])
def test_is_producer(p_tp, total, producers):
    assert [p for p in range(p_tp) if is_producer(p, p_tp, total)] == producers
    for p in range(p_tp):  # a rank produces iff it has a consumer, whatever D's TP
        for d_tp in (1, 2, 4, 8):
            assert bool(consumers_for(p, p_tp, d_tp, total)) == is_producer(p, p_tp, total)


def test_a_tp_size_off_the_wire_past_the_largest_is_refused_before_its_ranks_are_looked_at():
    """A Register naming tp = 2**31 (a multiple of the heads) once held a P writer's loop for
    minutes in ``consumers_for``, one D rank at a time: now it is refused at once."""
    with pytest.raises(ValueError, match="past the largest TP size"):
        consumers_for(0, 1, 2**31, 8)
    assert consumers_for(0, 1, 1024, 8) == list(range(1024))  # the largest is still served
