"""The CUDA driver asked directly through ctypes (``libcuda.so.1``), without torch: how many GPUs
this process sees, and a GPU's free and total memory. The supervisor plans and checks with these
before any child starts, in milliseconds, and stays free of torch's seconds-long import.

``CUDA_VISIBLE_DEVICES`` applies, as it does to torch: ordinal N is the Nth visible GPU.
"""
from __future__ import annotations

import ctypes

CUDA_SUCCESS = 0
CUDA_ERROR_NO_DEVICE = 100


class DriverError(RuntimeError):
    """The driver is missing, does not start, or refused a call; the message says which."""


def _driver() -> ctypes.CDLL:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise DriverError("no NVIDIA driver here (libcuda.so.1 does not load)") from None
    rc = cuda.cuInit(0)
    if rc != CUDA_SUCCESS:
        raise DriverError("no GPU visible" if rc == CUDA_ERROR_NO_DEVICE
                          else f"the driver does not start (cuInit error {rc})")
    return cuda


def _call(what: str, rc: int) -> None:
    if rc != CUDA_SUCCESS:
        raise DriverError(f"{what} error {rc}")


def device_count() -> tuple[int, str]:
    """GPUs the driver shows this process, and why none when 0."""
    try:
        cuda = _driver()
    except DriverError as e:
        return 0, str(e)
    count = ctypes.c_int(0)
    rc = cuda.cuDeviceGetCount(ctypes.byref(count))
    if rc != CUDA_SUCCESS:
        return 0, f"the driver does not count its GPUs (cuDeviceGetCount error {rc})"
    return count.value, ""


def memory_info(ordinal: int) -> tuple[int, int]:
    """(free, total) bytes of visible GPU ``ordinal``, as ``torch.cuda.mem_get_info`` reports them.

    Free memory is only known inside a context: the device's primary context is retained for the
    query and released after it (released, it frees what it took), so the children that start
    afterwards find the memory as it was."""
    cuda = _driver()
    dev = ctypes.c_int(0)
    _call(f"cuDeviceGet({ordinal})", cuda.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(ordinal)))
    ctx = ctypes.c_void_p(0)
    _call("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    try:
        _call("cuCtxPushCurrent", cuda.cuCtxPushCurrent_v2(ctx))
        try:
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            _call("cuMemGetInfo", cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p(0)))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(dev)
    return free.value, total.value
