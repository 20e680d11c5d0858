"""pushkv's own staging, the pure part (transport/staging_plan.py): which bytes a staged WRITE
copies between pool blocks and staging slots, how large the area is, and when a writer stages (the
slots a WRITE takes, and the queue of waits for them: test_stage_slots.py).

Every copy list is checked byte for byte against the mapping it must make, computed the slow way
(one block of one region at a time), so a copy that misses, adds or misplaces a byte fails."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest

from pushkv.config import DeploymentConfig, ModelConfig
from pushkv.kv import layout as L
from pushkv.transport.grid import grid_of
from pushkv.transport.staging_plan import area_blocks, block_pairs, group_regions, merged, total, wanted


def lay(sub_block: int = 0, head_group: int = 0, layer_split: int = 0, num_blocks: int = 12):
    model = ModelConfig(name="t", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=4,
                        intermediate_size=32, vocab_size=32)
    return L.layout_for(model, 1, 0, num_blocks, 8, sub_block=sub_block, head_group=head_group,
                        layer_split=layer_split)


@pytest.mark.parametrize("offs,lens,want", [
    ([], [], []),
    ([10], [0], []),  # empty runs drop
    ([0, 4], [4, 4], [(0, 8)]),  # touching runs join
    ([8, 0], [4, 4], [(0, 4), (8, 4)]),  # sorted; a gap keeps them apart
    ([0, 2, 20], [6, 2, 1], [(0, 6), (20, 1)]),  # a run inside another
    ([0, 3], [5, 5], [(0, 8)]),  # overlapping runs join
])
def test_merged(offs, lens, want):
    assert merged(np.asarray(offs), np.asarray(lens)) == want


def pool_bytes_of(la, grid, blocks, regions=None):
    """The bytes of whole ``blocks`` in grid ``regions``, the slow way (one block at a time)."""
    m = L.subs_per_block(la)
    out = []
    for r in (range(len(grid.base)) if regions is None else regions):
        piece = m * int(grid.elem[r])
        out += [(r, b, int(grid.base[r]) + b * piece, piece) for b in blocks]
    return out


@pytest.mark.parametrize("kw", [{}, {"sub_block": 4}, {"head_group": 2}, {"layer_split": 2}])
def test_block_pairs_copy_each_block_to_its_slot_in_every_region(kw):
    la = lay(**kw)
    area = msgspec.structs.replace(la, num_blocks=5)
    pool_grid, area_grid = grid_of(la), grid_of(area)
    blocks, slots = [3, 4, 5, 9, 0], [1, 2, 3, 0, 4]
    pairs = block_pairs(la, pool_grid, area_grid, blocks, slots)
    got = {po + i: so + i for po, so, n in pairs for i in range(n)}  # byte for byte: pool -> area
    want = {}
    for (_, _, off, piece), (_, _, soff, _) in zip(pool_bytes_of(la, pool_grid, blocks),
                                                    pool_bytes_of(area, area_grid, slots)):
        want.update({off + i: soff + i for i in range(piece)})
    assert got == want
    # runs contiguous on both sides join: blocks 3-5 -> slots 1-3 is one copy per region
    assert len(pairs) == 3 * len(pool_grid.base)
    assert total([(po, n) for po, _, n in pairs]) == len(want)


def test_block_pairs_in_some_regions_only():
    la = lay(layer_split=2)
    pool_grid = grid_of(la)
    area_grid = grid_of(msgspec.structs.replace(la, num_blocks=4))
    regions = group_regions(la, [1])
    assert len(L.layer_groups(la)) == 2 and regions == [1]  # layer group major, one head group
    pairs = block_pairs(la, pool_grid, area_grid, [7], [2], regions)
    piece = int(pool_grid.elem[1]) * L.subs_per_block(la)
    assert pairs == [(int(pool_grid.base[1]) + 7 * piece, int(area_grid.base[1]) + 2 * piece, piece)]
    assert group_regions(la, None) == [0, 1]
    with pytest.raises(ValueError):
        block_pairs(la, pool_grid, area_grid, [1, 2], [0])


def test_area_blocks():
    gib, mib = 2**30, 2**20
    assert area_blocks(1000, mib, 64, 128 * gib) == 64  # asked for: 64 MiB of 1 MiB blocks
    assert area_blocks(1000, mib, 0, 128 * gib) == 1000  # auto: 8 GiB would hold more than the pool
    assert area_blocks(100_000, mib, 0, 128 * gib) == 8192  # auto: 1/16 of the host
    assert area_blocks(10, mib, 0, 0) == 10  # host unknown: the pool's
    assert area_blocks(10, 4 * mib, 1, 128 * gib) == 1  # at least one block
    with pytest.raises(ValueError, match="over half"):
        area_blocks(100_000, mib, 70 * 1024, 128 * gib)


@pytest.mark.parametrize("setting,mode,device,tls,want", [
    ("auto", "push", "cuda:0", "tcp,cuda_copy", True),  # GPU memory over TCP: pushkv stages it
    ("auto", "push", "cuda:0", "", False),  # UCX picks its lanes (RDMA, CUDA IPC): the transport's
    ("auto", "push", "cuda:0", "rc,cuda_copy,cuda_ipc", False),
    ("auto", "push", "cpu", "tcp", False),  # a host pool is what the transport reads already
    ("auto", "pull", "cuda:0", "tcp,cuda_copy", False),  # pull keeps the transport's staging
    ("pushkv", "push", "cpu", "", True),  # asked for: the same path on a host pool (CI's)
    ("pushkv", "pull", "cuda:0", "tcp", False),
    ("transport", "push", "cuda:0", "tcp,cuda_copy", False),
])
def test_wanted(setting, mode, device, tls, want):
    assert wanted(setting, mode, device, tls) is want


def test_config_refuses_pushkv_staging_for_pull():
    with pytest.raises(ValueError, match="staging 'pushkv' stages push"):
        DeploymentConfig(mode="pull", staging="pushkv")
    assert DeploymentConfig(mode="push", staging="pushkv").staging == "pushkv"
