"""Thin wrapper around one NIXL agent (UCX backend).

No progress thread: UCX's progress thread busy-spins a core while idle
(measured here: 3.0 s of CPU per 3 s idle). The writer drives progress itself
by polling notifications and transfer states from its event loop, fast while
something is in flight and slowly when idle.
"""
from __future__ import annotations

import logging
import os
from typing import Iterator, Optional, Sequence

import msgspec
import numpy as np

from pushkv.transport.poster import Poster, QueuedPost

log = logging.getLogger(__name__)


class TransferError(RuntimeError):
    pass


# UCX's cuda_ipc transport turns its GET off on a GPU with no active NVLink ("platforms known
# to have slower performance"), so a READ between two pools on one GPU, or between PCIe GPUs,
# fell back to UCX's software emulation over TCP: 0.5 GB/s against a WRITE's 1.2-1.7 TB/s on an
# H200 (experiments/nixl_probe.py --op READ). A device-to-device GET is a copy engine's work either
# way, far faster than the emulation, so pushkv turns it on unless the operator chose.
CUDA_IPC_GET = ("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")


def transport_env(device: str, environ=os.environ) -> dict[str, str]:
    """UCX settings a NIXL agent on ``device`` is created with (those not set already)."""
    if device == "cpu":
        return {}
    key, value = CUDA_IPC_GET
    return {} if key in environ else {key: value}


