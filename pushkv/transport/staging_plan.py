"""What pushkv's own staging copies, as byte runs of the pool (pure: numpy, no torch, no NIXL).

With ``--staging pushkv`` a writer keeps a host mirror of its GPU pool laid out byte for byte
as the pool, so a transfer's regions are the same offsets in both: P copies a WRITE's local
bytes from the pool to the mirror before it posts, and D copies a transfer's destination
blocks from the mirror to the pool once every producer's WRITE has landed. Each copy is a list
of ``(offset, nbytes)`` runs, merged where they touch, so a request's contiguous blocks cost
one copy per pool region rather than one per descriptor.

- ``runs_of_indices``: the local descriptor indices of a planned post (``transport/grid.py``);
- ``runs_of_regions``: the local side of a post's ``(local, remote, nbytes)`` byte regions;
- ``runs_of_blocks``: whole blocks of a pool, in every region (D's landed blocks).
"""
from __future__ import annotations

from typing import Iterable, Sequence

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


def runs_of_indices(grid: DescGrid, idx: Sequence[int] | np.ndarray) -> Runs:
    """The byte runs of descriptors ``idx`` of ``grid``."""
    idx = np.asarray(idx, dtype=np.int64)
    if not len(idx):
        return []
    if (idx < 0).any() or (idx >= grid.size).any():
        raise ValueError(f"descriptor index out of the grid's {grid.size}")
    r = np.searchsorted(grid.first, idx, side="right") - 1
    return merged(grid.base[r] + (idx - grid.first[r]) * grid.elem[r], grid.elem[r])


def runs_of_regions(regions: Iterable[tuple[int, int, int]]) -> Runs:
    """The byte runs of the local side of ``(local offset, remote offset, nbytes)`` regions."""
    rows = np.asarray([(lo, n) for lo, _, n in regions], dtype=np.int64).reshape(-1, 2)
    return merged(rows[:, 0], rows[:, 1])


def runs_of_blocks(lay: KVLayoutDesc, grid: DescGrid, block_ids: Sequence[int]) -> Runs:
    """The byte runs of whole logical blocks ``block_ids`` of a pool laid out as ``lay``, in every
    region (layer group and head group) of its grid."""
    if not len(block_ids):
        return []
    if min(block_ids) < 0 or max(block_ids) >= lay.num_blocks:
        raise ValueError(f"block id out of the pool's {lay.num_blocks} blocks")
    phys = np.asarray(L.expand_table(lay, block_ids), dtype=np.int64)
    offs = (grid.base[:, None] + phys[None, :] * grid.elem[:, None]).ravel()
    lens = np.broadcast_to(grid.elem[:, None], (len(grid.base), len(phys))).ravel()
    return merged(offs, lens)


def total(runs: Runs) -> int:
    return sum(n for _, n in runs)


AUTO_HOST_SHARE = 8  # auto stages through a mirror only when it takes at most 1/8 of the host's memory
MAX_HOST_SHARE = 2  # and refuses one over half of it when asked for


def wanted(setting: str, mode: str, device: str, ucx_tls: str, pool_bytes: int = 0, host_bytes: int = 0) -> bool:
    """Whether a writer stages its pool itself (``DeploymentConfig.staging``): ``pushkv`` /
    ``transport``, or ``auto``: for push on a GPU pool when ``UCX_TLS`` limits UCX to TCP for the
    network (where UCX would stage it fragment by fragment), never on the CPU (a host pool is
    what the transport reads already; ``pushkv`` there runs the same path through a second host
    copy, which is how CI tests it). Pull keeps the transport's staging.

    The mirror is pinned host memory the size of the pool (``pool_bytes``): auto takes it only
    when it is at most 1/``AUTO_HOST_SHARE`` of ``host_bytes``, and ``pushkv`` over half of it is
    refused (ValueError) rather than left to the OOM killer."""
    from pushkv.transport.poster import wanted as tcp_only

    if mode != "push" or setting == "transport":
        return False
    fits = not host_bytes or pool_bytes * AUTO_HOST_SHARE <= host_bytes
    if setting == "pushkv":
        if host_bytes and pool_bytes * MAX_HOST_SHARE > host_bytes:
            raise ValueError(f"--staging pushkv mirrors the KV pool ({pool_bytes / 2**30:.1f} GiB) in pinned host "
                             f"memory, over half of this host's {host_bytes / 2**30:.1f} GiB: lower --num-blocks or "
                             "use --staging transport")
        return True
    return device != "cpu" and tcp_only("auto", ucx_tls) and fits


def host_memory_bytes() -> int:
    """This host's physical memory (0: unknown)."""
    import os

    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0
