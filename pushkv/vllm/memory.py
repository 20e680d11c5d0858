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

GPU (vLLM's GPU worker makes the same call, ``device=cuda:N``): with ``cuda_memory:
writer`` (the default) the hook asks the worker side for the bytes, which has this
worker's writer allocate them on the device and opens the writer's CUDA IPC handle
(``worker_side.py``, ``writer_alloc.py``): the writer then registers its own allocation
with NIXL, as pushkv's own writer does with its pool (NIXL/UCX on CUDA-IPC-imported memory
crawls). With ``cuda_memory: vllm`` the call is left to vLLM and its allocation is
exported to the writer afterwards (``cuda_kv.export``).
"""
from __future__ import annotations

import logging
import mmap
import os
from typing import Callable, Literal, Optional

import numpy as np
import torch

log = logging.getLogger(__name__)

def map_fd(fd: int, nbytes: int) -> mmap.mmap:
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def mapping_addr(mm: mmap.mmap) -> int:
    return np.frombuffer(mm, dtype=np.uint8).ctypes.data


Claim = Literal["memfd", "writer", ""]
CudaAllocator = Callable[[int, torch.device], torch.Tensor]  # (bytes, device) -> int8 tensor over them


def claim(size: tuple, kw: dict, taken: bool, cuda_memory: str) -> tuple[Claim, int]:
    """Which of the hook's ``torch.zeros`` calls is vLLM's KV buffer, and who provides it:
    ("memfd", bytes) on the CPU, ("writer", bytes) on a GPU when the writer allocates it,
    ("", 0) to leave the call to torch (another tensor, the buffer already taken, or a GPU
    cache vLLM allocates itself)."""
    dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
    if taken or kw.get("dtype") is not torch.int8 or len(dims) != 1 or int(dims[0]) <= 0:
        return "", 0
    dev = kw.get("device")
    kind = "cpu" if dev is None else torch.device(dev).type
    if kind == "cpu":
        return "memfd", int(dims[0])
    if kind == "cuda" and cuda_memory == "writer":
        return "writer", int(dims[0])
    return "", 0


class SharedKVAllocation:
    """Context manager: the KV cache buffer vLLM allocates inside it is shared with the writer
    (a memfd on the CPU; on a GPU, with ``cuda_allocator`` set, the writer's allocation)."""

    def __init__(self, name: str, cuda_memory: str = "writer", cuda_allocator: Optional[CudaAllocator] = None):
        self.name = name
        self.cuda_memory = cuda_memory
        self.cuda_allocator = cuda_allocator
        self.fd = -1
        self.mm: Optional[mmap.mmap] = None
        self.tensor: Optional[torch.Tensor] = None
        self.base_addr = 0
        self.nbytes = 0
        self.dev_id = -1  # the writer's GPU allocation's device; -1: the memfd (or none)
        self._orig: Optional[Callable[..., torch.Tensor]] = None

    def __enter__(self):
        orig = self._orig = torch.zeros

        def zeros(*size, **kw):
            what, nbytes = claim(size, kw, self.tensor is not None, self.cuda_memory)
            if what == "memfd":
                return self._allocate(nbytes)
            if what == "writer" and self.cuda_allocator is not None:
                return self._allocate_cuda(nbytes, torch.device(kw["device"]))
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

    def _allocate_cuda(self, nbytes: int, device: torch.device) -> torch.Tensor:
        assert self.cuda_allocator is not None
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        t = self.cuda_allocator(nbytes, device)
        if t.dtype is not torch.int8 or t.numel() != nbytes or t.device != device:
            raise RuntimeError(f"pushkv: the writer's KV allocation is {t.numel()} {t.dtype} on {t.device}; "
                               f"vLLM asked for {nbytes} int8 on {device}")
        self.tensor, self.nbytes, self.base_addr, self.dev_id = t, nbytes, t.data_ptr(), device.index
        log.info("pushkv: KV cache of %.1f MiB allocated by the writer on %s (mapped by CUDA IPC)",
                 nbytes / 2**20, device)
        return t



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
