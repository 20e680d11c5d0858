"""KV pool memory: the writer allocates and owns it, the worker maps it.

CPU (``PoolHandle.kind == "shm"``): a file in /dev/shm named
``pushkv-<deployment>-<role>-<rank>-<writer pid>`` mapped by both processes (the
supervisor unlinks leftovers by that prefix). GPU (``"cuda_ipc"``): the writer
allocates the pool with torch on its device (NIXL registers that as VRAM) and
exports torch's CUDA IPC handle fields in ``PoolHandle.ipc``; the worker opens
them. The handle reaches the worker through the supervisor (``kv.handle``).
"""
from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from typing import Mapping, Optional

import msgspec
import numpy as np
import torch

from pushkv import envs
from pushkv.config import SHM_DIR, shm_name  # noqa: F401  (shm_name: the pool's users name it from here)
from pushkv.dtypes import TORCH_DTYPES
from pushkv.kv import layout as L
from pushkv.kv.handle import POOL_ENV, handle_from_env
from pushkv.messages import KVLayoutDesc, PoolHandle

POOL_WAIT_S = 60.0  # a worker waits this long for its writer's pool to appear


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
        handle = PoolHandle(kind="cuda_ipc", name="", nbytes=nbytes, dtype=dtype, shape=tuple(t.shape),
                            ipc=export_cuda(t))
        return Pool(handle=handle, tensor=t, base_addr=t.data_ptr(), owner=True)
    path = os.path.join(SHM_DIR, name)
    tmp = path + ".init"
    mm = _map_file(tmp, nbytes, create=True)
    t, addr = _view(mm, lay, dtype)
    t.view(-1).view(torch.uint8).zero_()  # pre-fault every page
    os.rename(tmp, path)  # visible to workers only once complete
    handle = PoolHandle(kind="shm", name=path, nbytes=nbytes, dtype=dtype, shape=L.pool_shape(lay))
    return Pool(handle=handle, tensor=t, base_addr=addr, owner=True, _mm=mm)


def export_cuda(t: torch.Tensor) -> bytes:
    """The CUDA IPC handle fields of ``t``'s storage, msgpack-encoded (no pickle)."""
    return msgspec.msgpack.encode(list(t.untyped_storage()._share_cuda_()))


def open_cuda(blob: bytes) -> torch.UntypedStorage:
    """Another process's storage from its ``export_cuda`` handle, on its device (made current)."""
    fields = msgspec.msgpack.decode(blob)
    torch.cuda.set_device(int(fields[0]))
    return torch.UntypedStorage._new_shared_cuda(*fields)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _attach_cuda(handle: PoolHandle, lay: KVLayoutDesc) -> Pool:
    storage = open_cuda(handle.ipc)
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=TORCH_DTYPES[handle.dtype], _internal=True)
    shape = L.pool_shape(lay)
    t = torch._utils._rebuild_tensor(typed, 0, shape, _contiguous_strides(shape))
    return Pool(handle=handle, tensor=t, base_addr=t.data_ptr(), owner=False)


def attach_pool(handle: PoolHandle, lay: KVLayoutDesc) -> Pool:
    """Map a pool another process owns (worker side, or tests)."""
    want = L.pool_bytes(lay)
    if handle.nbytes != want or tuple(handle.shape) != L.pool_shape(lay):
        raise ValueError(f"pool {handle.name or handle.kind} is {handle.nbytes} B shaped {tuple(handle.shape)}; "
                         f"this layout needs {want} B shaped {L.pool_shape(lay)}")
    if handle.dtype not in TORCH_DTYPES:
        raise ValueError(f"pool dtype {handle.dtype!r} unknown (known: {sorted(TORCH_DTYPES)})")
    if handle.kind == "cuda_ipc":
        if not handle.ipc:
            raise ValueError("cuda_ipc pool handle without its IPC handle")
        return _attach_cuda(handle, lay)
    if handle.kind != "shm":
        raise NotImplementedError(f"pool kind {handle.kind!r} is not supported on this build")
    mm = _map_file(handle.name, handle.nbytes, create=False)
    t, addr = _view(mm, lay, handle.dtype)
    return Pool(handle=handle, tensor=t, base_addr=addr, owner=False, _mm=mm)


def attach_worker_pool(env: Optional[Mapping[str, str]], deployment_id: str, role: str, rank: int,
                       lay: KVLayoutDesc, dtype: str, wait_s: float = POOL_WAIT_S) -> Pool:
    """The pool a worker maps: the handle the supervisor passed (``POOL_ENV``), else the
    writer's un-numbered segment (children started without a supervisor). A CPU pool
    appears atomically (renamed when complete); wait for it."""
    passed: str = envs.get(POOL_ENV, env)
    if passed:
        handle = handle_from_env(passed)
    else:
        handle = PoolHandle("shm", os.path.join(SHM_DIR, shm_name(deployment_id, role, rank)),
                            L.pool_bytes(lay), dtype, L.pool_shape(lay))
    if handle.kind == "shm":
        deadline = time.monotonic() + wait_s
        while not os.path.exists(handle.name):
            if time.monotonic() > deadline:
                raise RuntimeError(f"KV pool {handle.name} did not appear within {wait_s:.0f}s (writer dead?)")
            time.sleep(0.02)  # a file, not a socket: nothing to wait on
    return attach_pool(handle, lay)
