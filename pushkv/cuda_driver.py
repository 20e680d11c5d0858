"""The CUDA driver asked directly through ctypes (``libcuda.so.1``), without torch: how many GPUs
this process sees, a GPU's compute capability, and its free and total memory. The supervisor plans and checks with these
before any child starts, in milliseconds, and stays free of torch's seconds-long import. Also the
L2 set-aside of the context current on the calling thread (``persisting_l2``), which torch does not
expose.

``CUDA_VISIBLE_DEVICES`` applies, as it does to torch: ordinal N is the Nth visible GPU.
"""
from __future__ import annotations

import ctypes
from typing import Optional

CUDA_SUCCESS = 0
CUDA_ERROR_NO_DEVICE = 100
CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


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


def capability(ordinal: int = 0) -> Optional[tuple[int, int]]:
    """Visible GPU ``ordinal``'s compute capability (major, minor), as ``torch.cuda.get_device_capability`` gives
    it; None where the driver shows no such GPU."""
    try:
        cuda = _driver()
        dev = ctypes.c_int(0)
        _call(f"cuDeviceGet({ordinal})", cuda.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(ordinal)))
        got = []
        for attr in (CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR):
            v = ctypes.c_int(0)
            _call("cuDeviceGetAttribute", cuda.cuDeviceGetAttribute(ctypes.byref(v), ctypes.c_int(attr), dev))
            got.append(v.value)
    except DriverError:
        return None
    return got[0], got[1]


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


def persisting_l2(nbytes: int | None = None) -> tuple[int, int]:
    """The L2 set-aside for persisting (evict-last) lines of the context current on this thread (torch's, once it
    has started CUDA there): with ``nbytes``, set it first, clamped to the device's most. Returns (the set-aside
    now, the device's most), in bytes. CUDA gives persisting lines their priority within the set-aside, which
    starts at 0. DriverError where no context is current."""
    cuda = _driver()
    ctx = ctypes.c_void_p(0)
    _call("cuCtxGetCurrent", cuda.cuCtxGetCurrent(ctypes.byref(ctx)))
    if not ctx.value:
        raise DriverError("no CUDA context is current on this thread (start CUDA there first, e.g. torch.cuda.init())")
    dev, most = ctypes.c_int(0), ctypes.c_int(0)
    _call("cuCtxGetDevice", cuda.cuCtxGetDevice(ctypes.byref(dev)))
    _call("cuDeviceGetAttribute(MAX_PERSISTING_L2_CACHE_SIZE)",
          cuda.cuDeviceGetAttribute(ctypes.byref(most), CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE, dev))
    if nbytes is not None:
        _call("cuCtxSetLimit(PERSISTING_L2_CACHE_SIZE)",
              cuda.cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(max(0, min(nbytes, most.value)))))
    now = ctypes.c_size_t(0)
    _call("cuCtxGetLimit(PERSISTING_L2_CACHE_SIZE)",
          cuda.cuCtxGetLimit(ctypes.byref(now), CU_LIMIT_PERSISTING_L2_CACHE_SIZE))
    return now.value, most.value
