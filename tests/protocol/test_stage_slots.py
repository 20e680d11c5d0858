"""A staging area's slots (transport/stage_slots.py): which cells (layer group x slot) a staged WRITE
takes, in an area cut per layer group (P's) or whole (D's); the spans it then posts from and the
copies that fill them, checked byte for byte against the pool bytes the WRITE would have read; the
one queue of waits for an area's cells; and that parts of different layer groups in flight at once
share an area that holds one of them per group, where whole slots made them wait."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest

from pushkv.config import ModelConfig
from pushkv.kv import layout as L
from pushkv.transport.grid import grid_of
from pushkv.transport.stage_slots import AreaSlots, SlotQueue, placement
from pushkv.transport.staging_plan import block_pairs, group_regions

BS = 8  # tokens a block


def lay(head_group: int = 0, num_blocks: int = 12):
    """Four layers in three layer groups (2, 1, 1: uneven, as the e2e's small model)."""
    model = ModelConfig(name="t", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=4,
                        intermediate_size=32, vocab_size=32)
    return L.layout_for(model, 1, 0, num_blocks, BS, head_group=head_group, layer_split=3)


# spans (pool blocks, D's blocks, tokens, layer groups) -> slots needed per cut (cut, whole), cells it fills
PLACE_CASES = {
    "a layer-streamed part takes its own group's cells only": (
        [([4, 5, 6], [0, 1, 2], 24, (1,))], [0, 3, 0], [3], 3),
    "a whole WRITE takes every group's": (
        [([4, 5], [0, 1], 16, None)], [2, 2, 2], [2], 6),
    "a part of two groups, each from its own first token": (
        [([5, 6, 7], [1, 2, 3], 24, (0,)), ([6, 7], [2, 3], 16, (2,))], [3, 0, 2], [3], 5),
    "only the blocks its tokens reach": (
        [([4, 5, 6, 7], [0, 1, 2, 3], 9, (0,))], [2, 0, 0], [2], 2),
    "a block in two spans of one group is taken once": (
        [([4, 5], [0, 1], 16, (1,)), ([5, 6], [1, 2], 16, (1,))], [0, 3, 0], [3], 3),
}


@pytest.mark.parametrize("spans,cut_need,whole_need,cells", PLACE_CASES.values(), ids=PLACE_CASES.keys())
def test_placement_needs_the_cells_of_what_it_carries(spans, cut_need, whole_need, cells):
    cut, whole = placement(spans, BS, 3, cut=True), placement(spans, BS, 3, cut=False)
    assert cut.need == cut_need and whole.need == whole_need
    assert cut.cells == whole.cells == cells  # both copy each cell once
    assert cut.cells_taken == cells and whole.cells_taken == 3 * whole_need[0]  # whole slots hold every group


def test_placement_refuses_a_group_the_area_lacks():
    with pytest.raises(ValueError, match="layer groups"):
        placement([([0], [0], 8, (3,))], BS, 3, cut=True)


def test_place_maps_each_group_to_its_own_slots():
    p = placement(PLACE_CASES["a part of two groups, each from its own first token"][0], BS, 3, cut=True)
    spans, copies = p.place([[0, 1, 2], [], [3, 4]])
    assert spans == [([0, 1, 2], [1, 2, 3], 24, (0,)), ([3, 4], [2, 3], 16, (2,))]
    assert copies == [([5, 6, 7], [0, 1, 2], (0,)), ([6, 7], [3, 4], (2,))]
    whole = placement([([4, 5], [0, 1], 16, None)], BS, 3, cut=True)  # split: each group from its slots
    spans, _ = whole.place([[0, 1], [2, 3], [4, 0]])
    assert spans == [([0, 1], [0, 1], 16, (0,)), ([2, 3], [0, 1], 16, (1,)), ([4, 0], [0, 1], 16, (2,))]
    with pytest.raises(ValueError, match="grant"):
        whole.place([[0], [1], [2]])


def region_bytes(la, grid, blocks, groups):
    """Offsets of the bytes of ``blocks`` in ``groups``' regions, the slow way (one block at a time)."""
    m = L.subs_per_block(la)
    out = []
    for r in group_regions(la, None if groups is None else list(groups)):
        piece = m * int(grid.elem[r])
        for b in blocks:
            out.extend(range(int(grid.base[r]) + b * piece, int(grid.base[r]) + (b + 1) * piece))
    return np.asarray(out, dtype=np.int64)


@pytest.mark.parametrize("cut", [True, False], ids=["cut", "whole"])
@pytest.mark.parametrize("head_group", [0, 2])
@pytest.mark.parametrize("spans", [c[0] for c in PLACE_CASES.values()], ids=PLACE_CASES.keys())
def test_the_area_holds_the_pool_bytes_each_span_reads(spans, head_group, cut):
    """Copy the placed cells into an area whose slots differ per group, then read each span from the
    area: the bytes are the pool's the unstaged WRITE would have read."""
    la = lay(head_group=head_group)
    area_la = msgspec.structs.replace(la, num_blocks=5)
    pool_grid, area_grid = grid_of(la), grid_of(area_la)
    slots = AreaSlots(5, 3, cut)
    slots.allocate([1] + [0] * (len(slots.parts) - 1))  # group 0's slot 0 is taken: the cuts' slots differ
    p = placement(spans, BS, 3, cut)
    placed, copies = p.place(slots.allocate(p.need))
    pool = np.arange(L.pool_bytes(la), dtype=np.int64)
    area = np.full(L.pool_bytes(area_la), -1, dtype=np.int64)
    for blocks, at, groups in copies:
        for po, so, n in block_pairs(la, pool_grid, area_grid, blocks, at, group_regions(la, groups)):
            area[so:so + n] = pool[po:po + n]
    # the area holds exactly the cells it carries (each once), whichever slots they took
    assert (area >= 0).sum() == sum(len(region_bytes(la, pool_grid, c, (g,))) for g, c in enumerate(p.carried))
    unstaged = [(b, gs if not cut else (g,)) for b, _, _, gs in p.spans
                for g in ([None] if not cut else range(3) if gs is None else gs)]
    assert len(placed) == len(unstaged)
    for (at, _, n, groups), (blocks, want_groups) in zip(placed, unstaged):
        assert groups == want_groups
        k = -(-n // BS)
        got = area[region_bytes(area_la, area_grid, at[:k], groups)]
        want = pool[region_bytes(la, pool_grid, blocks[:k], groups)]
        assert len(got) and (got == want).all()


# -- the one queue of waits for slots (P's posts and D's registrations alike) --------------------------
# steps: ("ask", wait, need) | ("grant", wait or None, slots) | ("give", slots) | ("drop", waits dropped)
QUEUE_CASES = {
    "first come first served": [
        ("ask", "a", 2), ("ask", "b", 1), ("grant", "a", [0, 1]), ("grant", "b", [2]), ("grant", None, None)],
    "a later small wait never overtakes a large first one": [
        ("ask", "a", 3), ("grant", "a", [0, 1, 2]), ("ask", "b", 2), ("ask", "c", 1),
        ("grant", None, None),  # c would fit (one free), but b is first
        ("give", [0, 1]), ("grant", "b", [0, 1]), ("grant", "c", [3]), ("grant", None, None)],
    "a dropped wait lets the next one go": [
        ("ask", "a", 4), ("grant", "a", [0, 1, 2, 3]), ("ask", "b", 3), ("ask", "c", 1), ("drop", ["b"]),
        ("give", [3]), ("grant", "c", [3]), ("drop", [])],
    "a wait for nothing goes at once": [("ask", "a", 0), ("grant", "a", [])],
}


@pytest.mark.parametrize("steps", QUEUE_CASES.values(), ids=QUEUE_CASES.keys())
def test_slot_queue(steps):
    q = SlotQueue(AreaSlots(4, 3, cut=False))  # whole slots (D's): one cut
    waits = {}
    for step in steps:
        if step[0] == "ask":
            waits[step[1]] = {"name": step[1]}  # a side's wait is any object: compared by identity
            q.ask(waits[step[1]], step[2])
            assert waits[step[1]] in q
        elif step[0] == "grant":
            got = q.grant()
            assert (got and (got[0]["name"], got[1])) == (step[1] and (step[1], [step[2]])), step
        elif step[0] == "give":
            q.give_back([step[1]])
        else:
            assert [w["name"] for w in q.drop(lambda w: w["name"] in ("b",))] == step[1]
    q.slots.check()


def test_a_cut_areas_wait_takes_every_cut_it_needs_at_once_or_none():
    q = SlotQueue(AreaSlots(4, 3, cut=True))
    q.ask("a", [4, 0, 0])
    assert q.grant() == ("a", [[0, 1, 2, 3], [], []])
    q.ask("b", 2)  # a whole WRITE: two in every group; group 0 is full
    q.ask("c", [0, 1, 0])  # never overtakes b, though group 1 has room
    assert q.grant() is None and q.slots.parts[1].num_free == 4  # nothing taken of b's while it waits
    q.give_back([[0, 1], [], []])
    assert q.grant() == ("b", [[0, 1], [0, 1], [0, 1]]) and q.grant() == ("c", [[], [2], []])
    assert q.waits == 2 and q.slots.peak_cells == 2 + 6 + 1  # what a kept, then b's and c's
    assert q.slots.free_cells == 12 - 9 and q.slots.num_free == 0  # group 0 is full again


def test_slot_queue_refuses_a_wait_the_area_cannot_meet():
    q = SlotQueue(AreaSlots(4, 3, cut=True))
    with pytest.raises(ValueError, match="5 slots in an area of 4"):
        q.ask(object(), 5)
    with pytest.raises(ValueError, match=r"\[0, 5, 0\] slots in an area of 4"):
        q.ask(object(), [0, 5, 0])
    assert len(q) == 0


def test_a_bad_grant_given_back_changes_nothing():
    slots = AreaSlots(4, 3, cut=True)
    got = slots.allocate([1, 1, 0])
    for bad in ([[0], [0]], [[0], [7], []], [[0, 0], [0], []]):
        with pytest.raises(ValueError):
            slots.free(bad)
    assert slots.free_cells == 10
    slots.free(got)
    slots.check()
    assert slots.free_cells == 12


# -- parts in flight at once: the room they take ------------------------------------------------------
def part(group: int, blocks: int, first: int = 0):
    """A layer-streamed part of one request: ``blocks`` blocks of layer group ``group``."""
    ids = list(range(first, first + blocks))
    return [(ids, ids, blocks * BS, (group,))]


# area slots, the WRITEs in flight at once (none ends), waits in a cut area, waits with whole slots
CONCURRENT = {
    # N requests each streaming another layer group: an area of one request's blocks holds them all
    "three requests, each at its own layer group": (4, [part(0, 4), part(1, 4, 4), part(2, 4, 8)], 0, 2),
    "a request's first part (one group) beside another's second (the other two)": (
        4, [part(0, 4), part(1, 4, 4) + part(2, 4, 4)], 0, 1),
    # in lockstep (one prefill step marks a group for every request at once) they share one group's room
    "three requests in lockstep at one layer group": (4, [part(0, 4), part(0, 4, 4), part(0, 4, 8)], 2, 2),
    # one request's two parts in flight at once (rendezvous.PARTS_AHEAD): the second, staged while the
    # first is on the wire, takes its own group's cells of the same blocks
    "a request's second part beside its first": (4, [part(0, 4), part(1, 4)], 0, 1),
    "a whole WRITE takes every group's room": (3, [[([0, 1], [0, 1], 16, None)], part(1, 2, 4)], 1, 1),
}


@pytest.mark.parametrize("area,writes,cut_waits,whole_waits", CONCURRENT.values(), ids=CONCURRENT.keys())
def test_concurrent_parts_wait_only_for_their_own_groups_room(area, writes, cut_waits, whole_waits):
    for cut, waits in ((True, cut_waits), (False, whole_waits)):
        q: SlotQueue = SlotQueue(AreaSlots(area, 3, cut))
        held = []
        for spans in writes:
            p = placement(spans, BS, 3, cut)
            q.ask(p, p.need)
            while (got := q.grant()) is not None:
                held.append(got[1])
        assert q.waits == waits, ("cut" if cut else "whole", q.waits)
        for g in held:  # the WRITEs end: every slot comes back
            q.give_back(g)
        while (got := q.grant()) is not None:
            q.give_back(got[1])
        assert q.slots.free_cells == q.slots.num_cells and not q
        q.slots.check()
