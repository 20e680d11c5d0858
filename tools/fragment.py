"""Block tables from a fragmented pool, for the layout report and its NIXL timing."""
from __future__ import annotations

from pushkv.protocol.allocator import BlockAllocator


def fragmented_table(num_blocks: int, run: int, need: int) -> list[int]:
    """Block ids a real allocator hands out when only runs of ``run`` blocks are free."""
    a = BlockAllocator(num_blocks)
    held = [a.allocate(run) for _ in range(num_blocks // run)]
    for h in held[::2]:
        a.free(h)
    ids = a.allocate(need)
    if ids is None:
        raise ValueError(f"{need} blocks do not fit a pool of {num_blocks} half free in runs of {run}")
    return ids
