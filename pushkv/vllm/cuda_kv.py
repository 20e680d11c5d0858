"""vLLM's KV cache on a GPU, shared between the worker and its writer by CUDA IPC (imports no vLLM).

``cuda_memory: writer`` (the default): the writer allocates the cache on the worker's device
(:func:`allocate_owned`, with ``cudaMalloc``: its environment has no allocator configuration,
:func:`writer_env`) and registers its own allocation with NIXL as VRAM; the worker opens the
handle (:func:`open_owned`) and vLLM's KV tensors are views of it. NIXL/UCX moves
CUDA-IPC-imported memory at ~0.5 GiB/s, its own allocation at the link's speed.

``cuda_memory: vllm`` (the fallback): the worker exports the storage under vLLM's per-layer KV
views (torch's ``_share_cuda_``: a ``cudaIpcGetMemHandle`` of the allocation, the offset of
the storage in it); the writer opens it (``_new_shared_cuda``) and registers the bytes with
NIXL as VRAM. Legacy CUDA IPC shares only ``cudaMalloc`` memory, so what it cannot share is
refused at start, with the reason: PyTorch's expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``)
and any other VMM or memory-pool allocation (the driver says the pointer is not legacy-IPC
capable).

Layer streaming (``stream.py``): ``kv/layer_events.py``'s ``EventRing`` records an inter-process CUDA
event on the worker's current stream once a layer group has stored its KV; the writer opens the
event's handle (``open_event``) and waits for it off its loop.
"""
from __future__ import annotations

import ctypes
import os
from typing import Mapping, Optional

import torch

from pushkv.cuda_driver import DriverError, _driver
from pushkv.kv.pool import export_cuda, open_cuda

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
NOT_THROUGH_HOOK = ("vLLM allocated its CUDA KV cache outside the connector's get_mem_pool_context(), so the "
                    "writer could not allocate it (cuda_memory: writer); set \"cuda_memory\": \"vllm\" in "
                    "kv_connector_extra_config to hand vLLM's own allocation to the writer instead (slower: "
                    "NIXL moves CUDA-IPC-imported memory at ~0.5 GiB/s)")


def _expandable(environ: Optional[Mapping[str, str]] = None) -> str:
    env = os.environ if environ is None else environ
    for var in ALLOC_CONF_VARS:
        conf = env.get(var, "").replace(" ", "").lower()
        if "expandable_segments:true" in conf:
            return var
    return ""


def _legacy_ipc_capable(ptr: int) -> Optional[bool]:
    """The driver's word on ``ptr`` (None: the driver cannot be asked)."""
    try:
        cuda = _driver()
    except DriverError:
        return None
    out = ctypes.c_int(0)
    rc = cuda.cuPointerGetAttribute(ctypes.byref(out), CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                    ctypes.c_uint64(ptr))
    return None if rc != 0 else bool(out.value)


def sharing_problem(t: torch.Tensor, environ: Optional[Mapping[str, str]] = None) -> str:
    """Why ``t``'s memory cannot go to the writer by CUDA IPC; "" when it can."""
    var = _expandable(environ)
    if var:
        return (f"{var} sets expandable_segments:True: PyTorch then maps memory with the CUDA VMM API, "
                "which legacy CUDA IPC cannot share with pushkv's writer; start vLLM without it")
    if _legacy_ipc_capable(t.untyped_storage().data_ptr()) is False:
        return ("the KV cache is a VMM or memory-pool allocation (cuMemCreate / cudaMallocAsync, e.g. vLLM's "
                "sleep mode or PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), which legacy CUDA IPC cannot "
                "share with pushkv's writer")
    return ""


def export(t: torch.Tensor) -> tuple[bytes, int, int]:
    """(IPC handle, base address, bytes) of the storage under ``t`` (one of vLLM's KV views):
    the handle is torch's ``_share_cuda_`` fields, msgpack-encoded (no pickle). Raises
    ValueError with the reason when the memory cannot be shared."""
    why = sharing_problem(t)
    if why:
        raise ValueError(f"pushkv: cannot hand vLLM's KV cache to the writer: {why}")
    storage = t.untyped_storage()
    return export_cuda(t), storage.data_ptr(), storage.nbytes()


def writer_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The writer's environment: the worker's, less the allocator configuration, so the cache the
    writer allocates is a plain ``cudaMalloc`` (expandable segments or ``cudaMallocAsync`` in the
    worker's would make it one that legacy CUDA IPC cannot share)."""
    return {k: v for k, v in environ.items() if k not in ALLOC_CONF_VARS}


def allocate_owned(nbytes: int, dev_id: int) -> tuple[torch.Tensor, bytes]:
    """Writer side: ``nbytes`` of zeroed device memory owned by this process, and its CUDA IPC
    handle (torch's ``_share_cuda_`` fields, msgpack). Raises ValueError with the reason when the
    allocation cannot be shared."""
    if not torch.cuda.is_available() or dev_id >= torch.cuda.device_count():
        raise ValueError(f"the writer sees no CUDA device {dev_id} (torch {torch.__version__}, "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} devices)")
    torch.cuda.set_device(dev_id)
    t = torch.zeros(nbytes, dtype=torch.int8, device=torch.device("cuda", dev_id))
    torch.cuda.synchronize(t.device)
    why = sharing_problem(t, environ={})
    if why:
        raise ValueError(f"pushkv's writer cannot share the KV cache it allocated: {why}")
    return t, export_cuda(t)


def open_owned(blob: bytes, nbytes: int) -> torch.Tensor:
    """Worker side: the writer's allocation as one flat int8 tensor (vLLM's KV buffer)."""
    storage = open_cuda(blob)
    if storage.nbytes() < nbytes:
        raise ValueError(f"the writer's KV allocation holds {storage.nbytes()} B, vLLM asked for {nbytes} B")
    t = torch.empty(0, dtype=torch.int8, device=storage.device)
    return t.set_(storage, 0, (nbytes,), (1,))


class SharedKV:
    """The writer's mapping of the worker's KV storage (kept open while the writer lives)."""

    def __init__(self, blob: bytes):
        self.storage = open_cuda(blob)
        self.dev_id = self.storage.device.index
        self.base_addr = self.storage.data_ptr()
        self.nbytes = self.storage.nbytes()
