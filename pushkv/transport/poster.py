"""A second NIXL agent of a writer's, posting transfers from its own thread.

Over UCX's TCP transport the post call itself moves the data: a 64 MiB WRITE from GPU memory
returned from ``transfer`` after 130-660 ms, when it was done, and the same from host memory
(experiments/post_thread_probe.py). A writer that posts on its loop's thread then reads no
notification meanwhile, so at load D's registrations wait behind every WRITE before them.

A thread posting on the *same* agent does not help: NIXL serialises the agent's calls (sync
mode STRICT or RW), and the loop's ``get_new_notifs`` waited for the whole post (the probe:
one poll in 160 ms). A second agent has its own UCX worker and no lock shared with the first:
the loop kept reading notifications while it posted. So the poster owns one agent, registers
the same memory, loads the same peers, and makes, posts, polls and releases every transfer on
its thread; the writer's thread only queues a post and reads its state. The transfer's
notification comes from the poster's agent, which the peer learns from ``Hello.post_agent``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from pushkv.config import Switch

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # nothing queued or in flight: wait for a post this long at a time
BUSY_WAIT_S = 20e-6  # transfers in flight: poll them again after this (the GIL goes to the loop meanwhile)
NON_RDMA_LANES = ("tcp", "cuda_copy", "self", "sm", "posix", "sysv", "cma", "knem", "xpmem")


def wanted(setting: Switch, ucx_tls: str) -> bool:
    """Whether a writer posts from a poster: ``on``/``off``, or ``auto``: when UCX is limited
    (``UCX_TLS``) to TCP for the network, where a post blocks for the whole transfer; not
    with RDMA or CUDA IPC lanes, whose posts return at once (and where a thread's hop would
    only add latency), nor when UCX picks its lanes itself."""
    if setting in ("on", "off"):
        return setting == "on"
    lanes = [t.strip() for t in ucx_tls.lower().split(",") if t.strip()]
    if not lanes or lanes[0].startswith("^"):
        return False
    return "tcp" in lanes and all(t in NON_RDMA_LANES for t in lanes)


@dataclass
class QueuedPost:
    """One transfer handed to the poster. ``state`` is the writer's to read: PROC until the
    transfer ends, then DONE or ERR (``error`` says why)."""

    op: str
    local: object  # prepared: local indices; ad hoc: [(addr, nbytes, dev)]
    remote: str
    remote_spec: object  # prepared: remote indices; ad hoc: [(addr, nbytes, dev)]
    notif: bytes
    prepared: bool
    state: str = "PROC"
    error: str = ""
    abandoned: bool = False
    handle: object = field(default=None, repr=False)
    # wall times (the writer's per-WRITE stamps): this thread took it, its post call returned (over
    # TCP the bytes moved inside it), it saw it end
    picked: float = 0.0
    returned: float = 0.0
    ended: float = 0.0


class Poster:
    def __init__(self, name: str, mem_type: str, dev_id: int, backends: Sequence[str]):
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.mem_type = mem_type
        self.dev_id = dev_id
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=list(backends)))
        self._lock = threading.Lock()  # every call into the agent: the writer's setup calls and our posts
        self._cv = threading.Condition()
        self._queue: deque[QueuedPost] = deque()
        self._live: list[QueuedPost] = []  # posted, not ended (this thread's alone)
        self._local_dlist = None
        self._remote_dlists: dict[str, object] = {}
        self._reg = None
        self._stop = False
        self.posts = 0
        self._thread = threading.Thread(target=self._run, name=f"{name}-poster", daemon=True)
        self._thread.start()

    # -- the writer's thread: setup, mirrored from the writer's own agent ---------------
    def register(self, regions, mem_type: str) -> None:
        with self._lock:
            self._reg = self._agent.register_memory(regions, mem_type)

    def add_remote(self, metadata: bytes) -> None:
        with self._lock:
            self._agent.add_remote_agent(metadata)

    def remove_remote(self, name: str) -> None:
        with self._lock:
            self._drop_remote_dlist(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # never loaded, or already gone
                log.debug("%s: remove_remote_agent(%s) failed", self.name, name, exc_info=True)

    def prepare_local(self, rows) -> None:
        with self._lock:
            if self._local_dlist is not None:
                self._agent.release_dlist_handle(self._local_dlist)
            self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self.mem_type)

    def prepare_remote(self, remote: str, rows) -> None:
        with self._lock:
            self._drop_remote_dlist(remote)
            self._remote_dlists[remote] = self._agent.prep_xfer_dlist(remote, rows, self.mem_type)

    def forget_remote_dlist(self, remote: str) -> None:
        with self._lock:
            self._drop_remote_dlist(remote)

    def submit(self, post: QueuedPost) -> QueuedPost:
        with self._cv:
            self._queue.append(post)
            self._cv.notify()
        return post

    def close(self) -> None:
        """Stop the thread (transfers still in flight are released), then free the agent's memory."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(10)
        with self._lock:
            for name in list(self._remote_dlists):
                self._drop_remote_dlist(name)
            if self._local_dlist is not None:
                self._agent.release_dlist_handle(self._local_dlist)
                self._local_dlist = None
            if self._reg is not None:
                self._agent.deregister_memory(self._reg)
                self._reg = None

    # -- the poster's thread ------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._queue and not self._live and not self._stop:
                    self._cv.wait(IDLE_WAIT_S)
                if self._stop:
                    break
                new = list(self._queue)
                self._queue.clear()
            for p in new:
                self._post(p)
            self._poll()
            if self._live:
                time.sleep(BUSY_WAIT_S)
        for p in self._live + list(self._queue):
            self._end(p, "ERR", "writer stopping")

    def _post(self, p: QueuedPost) -> None:
        if p.abandoned:
            self._end(p, "ERR", "abandoned before its post")
            return
        p.picked = time.time()
        try:
            with self._lock:  # over TCP this holds for the whole transfer: only our own agent waits
                p.handle = self._make(p)
                st = self._agent.transfer(p.handle)
        except Exception as e:
            self._end(p, "ERR", f"{p.op} to {p.remote} failed to post: {e}")
            return
        self.posts += 1
        p.returned = time.time()
        if st == "ERR":
            self._end(p, "ERR", f"{p.op} to {p.remote} failed to post")
        else:
            self._live.append(p)

    def _make(self, p: QueuedPost):
        if p.prepared:
            return self._agent.make_prepped_xfer(p.op, self._local_dlist, p.local, self._remote_dlists[p.remote],
                                                 p.remote_spec, p.notif)
        local = self._agent.get_xfer_descs(p.local, self.mem_type)
        remote = self._agent.get_xfer_descs(p.remote_spec, self.mem_type)
        return self._agent.initialize_xfer(p.op, local, remote, p.remote, p.notif)

    def _poll(self) -> None:
        still = []
        for p in self._live:
            if p.abandoned:  # the writer gave up on it (stuck, or the writer stops): release aborts it
                self._end(p, "ERR", "abandoned in flight")
                continue
            try:
                with self._lock:
                    st = self._agent.check_xfer_state(p.handle)
            except Exception as e:
                self._end(p, "ERR", str(e))
                continue
            if st in ("DONE", "ERR"):
                self._end(p, st, "" if st == "DONE" else "transfer failed in flight")
            else:
                still.append(p)
        self._live = still

    def _end(self, p: QueuedPost, state: str, error: str) -> None:
        if p.handle is not None:
            try:
                with self._lock:
                    self._agent.release_xfer_handle(p.handle)
            except Exception:
                log.debug("%s: release_xfer_handle failed", self.name, exc_info=True)
            p.handle = None
        p.error = error
        p.ended = time.time()
        p.state = state  # last: the writer's thread reads it without a lock

    def _drop_remote_dlist(self, name: str) -> None:
        h = self._remote_dlists.pop(name, None)
        if h is not None:
            try:
                self._agent.release_dlist_handle(h)
            except Exception:
                log.debug("%s: release_dlist_handle failed", self.name, exc_info=True)