class NixlAgent:
    """``post_thread``: transfers are made, posted and polled by a second agent on its own
    thread (``transport/poster.py``), so a post that blocks (UCX over TCP) leaves this agent,
    and the writer's loop, free to read notifications."""

    def __init__(self, name: str, backends: Sequence[str] = ("UCX",), device: str = "cpu",
                 post_thread: bool = False):
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.mem_type = "DRAM" if device == "cpu" else "VRAM"
        self.dev_id = 0 if device == "cpu" else int(device.split(":")[-1] or 0)
        os.environ.update(transport_env(device))  # UCX reads its configuration when the agent is made
        cfg = nixl_agent_config(enable_prog_thread=False, backends=list(backends))
        self._agent = nixl_agent(name, cfg)
        self._reg = None
        self.remotes: set[str] = set()
        self._local_dlist = None  # prepared list of our own pool (one per agent)
        self._remote_dlists: dict[str, object] = {}  # remote agent -> its pool's prepared list
        self.poster = Poster(f"{name}-post", self.mem_type, self.dev_id, backends) if post_thread else None

    @property
    def post_agent(self) -> str:
        """The agent our transfers (and their notifications) come from, if not this one."""
        return self.poster.name if self.poster is not None else ""

    # -- memory -------------------------------------------------------------
    def register(self, base_addr: int, nbytes: int, extra: Sequence[tuple[int, int]] = ()) -> None:
        """Register the pool (and ``extra`` (address, bytes) buffers on the same device) with NIXL."""
        regions = [(base_addr, nbytes, self.dev_id, "")] + [(a, n, self.dev_id, "") for a, n in extra]
        self._reg = self._agent.register_memory(regions, self.mem_type)
        if self.poster is not None:
            self.poster.register(regions, self.mem_type)

    def deregister(self) -> None:
        if self.poster is not None:
            self.poster.close()
        for name in list(self._remote_dlists):
            self.forget_remote_dlist(name)
        if self._local_dlist is not None:
            self._release_dlist(self._local_dlist)
            self._local_dlist = None
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None

    # -- peers --------------------------------------------------------------
    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_remote(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self.remotes.add(name)
        if self.poster is not None:
            self.poster.add_remote(metadata)
        return name

    def remove_remote(self, name: str) -> None:
        self.forget_remote_dlist(name)
        if self.poster is not None:
            self.poster.remove_remote(name)
        if name in self.remotes:
            self.remotes.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # already gone on the NIXL side
                log.debug("remove_remote_agent(%s) failed", name, exc_info=True)

    # -- notifications --------------------------------------------------------
    def send_notif(self, remote: str, payload: bytes) -> None:
        self._agent.send_notif(remote, payload)

    def poll_notifs(self) -> dict[str, list[bytes]]:
        return self._agent.get_new_notifs()

    def poll_decoded(self, decoder) -> Iterator[tuple[str, bytes, object]]:
        """Every new notification as (sender agent, payload, decoder.decode(payload)), the
        decoding error in place of the message when the payload does not decode."""
        for agent, payloads in self.poll_notifs().items():
            agent = agent.decode() if isinstance(agent, bytes) else agent
            for payload in payloads:
                try:
                    yield agent, payload, decoder.decode(payload)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    yield agent, payload, e

    # -- transfers ------------------------------------------------------------
    def post(self, op: str, regions: Sequence[tuple[int, int, int]], local_base: int,
             remote: str, remote_base: int, notif: bytes = b"", remote_dev: Optional[int] = None):
        """Post a WRITE or READ of (local_off, remote_off, nbytes) regions; returns a handle."""
        rdev = self.dev_id if remote_dev is None else remote_dev
        local = [(local_base + lo, n, self.dev_id) for lo, _, n in regions]
        rem = [(remote_base + ro, n, rdev) for _, ro, n in regions]
        if self.poster is not None:
            return self.poster.submit(QueuedPost(op, local, remote, rem, notif, prepared=False))
        ldesc = self._agent.get_xfer_descs(local, self.mem_type)
        rdesc = self._agent.get_xfer_descs(rem, self.mem_type)
        handle = self._agent.initialize_xfer(op, ldesc, rdesc, remote, notif)
        state = self._agent.transfer(handle)
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransferError(f"{op} to {remote} failed to post")
        return handle

    # -- prepared descriptor lists: build once, post by index -----------------------
    def prepare_local(self, rows: np.ndarray) -> None:
        """Our pool's descriptors, as Nx5 strided rows (address, len, device, stride, count)."""
        if self._local_dlist is not None:
            self._release_dlist(self._local_dlist)
        self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self.mem_type)
        if self.poster is not None:
            self.poster.prepare_local(rows)

    def prepare_remote(self, remote: str, rows: np.ndarray) -> None:
        """A peer's pool descriptors (its metadata must be loaded: ``add_remote``)."""
        self.forget_remote_dlist(remote)
        self._remote_dlists[remote] = self._agent.prep_xfer_dlist(remote, rows, self.mem_type)
        if self.poster is not None:
            self.poster.prepare_remote(remote, rows)

    def has_prepared(self, remote: str) -> bool:
        return self._local_dlist is not None and remote in self._remote_dlists

    def forget_remote_dlist(self, remote: str) -> None:
        h = self._remote_dlists.pop(remote, None)
        if h is not None:
            self._release_dlist(h)
        if self.poster is not None:
            self.poster.forget_remote_dlist(remote)

    def _release_dlist(self, handle) -> None:
        try:
            self._agent.release_dlist_handle(handle)
        except Exception:
            log.debug("release_dlist_handle failed", exc_info=True)

    def post_prepped(self, op: str, local_idx: np.ndarray, remote: str, remote_idx: np.ndarray,
                     notif: bytes = b""):
        """Post a WRITE or READ of prepared descriptors by index (pairwise equal sizes);
        NIXL joins runs contiguous on both sides into one descriptor."""
        if self.poster is not None:
            return self.poster.submit(QueuedPost(op, local_idx, remote, remote_idx, notif, prepared=True))
        handle = self._agent.make_prepped_xfer(op, self._local_dlist, local_idx,
                                               self._remote_dlists[remote], remote_idx, notif)
        state = self._agent.transfer(handle)
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransferError(f"{op} to {remote} failed to post")
        return handle

    def state(self, handle) -> str:
        """'DONE', 'PROC' or 'ERR'."""
        if isinstance(handle, QueuedPost):
            return handle.state
        return self._agent.check_xfer_state(handle)

    def reap(self, handles, failed: str, stuck: str = "") -> tuple[list, str]:
        """Release the handles whose transfer ended; return (those still in flight, the first
        failure or ''). A handle whose state cannot be read, or is ERR, fails (with the error, or
        ``failed``); with ``stuck``, one still in flight is abandoned (released) and fails with it."""
        pending, failure = [], ""
        for h in handles:
            try:
                st = self.state(h)
            except Exception as e:
                st, failure = "ERR", failure or str(e)
            if st == "PROC" and stuck:
                st, failure = "ERR", failure or stuck
            if st not in ("DONE", "ERR"):
                pending.append(h)
                continue
            if st == "ERR":
                failure = failure or (h.error if isinstance(h, QueuedPost) and h.error else failed)
            self.release(h)
        return pending, failure

    def release(self, handle) -> None:
        if isinstance(handle, QueuedPost):  # the poster releases it (at once if it is still in flight)
            handle.abandoned = True
            return
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            log.debug("release_xfer_handle failed", exc_info=True)
