"""A staging area (writer/staging.StagingArea) on a host pool, as CI runs it: cut per layer group (P's),
N requests whose layer-streamed parts of different groups are in flight at once fit an area of one
request's blocks and none waits for room, and each part's slots hold the pool bytes it WRITEs; with
whole slots (D's area, and P's before it was cut) the same parts wait. Real torch copies."""
from __future__ import annotations

import pytest
import torch

from pushkv.config import ModelConfig
from pushkv.kv import layout as L
from pushkv.transport.stage_slots import placement
from pushkv.transport.staging_plan import group_regions
from pushkv.writer.staging import StagingArea

BS, BLOCKS, GROUPS = 8, 4, 3  # a request's prompt: 4 blocks of 8 tokens


def pool_layout():
    model = ModelConfig(name="t", num_layers=GROUPS, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=4,
                        intermediate_size=32, vocab_size=32)
    return L.layout_for(model, 1, 0, 16, BS, layer_split=GROUPS)


@pytest.mark.parametrize("cut,waits", [(True, 0), (False, GROUPS - 1)], ids=["cut", "whole"])
def test_parts_of_different_groups_share_an_area_of_one_requests_blocks(cut, waits):
    lay = pool_layout()
    pool = torch.randint(0, 256, (L.pool_bytes(lay),), dtype=torch.uint8)
    area = StagingArea(pool, "cpu", lay, BLOCKS, cut=cut)  # just big enough for the N parts when cut
    # request i's part of layer group i (its prefill began a group after the one before it)
    parts = []
    for i in range(GROUPS):
        blocks = list(range(i * BLOCKS, (i + 1) * BLOCKS))
        p = placement([(blocks, blocks, BLOCKS * BS, (i,))], BS, area.slots.groups, area.slots.cut)
        area.queue.ask(p, p.need)
        while (got := area.queue.grant()) is not None:
            parts.append(got)
    assert area.queue.waits == waits and len(parts) == GROUPS - waits, (area.queue.waits, len(parts))
    m = L.subs_per_block(lay)
    for p, grant in parts:  # each granted part's slots hold its pool bytes once its copy is done
        spans, copies = p.place(grant)
        assert area.copy_out(area.copies_pairs(copies)) is None  # a host area copies at once
        for (blocks, _, _, groups), (slots, _, _, _) in zip(p.spans, spans):
            for r in group_regions(lay, list(groups)):
                piece = m * int(area.pool_grid.elem[r])
                for b, s in zip(blocks, slots):
                    po, so = int(area.pool_grid.base[r]) + b * piece, int(area.grid.base[r]) + s * piece
                    assert torch.equal(area.host[so:so + piece], pool[po:po + piece])
    for _, grant in parts:  # the WRITEs end; the waiting ones go, and end
        area.queue.give_back(grant)
        while (got := area.queue.grant()) is not None:
            area.queue.give_back(got[1])
    assert area.slots.free_cells == area.slots.num_cells == BLOCKS * GROUPS and not area.queue
    assert area.slots.peak_cells == BLOCKS * GROUPS  # three parts' cells, or one part's whole slots
    area.slots.check()
    area.close()
