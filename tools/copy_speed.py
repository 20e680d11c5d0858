"""A plain torch copy of N bytes between two devices, timed: the yardstick every transfer
benchmark here prints its figures against (measured in the same run)."""
from __future__ import annotations

import statistics
import time

import torch


def plain_copy_gbps(nbytes: int, reps: int = 11, device: str = "cpu", dst_device: str = "") -> float:
    """A plain torch copy of the same bytes; on CPU single-threaded, as UCX's copy is."""
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        return _copy_gbps(nbytes, reps, device, dst_device or device)
    finally:
        torch.set_num_threads(threads)


def _copy_gbps(nbytes: int, reps: int, device: str, dst_device: str) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device).fill_(1)  # touched, like the pools
    dst.copy_(src)  # warm
    times = []
    for _ in range(reps):
        if device != "cpu":
            torch.cuda.synchronize(src.device)
            torch.cuda.synchronize(dst.device)
        t = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize(src.device)
            torch.cuda.synchronize(dst.device)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9
