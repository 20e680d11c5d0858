"""D's ledger of a staged transfer's parts (transport/staged_parts.py): which cells (layer group x
written block) D may copy from its staging slots into its blocks as each part lands, and what is
left for the copy after the last WRITE. Every case also checks that the cells handed out over the
whole transfer are each of its cells exactly once (none copied twice, none missed)."""
from __future__ import annotations

import msgspec
import pytest

from pushkv.config import ModelConfig
from pushkv.kv import layout as L
from pushkv.transport.grid import grid_of
from pushkv.transport.staged_parts import PartLedger, cell_pairs
from pushkv.transport.staging_plan import block_pairs, group_regions

# a ledger: (producers, groups, block size, prompt tokens, first written block (the cached prefix's end))
# events: (P rank, spans) -> the cells handed out now (None: refused), in order; then what rest() hands out
CASES = {
    "one producer, one group after another": (
        ((0,), 3, 16, 64, 0),
        [(0, [(0, 0, 64)], [(0, [0, 1, 2, 3])]),
         (0, [(1, 0, 64)], [(1, [0, 1, 2, 3])])],
        [(2, [0, 1, 2, 3])]),
    "two producers: a cell goes once both have landed it": (
        ((0, 1), 2, 16, 64, 0),
        [(0, [(0, 0, 64)], []),
         (1, [(1, 0, 64)], []),
         (1, [(0, 0, 64)], [(0, [0, 1, 2, 3])]),
         (0, [(1, 0, 64)], [(1, [0, 1, 2, 3])])],
        []),
    "a producer's part only halfway: its cells wait, the rest goes at the end": (
        ((0, 1), 2, 16, 64, 0),
        [(0, [(0, 0, 64)], []), (1, [(0, 0, 32)], [(0, [0, 1])])],
        [(0, [2, 3]), (1, [0, 1, 2, 3])]),
    "chunks (group -1: every group), a partial end block waits for the next chunk": (
        ((0,), 2, 16, 50, 0),
        [(0, [(-1, 0, 40)], [(0, [0, 1]), (1, [0, 1])]),  # tokens 32-39: block 2 is not whole yet
         (0, [(-1, 40, 50)], [(0, [3]), (1, [3])])],  # the prompt's last block is whole at its end; 2 was cut
        [(0, [2]), (1, [2])]),
    "the cached prefix is never written: indices count from the first written block": (
        ((0,), 1, 16, 64, 2),
        [(0, [(0, 32, 48)], [(0, [0])])],
        [(0, [1])]),
    "layer spans of differing first tokens in one part": (
        ((0,), 3, 16, 48, 0),
        [(0, [(0, 16, 48), (1, 0, 48)], [(0, [1, 2]), (1, [0, 1, 2])])],
        [(0, [0]), (2, [0, 1, 2])]),
    "bad peer input changes nothing": (
        ((0, 1), 2, 16, 32, 0),
        [(5, [(0, 0, 32)], None),  # not a producer
         (0, [(2, 0, 32)], None),  # no such group
         (0, [(0, 0, 33)], None),  # past the prompt
         (0, [(0, 16, 8)], None),  # ends before it starts
         (0, [(0, 0, 32), (9, 0, 1)], None),  # one bad span refuses the whole part
         (0, [], None),
         (1, [(0, 0, 32)], []),  # rank 0 marked nothing above
         (0, [(0, 0, 32)], [(0, [0, 1])])],
        [(1, [0, 1])]),
    "a part landed twice hands its cells out once": (
        ((0,), 1, 16, 32, 0),
        [(0, [(0, 0, 32)], [(0, [0, 1])]), (0, [(0, 0, 32)], [])],
        []),
}


@pytest.mark.parametrize("ledger,events,rest", CASES.values(), ids=CASES.keys())
def test_part_ledger(ledger, events, rest):
    producers, groups, bs, tokens, first = ledger
    led = PartLedger(producers, groups, bs, tokens, first)
    out = []
    for rank, spans, want in events:
        got = led.landed(rank, spans)
        assert got == want, (rank, spans)
        out += got or []
    assert led.rest() == rest
    assert led.rest() == []  # handed out once
    cells = sorted((g, i) for g, idx in out + rest for i in idx)
    assert cells == [(g, i) for g in range(groups) for i in range(led.blocks)], "each cell exactly once"
    assert led.cells_out == groups * led.blocks == groups * (L.blocks_for(tokens, bs) - first)


def test_a_ledger_needs_producers_and_groups():
    with pytest.raises(ValueError):
        PartLedger((), 2, 16, 32)
    with pytest.raises(ValueError):
        PartLedger((0,), 0, 16, 32)


def test_cell_pairs_copy_each_cells_group_regions_only():
    model = ModelConfig(name="t", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=4,
                        intermediate_size=32, vocab_size=32)
    la = L.layout_for(model, 1, 0, 12, 8, head_group=2, layer_split=2)
    area = msgspec.structs.replace(la, num_blocks=6)
    pool, grid = grid_of(la), grid_of(area)
    blocks, slots = [7, 8, 9, 3], [0, 1, 2, 5]
    got = cell_pairs(la, pool, grid, blocks, slots, [(0, [0, 1]), (1, [3])])
    want = (block_pairs(la, pool, grid, [7, 8], [0, 1], group_regions(la, [0]))
            + block_pairs(la, pool, grid, [3], [5], group_regions(la, [1])))
    assert got == want and len(got) == 2 * 2  # one run per region, two head groups per layer group
