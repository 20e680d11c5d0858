"""What a writer registered with NIXL, as its posts see it.

One description for every writer: the base address and size of the memory holding the KV
(pushkv's pool, or vLLM's KV cache), the device it is on, how it is laid out (a pushkv pool
layout, or vLLM's KVMemory) and, when its blocks fall on a regular grid, the descriptor grid
prepared in NIXL once so that transfers name descriptors by index. A transfer's byte regions
are offsets from these bases, on both sides.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from pushkv.transport.grid import DescGrid
from pushkv.transport.nixl_agent import NixlAgent

log = logging.getLogger(__name__)


@dataclass
class Memory:
    base_addr: int
    nbytes: int
    layout: Any  # pushkv's KVLayoutDesc, or vLLM's KVMemory
    dev_id: int = 0
    grid: Optional[DescGrid] = None  # prepared in NIXL; None: every post builds its descriptors
    extra: list[tuple[int, int]] = field(default_factory=list)  # (addr, nbytes) registered beside it


def register(nixl: NixlAgent, mem: Memory, grid: Optional[DescGrid] = None, name: str = "") -> None:
    """Register ``mem`` (and its extra regions) with ``nixl``; prepare ``grid``'s descriptors
    over it, when given. A grid that cannot be prepared leaves ``mem.grid`` None: every
    transfer then builds its own descriptors."""
    nixl.register(mem.base_addr, mem.nbytes, mem.extra)
    if grid is None:
        return
    try:
        nixl.prepare_local(grid.strided(mem.base_addr, nixl.dev_id))
        mem.grid = grid
    except Exception as e:
        log.warning("%s: cannot prepare the pool's descriptors (ad-hoc posts instead): %s", name, e)
