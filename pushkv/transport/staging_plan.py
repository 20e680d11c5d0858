"""What pushkv's own staging copies and how large its area is (pure: numpy, no torch, no NIXL).

With ``--staging pushkv`` a writer keeps a pinned host **staging area** laid out as its pool but
with fewer blocks (``area_blocks``); transfers move between areas, and a writer copies between
its pool's blocks and its area's blocks ("slots"). ``block_pairs`` lists those copies as
``(pool offset, area offset, nbytes)``, one per run of blocks and slots contiguous on both
sides in each grid region (``transport/grid.py``), so a request's contiguous blocks cost one
copy per region rather than one per block; ``group_regions`` picks the regions of some layer
groups (a layer-streamed part carries only its group). ``wanted`` says when a writer stages.
Which slots a WRITE takes, and the queue of waits for them, are ``transport/stage_slots.py``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from pushkv.kv import layout as L
from pushkv.messages import KVLayoutDesc
from pushkv.transport.grid import DescGrid

Runs = list[tuple[int, int]]  # (byte offset from the pool base, nbytes), ascending, disjoint


def merged(offs: np.ndarray, lens: np.ndarray) -> Runs:
    """``(offset, nbytes)`` runs covering the given ones, sorted, joined where they touch or
    overlap; empty runs dropped."""
    keep = lens > 0
    offs, lens = np.asarray(offs, dtype=np.int64)[keep], np.asarray(lens, dtype=np.int64)[keep]
    if not len(offs):
        return []
    order = np.argsort(offs, kind="stable")
    offs, ends = offs[order], offs[order] + lens[order]
    reach = np.maximum.accumulate(ends)
    starts = np.concatenate([[True], offs[1:] > reach[:-1]])  # a gap before it: a new run
    first = np.flatnonzero(starts)
    last = np.concatenate([first[1:] - 1, [len(offs) - 1]])
    return list(zip(offs[first].tolist(), (reach[last] - offs[first]).tolist()))


def total(runs: Runs) -> int:
    return sum(n for _, n in runs)


AUTO_HOST_SHARE = 16  # auto: each writer's staging area takes at most 1/16 of the host's memory
MAX_HOST_SHARE = 2  # one asked for (--staging-mib) over half of it is refused


def wanted(setting: str, mode: str, device: str, ucx_tls: str) -> bool:
    """Whether a writer stages its pool itself (``DeploymentConfig.staging``): ``pushkv`` /
    ``transport``, or ``auto``: for push on a GPU pool when ``UCX_TLS`` limits UCX to TCP for the
    network (where UCX would stage it fragment by fragment), never on the CPU (a host pool is
    what the transport reads already; ``pushkv`` there runs the same path through a second host
    copy, which is how CI tests it). Pull keeps the transport's staging."""
    from pushkv.transport.poster import wanted as tcp_only

    if mode != "push" or setting == "transport":
        return False
    if setting == "pushkv":
        return True
    return device != "cpu" and tcp_only("auto", ucx_tls)


def area_blocks(pool_blocks: int, block_bytes: int, staging_mib: int, host_bytes: int) -> int:
    """Blocks of a writer's staging area: ``staging_mib`` MiB of them, or (0) as many as
    1/``AUTO_HOST_SHARE`` of the host's memory holds; never more than the pool's, at least one.
    ValueError for an area over half the host's memory."""
    if staging_mib:
        if host_bytes and staging_mib * 2**20 * MAX_HOST_SHARE > host_bytes:
            raise ValueError(f"--staging-mib {staging_mib} is over half of this host's "
                             f"{host_bytes / 2**30:.1f} GiB of memory (each writer pins that much)")
        n = staging_mib * 2**20 // block_bytes
    else:
        n = host_bytes // AUTO_HOST_SHARE // block_bytes if host_bytes else pool_blocks
    return max(1, min(pool_blocks, n))


def host_memory_bytes() -> int:
    """This host's physical memory (0: unknown)."""
    import os

    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def group_regions(lay: KVLayoutDesc, groups: Optional[Sequence[int]]) -> list[int]:
    """The grid regions (``transport/grid.py``: layer group major, then head group) of layer
    ``groups`` (None: all of them)."""
    hg = L.head_groups(lay)
    gs = range(len(L.layer_groups(lay))) if groups is None else groups
    return [g * hg + k for g in gs for k in range(hg)]


Pairs = list[tuple[int, int, int]]  # (pool offset, staging offset, nbytes)


def block_pairs(lay: KVLayoutDesc, pool: DescGrid, area: DescGrid, blocks: Sequence[int], slots: Sequence[int],
                regions: Optional[Sequence[int]] = None) -> Pairs:
    """The copies between pool ``blocks`` and the staging area's ``slots`` (pairwise), in grid
    ``regions`` (None: all): one ``(pool offset, staging offset, nbytes)`` per run of blocks and
    slots that are contiguous on both sides, per region. The two grids are of the same layout
    but for their block counts."""
    if len(blocks) != len(slots):
        raise ValueError(f"{len(blocks)} blocks for {len(slots)} staging slots")
    if not len(blocks):
        return []
    m = L.subs_per_block(lay)
    b, s = np.asarray(blocks, dtype=np.int64), np.asarray(slots, dtype=np.int64)
    # runs: where the next block and slot both follow on
    brk = np.flatnonzero((np.diff(b) != 1) | (np.diff(s) != 1)) + 1
    first = np.concatenate([[0], brk])
    count = np.diff(np.concatenate([first, [len(b)]]))
    out: Pairs = []
    for r in (range(len(pool.base)) if regions is None else regions):
        piece = m * int(pool.elem[r])  # one block's bytes in this region
        pb, ab = int(pool.base[r]), int(area.base[r])
        out.extend((pb + int(b[i]) * piece, ab + int(s[i]) * piece, int(c) * piece)
                   for i, c in zip(first.tolist(), count.tolist()))
    return out
