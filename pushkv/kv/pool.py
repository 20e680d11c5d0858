"""KV pool memory: the writer allocates and owns it, the worker maps it.

CPU: a file in /dev/shm named ``pushkv-<deployment>-<role>-<rank>`` mapped by
both processes (the supervisor unlinks leftovers by that prefix). GPU (later):
the writer allocates with torch on its device and exports a CUDA IPC handle;
``PoolHandle.kind`` says which.
"""
from __future__ import annotations

import base64
import mmap
import os
from dataclasses import dataclass
from typing import Optional

import msgspec
import numpy as np
import torch

from pushkv.kv import layout as L
from pushkv.messages import KVLayoutDesc, PoolHandle

SHM_DIR = "/dev/shm"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shm_name(deployment_id: str, role: str, rank: int, incarnation: int = 0) -> str:
    """Pool segment name; ``incarnation`` (the writer's pid) keeps a restarted
    writer's pool apart from a dead predecessor's, which a worker may still map."""
    base = f"pushkv-{deployment_id}-{role}-{rank}"
    return f"{base}-{incarnation}" if incarnation else base


@dataclass
class Pool:
    handle: PoolHandle
    tensor: torch.Tensor  # shaped pool_shape(layout)
    base_addr: int
    owner: bool
    _mm: Optional[mmap.mmap] = None

    @property
    def nbytes(self) -> int:
        return self.handle.nbytes

    def close(self) -> None:
        """Drop the mapping; the owner also unlinks the segment (exactly once)."""
        self.tensor = None  # type: ignore[assignment]
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view still alive; the OS reclaims at exit
                pass
            self._mm = None
        if self.owner and self.handle.kind == "shm":
            try:
                os.unlink(self.handle.name)
            except FileNotFoundError:
                pass


def _map_file(path: str, nbytes: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _view(mm: mmap.mmap, lay: KVLayoutDesc, dtype: str) -> tuple[torch.Tensor, int]:
    arr = np.frombuffer(mm, dtype=np.uint8)
    addr = arr.ctypes.data
    t = torch.frombuffer(mm, dtype=torch.uint8).view(TORCH_DTYPES[dtype]).view(L.pool_shape(lay))
    return t, addr


def create_pool(name: str, lay: KVLayoutDesc, dtype: str, device: str = "cpu") -> Pool:
    """Allocate a pool (owner side). The pages are touched now, not on the first WRITE."""
    nbytes = L.pool_bytes(lay)
    if device != "cpu":
        # allocated by the writer itself: NIXL registers it as VRAM at full speed
        # (an imported CUDA IPC view registers as host memory or crawls)
        t = torch.zeros(L.pool_shape(lay), dtype=TORCH_DTYPES[dtype], device=device)
        torch.cuda.synchronize(t.device)
        handle = PoolHandle(kind="cuda_ipc", name=_export_cuda(t), nbytes=nbytes, dtype=dtype, shape=tuple(t.shape))
        return Pool(handle=handle, tensor=t, base_addr=t.data_ptr(), owner=True)
    path = os.path.join(SHM_DIR, name)
    tmp = path + ".init"
    mm = _map_file(tmp, nbytes, create=True)
    t, addr = _view(mm, lay, dtype)
    t.view(-1).view(torch.uint8).zero_()  # pre-fault every page
    os.rename(tmp, path)  # visible to workers only once complete
    handle = PoolHandle(kind="shm", name=path, nbytes=nbytes, dtype=dtype, shape=L.pool_shape(lay))
    return Pool(handle=handle, tensor=t, base_addr=addr, owner=True, _mm=mm)


CUDA_PREFIX = "cuda_ipc:"


def _export_cuda(t: torch.Tensor) -> str:
    """A printable CUDA IPC handle of ``t``'s storage (msgpack, base64; no pickle)."""
    fields = t.untyped_storage()._share_cuda_()
    return CUDA_PREFIX + base64.b64encode(msgspec.msgpack.encode(list(fields))).decode()


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _attach_cuda(spec: str, lay: KVLayoutDesc, dtype: str) -> Pool:
    fields = msgspec.msgpack.decode(base64.b64decode(spec[len(CUDA_PREFIX):]))
    dev = int(fields[0])
    torch.cuda.set_device(dev)
    storage = torch.UntypedStorage._new_shared_cuda(*fields)
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=TORCH_DTYPES[dtype], _internal=True)
    shape = L.pool_shape(lay)
    t = torch._utils._rebuild_tensor(typed, 0, shape, _contiguous_strides(shape))
    handle = PoolHandle(kind="cuda_ipc", name=spec, nbytes=L.pool_bytes(lay), dtype=dtype, shape=shape)
    return Pool(handle=handle, tensor=t, base_addr=t.data_ptr(), owner=False)


def attach_pool(handle: PoolHandle, lay: KVLayoutDesc) -> Pool:
    """Map a pool another process owns (worker side, or tests)."""
    if handle.kind == "cuda_ipc":
        return _attach_cuda(handle.name, lay, handle.dtype)
    if handle.kind != "shm":
        raise NotImplementedError(f"pool kind {handle.kind!r} is not supported on this build")
    mm = _map_file(handle.name, handle.nbytes, create=False)
    t, addr = _view(mm, lay, handle.dtype)
    return Pool(handle=handle, tensor=t, base_addr=addr, owner=False, _mm=mm)
