"""pushkv's own staging of a GPU pool through pinned host memory (``--staging pushkv``).

UCX over TCP cannot reach GPU memory: its ``cuda_copy`` lane stages each fragment of a WRITE
through host memory inside its progress calls, one small synchronous copy at a time, on both
sides. On a GPU busy with prefill or decode kernels each of those copies waits for the GPU
(measured on an H200: a WRITE took 0.8-1.1 s while D decoded against 0.3 s idle, and D's
writer loop was held meanwhile, so D saw the bytes 0.5-0.9 s late).

Here the writer keeps a pinned host **mirror** of its pool, laid out byte for byte as the pool,
and registers the mirror with NIXL instead of the pool (as host memory). A transfer's regions
are then the same offsets in both, so nothing in the protocol, the grids or the mapping changes:
- P copies the bytes a WRITE carries from the pool into its mirror on a copy stream, as soon as
  the WRITE is planned (it may wait in a link queue meanwhile), and posts it once that copy is
  done: the WRITE then moves host to host;
- D copies a transfer's destination blocks from its mirror into the pool on its copy stream
  once every producer rank's WRITE has landed, and reports the KV received when that copy is
  done (the loop polls the copy's event; it never waits on it).

The price is host memory the size of the pool, pinned, on each side. Which runs are copied is
pure (``transport/staging_plan.py``).
"""
from __future__ import annotations

import logging
from typing import Any

from pushkv.transport.staging_plan import Runs, total

log = logging.getLogger(__name__)


class HostMirror:
    """A pinned host copy of a GPU pool's bytes, and a copy stream between the two (a host
    pool's mirror copies at once: the CPU path CI runs)."""

    def __init__(self, pool_tensor: Any, device: str):
        import torch

        self._torch = torch
        self.gpu = pool_tensor.reshape(-1).view(torch.uint8)  # the pool's bytes (it is contiguous)
        on_gpu = device != "cpu"
        self.host = torch.empty(self.gpu.numel(), dtype=torch.uint8, pin_memory=on_gpu)
        # a host pool (CI's path through the mirror): plain copies, done when they return
        self.stream = torch.cuda.Stream(device=torch.device(device)) if on_gpu else None
        self.base_addr = self.host.data_ptr()
        self.nbytes = self.gpu.numel()
        self.copies = 0
        self.bytes_out = 0
        self.bytes_in = 0

    def _copy(self, runs: Runs, to_host: bool) -> Any:
        torch = self._torch
        self.copies += len(runs)
        if self.stream is None:
            for off, n in runs:
                dst, src = (self.host, self.gpu) if to_host else (self.gpu, self.host)
                dst[off:off + n].copy_(src[off:off + n])
            return None
        with torch.cuda.stream(self.stream):
            for off, n in runs:
                host, gpu = self.host[off:off + n], self.gpu[off:off + n]
                if to_host:
                    host.copy_(gpu, non_blocking=True)
                else:
                    gpu.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def stage_out(self, runs: Runs) -> Any:
        """Start copying ``runs`` of the pool into the mirror; returns the copy's CUDA event."""
        self.bytes_out += total(runs)
        return self._copy(runs, to_host=True)

    def stage_in(self, runs: Runs) -> Any:
        """Start copying ``runs`` of the mirror into the pool; returns the copy's CUDA event."""
        self.bytes_in += total(runs)
        return self._copy(runs, to_host=False)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # no copy may outlive the memory it reads or writes
        self.host = self.gpu = None  # type: ignore[assignment]


def done(event: Any) -> bool:
    """Whether a copy ``stage_out``/``stage_in`` started has finished (never blocks)."""
    return event is None or bool(event.query())


def wait(event: Any) -> None:
    """Block until a copy has finished (P's post path: the WRITE must not read a half copy)."""
    if event is not None:
        event.synchronize()
