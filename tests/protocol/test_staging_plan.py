"""pushkv's own staging, the pure part (transport/staging_plan.py): which byte runs of the pool a
staged WRITE copies out and a staged arrival copies in, and when a writer stages at all.

Every run list is checked against the byte set it must cover, computed the slow way (one
descriptor or one block region at a time), so a run that misses or adds a byte fails."""
from __future__ import annotations

import numpy as np
import pytest

from pushkv.config import DeploymentConfig, ModelConfig
from pushkv.kv import layout as L
from pushkv.transport.grid import grid_of, index_plan, plan_indices
from pushkv.transport.staging_plan import merged, runs_of_blocks, runs_of_indices, runs_of_regions, total, wanted


def covered(runs) -> set[int]:
    return {b for off, n in runs for b in range(off, off + n)}


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


@pytest.mark.parametrize("kw", [{}, {"sub_block": 4}, {"head_group": 2}, {"layer_split": 2}])
def test_runs_of_blocks_cover_exactly_those_blocks_in_every_region(kw):
    la = lay(**kw)
    grid = grid_of(la)
    blocks = [3, 4, 5, 9, 0]
    runs = runs_of_blocks(la, grid, blocks)
    want = set()
    for r in range(len(grid.base)):
        for p in L.expand_table(la, blocks):
            start = int(grid.base[r] + p * grid.elem[r])
            want |= set(range(start, start + int(grid.elem[r])))
    assert covered(runs) == want and total(runs) == len(want)
    # contiguous blocks join: at most one run per region per contiguous stretch of blocks (0, 3-5, 9)
    assert len(runs) <= 3 * len(grid.base)
    assert all(a + n < b for (a, n), (b, _) in zip(runs, runs[1:]))  # disjoint, sorted, not touching
    with pytest.raises(ValueError):
        runs_of_blocks(la, grid, [la.num_blocks])


def test_runs_of_indices_are_the_descriptors_bytes():
    la = lay(layer_split=2)
    grid = grid_of(la)
    plan = index_plan(la, la, None)
    src, _, nbytes, _ = plan_indices(plan, [2, 3, 7], [0, 1, 2], 20, None)
    runs = runs_of_indices(grid, src)
    want = set()
    for i in np.asarray(src).tolist():
        r = int(np.searchsorted(grid.first, i, side="right") - 1)
        start = int(grid.base[r] + (i - grid.first[r]) * grid.elem[r])
        want |= set(range(start, start + int(grid.elem[r])))
    assert covered(runs) == want and total(runs) == nbytes
    assert runs_of_indices(grid, []) == []
    with pytest.raises(ValueError):
        runs_of_indices(grid, [grid.size])


def test_runs_of_regions_take_the_local_side():
    assert runs_of_regions([(0, 100, 8), (8, 500, 8), (40, 0, 4)]) == [(0, 16), (40, 4)]
    assert runs_of_regions([]) == []


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


def test_the_mirror_must_fit_the_host():
    gib = 2**30
    assert wanted("auto", "push", "cuda:0", "tcp,cuda_copy", 4 * gib, 128 * gib)
    assert not wanted("auto", "push", "cuda:0", "tcp,cuda_copy", 40 * gib, 128 * gib)  # auto: the transport's
    assert wanted("pushkv", "push", "cuda:0", "", 40 * gib, 128 * gib)  # asked for, and it fits
    with pytest.raises(ValueError, match="lower --num-blocks or use --staging transport"):
        wanted("pushkv", "push", "cuda:0", "", 70 * gib, 128 * gib)


def test_config_refuses_pushkv_staging_for_pull():
    with pytest.raises(ValueError, match="staging 'pushkv' stages push"):
        DeploymentConfig(mode="pull", staging="pushkv")
    assert DeploymentConfig(mode="push", staging="pushkv").staging == "pushkv"
