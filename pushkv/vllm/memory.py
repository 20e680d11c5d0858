"""vLLM's KV cache in shared memory, so the writer process can register it with NIXL.

vLLM 0.32 allocates a worker's whole KV cache as one flat int8 buffer
(``vllm.v1.worker.utils.allocate_kv_cache``: ``torch.zeros(n, dtype=int8)``)
inside the context manager the connector returns from
``get_mem_pool_context()``. :class:`SharedKVAllocation` is that context: for the
one 1-D int8 CPU ``torch.zeros`` call made inside it, it returns a tensor over
an anonymous shared-memory file (``memfd_create``) instead; each writer
incarnation inherits the file descriptor, so no name is ever left in /dev/shm,
even after a ``kill -9``. vLLM's per-layer views are views of it, so the
model writes its KV straight into pages the writer maps too: no staging copy,
no copy at transfer time. The writer maps the file and registers it with NIXL
as DRAM; UCX moves P's pages into D's writer's mapping of D's file (cma).

GPU (not built here): the same hook would allocate in the writer (CUDA IPC into
a writer-owned allocation), as pushkv's own writer does.
"""
from __future__ import annotations

import logging
import mmap
import os
from typing import Callable, Optional

import numpy as np
import torch

log = logging.getLogger(__name__)

def map_fd(fd: int, nbytes: int) -> mmap.mmap:
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def mapping_addr(mm: mmap.mmap) -> int:
    return np.frombuffer(mm, dtype=np.uint8).ctypes.data


class SharedKVAllocation:
    """Context manager: the KV cache buffer vLLM allocates inside it lives in /dev/shm."""

    def __init__(self, name: str):
        self.name = name
        self.fd = -1
        self.mm: Optional[mmap.mmap] = None
        self.tensor: Optional[torch.Tensor] = None
        self.base_addr = 0
        self.nbytes = 0
        self._orig: Optional[Callable[..., torch.Tensor]] = None

    def __enter__(self):
        orig = self._orig = torch.zeros

        def zeros(*size, **kw):
            dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            dev = kw.get("device")
            on_cpu = dev is None or torch.device(dev).type == "cpu"
            if (self.tensor is None and kw.get("dtype") is torch.int8 and on_cpu
                    and len(dims) == 1 and int(dims[0]) > 0):
                return self._allocate(int(dims[0]))
            return orig(*size, **kw)

        torch.zeros = zeros
        return self

    def __exit__(self, *exc) -> None:
        torch.zeros = self._orig

    def _allocate(self, nbytes: int) -> torch.Tensor:
        self.fd = os.memfd_create(self.name)  # close-on-exec; handed to each writer explicitly
        os.ftruncate(self.fd, nbytes)
        self.mm = map_fd(self.fd, nbytes)
        self.nbytes = nbytes
        self.base_addr = mapping_addr(self.mm)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.int8)
        self.tensor.zero_()  # touch every page now, not on the first forward or WRITE
        log.info("pushkv: KV cache of %.1f MiB allocated in shared memory (memfd %s)", nbytes / 2**20, self.name)
        return self.tensor



def open_for_writer(fd: int, cuda_ipc_hex: str, nbytes: int) -> tuple[object, int, int]:
    """The writer's view of the worker's KV cache: (what keeps it mapped, base address, CUDA
    device or -1): the inherited memfd mapped, or the GPU storage opened by CUDA IPC."""
    if cuda_ipc_hex:
        from pushkv.vllm.cuda_kv import SharedKV

        shared = SharedKV(bytes.fromhex(cuda_ipc_hex))
        if shared.nbytes < nbytes:
            raise ValueError(f"the shared KV storage holds {shared.nbytes} B, the description {nbytes} B")
        return shared, shared.base_addr, shared.dev_id
    mm = map_fd(fd, nbytes)
    return mm, mapping_addr(mm), -1
