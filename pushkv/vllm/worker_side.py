"""The connector's worker half (one per vLLM worker process): it owns the KV
cache's shared memory, starts and supervises this worker's pushkv writer, and
turns the writer's events into vLLM's finished sends / receives.

Nothing here touches KV bytes: the model writes its KV into shared pages (a
memfd on the CPU; on a GPU, with ``cuda_memory: writer``, the writer's own
allocation, which this worker maps by CUDA IPC, or with ``cuda_memory: vllm``
vLLM's allocation handed to the writer by CUDA IPC, ``cuda_kv.py``), the writer
WRITEs them (P) or they land there (D). The writer that owns a GPU cache is
started from inside vLLM's allocation (:meth:`WorkerSide._writer_allocates`)
and told what vLLM laid out in it at ``register_kv_caches``; its death takes
the cache with it, so the worker stops (raises) instead of starting another. With
layer streaming (``stream_groups``) ``save_kv_layer`` marks each stored layer
group for the writer (``stream.py``), and ``handle_preemptions`` holds a step
whose forward may overwrite a preempted stream's blocks until the writer reads
them no more (:meth:`WorkerSide.preempted`); ``start_load_kv``, ``wait_for_layer_load``
and ``wait_for_save`` have nothing to do.

When a step is empty (vLLM keeps stepping while a transfer is pending) the
worker waits on the writer's event socket for up to ``idle_wait_ms`` instead
of returning at once, so a pending transfer does not spin a core and its
outcome is seen the moment the writer sends it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional

import msgspec
import torch
import zmq

from pushkv import limits
from pushkv import messages as m
from pushkv.kv import layer_events
from pushkv.supervisor.lifecycle import cpu_seconds
from pushkv.trace import stamp as mark
from pushkv.vllm import params as P
from pushkv.vllm import regions as R
from pushkv.vllm import stream
from pushkv.vllm import wire as w
from pushkv.vllm.cuda_kv import writer_env
from pushkv.vllm.memory import SharedKVAllocation
from pushkv.vllm.writer_args import WriterArgs

log = logging.getLogger(__name__)

WRITER_READY_S = 60.0  # a writer that neither answers nor uses CPU for this long at its start is stuck: killed
WRITER_START_CPU_S = 60.0  # and one that used this much CPU without answering spins (a start needs a few seconds)
WRITER_STOP_S = 5.0
REMEMBER = 4096


def start_verdict(cpu_s: float, cpu_at_last_look: float) -> str:
    """What a writer is that has not answered for another WRITER_READY_S at its start: "starting"
    where it used CPU since the last look (its start needs a few CPU seconds, which on a loaded
    machine take a minute or more of wall time: killing it would start the same work over),
    "stuck" where it used none (it waits on what will not come; an unreadable CPU time, -1, too),
    "spinning" past WRITER_START_CPU_S."""
    if cpu_s < 0 or cpu_s <= cpu_at_last_look:
        return "stuck"
    if cpu_s >= WRITER_START_CPU_S:
        return "spinning"
    return "starting"


def model_geometry(vllm_config) -> tuple[int, int, str]:
    """(this rank's KV heads, the model's, what the KV means) from vLLM's config: the writer
    splits pages by head with them (a peer of another TP size), and peers must name the same
    model id."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    total = mc.get_total_num_kv_heads()
    arch = (mc.architectures or ["unknown"])[0]
    model_id = f"vllm:{arch}:{mc.get_num_layers(pc)}x{total}x{mc.get_head_size()}:{mc.dtype}"
    return mc.get_num_kv_heads(pc), total, model_id


class WorkerSide:
    def __init__(self, settings: P.Settings, rank: int, role: str, geometry: tuple[int, int, str] = (0, 0, "")):
        self.s = settings
        self.rank = rank
        self.role = role
        self.kv_heads, self.total_kv_heads, self.model_id = geometry
        self.alloc = SharedKVAllocation(f"pushkv-vllm-{settings.engine_id}-{rank}", settings.cuda_memory,
                                        self._writer_allocates)
        self.memory: Optional[R.KVMemory] = None
        self.ctx: zmq.Context = zmq.Context.instance()
        self.events: Optional[zmq.Socket] = None
        self.event_endpoint = settings.event_endpoint(rank, os.getpid())
        self.proc: Optional[subprocess.Popen] = None
        self._t0 = 0.0  # when the writer was started
        self.restarts = 0
        self._lock = threading.Lock()  # the event socket: the worker thread, or a restart
        self._pending_lock = threading.Lock()  # the pending maps, short holds only
        # (reason, the sends, receives and streams that writer had), filled by the supervising thread
        self._deaths: list[tuple[str, dict, dict, dict]] = []
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        # bookkeeping from the scheduler's step metadata
        self.pending_sends: dict[str, str] = {}
        self.pending_recvs: dict[str, tuple[str, list[int]]] = {}
        # P, layer streaming: req id -> transfer id, from the first step that streams it until the
        # scheduler hands its blocks over (``sends``); and the writer's answers for such streams
        # that came before (a part failed, D cancelled): held, since vLLM frees a request's blocks
        # on ``finished_sending`` even while it still runs, and asserts on one it already freed
        self.streaming: OrderedDict[str, str] = OrderedDict()
        self.sent_early: OrderedDict[str, w.BlocksSent] = OrderedDict()
        self.died_streaming: OrderedDict[str, str] = OrderedDict()  # req id -> why (its writer died mid-stream)
        self._released: list[w.BlocksSent] = []
        self.reported: OrderedDict[str, None] = OrderedDict()
        self.load_errors: set[int] = set()
        self.last_transfer: dict[str, float] = {}
        self._early: list = []  # events read while waiting for a new writer's WriterReady
        self._idle_wait = False
        self.cmd: Optional[zmq.Socket] = None
        self.cuda_ipc = ""  # the GPU KV storage's CUDA IPC handle, hex ("" on the CPU)
        self.marks: Optional[stream.LayerMarks] = None
        self.writer_owns_kv = False  # the writer allocated the GPU KV cache: it cannot be restarted
        self._fatal = ""  # why this worker cannot go on (its KV cache's owner died)

    # -- memory and writer -----------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict, block_tokens: int = 0, layout: str = "") -> None:
        first = next(iter(kv_caches.values()), None)
        record: Optional[Callable[[], bytes]] = None
        if first is not None and first.is_cuda and self.writer_owns_kv:  # the writer's allocation, mapped here
            from pushkv.vllm import cuda_kv

            base, nbytes, dev = self.alloc.base_addr, self.alloc.nbytes, self.alloc.dev_id
            record = layer_events.EventRing(first.device).record
        elif first is not None and first.is_cuda:
            from pushkv.vllm import cuda_kv

            if self.s.cuda_memory == "writer":
                raise RuntimeError(f"pushkv: {cuda_kv.NOT_THROUGH_HOOK}")
            handle, base, nbytes = cuda_kv.export(first)  # vLLM's own allocation, by CUDA IPC (refused: why)
            self.cuda_ipc, dev = handle.hex(), first.device.index or 0
            record = layer_events.EventRing(first.device).record
        elif self.alloc.tensor is None:
            raise RuntimeError("pushkv: vLLM did not allocate its KV cache through the connector's "
                               "get_mem_pool_context() (needs vLLM 0.32's CPU worker)")
        else:
            base, nbytes, dev = self.alloc.base_addr, self.alloc.nbytes, -1
        self.memory = R.describe(kv_caches, base, nbytes, self.kv_heads, self.total_kv_heads, layout,
                                 block_tokens, dev)
        if self.s.stream_groups and self.role == "prefill":
            self.marks = stream.LayerMarks(R.layer_index(kv_caches, base), self.s.stream_groups, self._send_mark,
                                           record)
        self._open_sockets()
        if self.writer_owns_kv:  # started at the allocation: now it learns what vLLM laid out in it
            assert self.cmd is not None
            self.cmd.send(m.encode(w.DescribeKV(msgspec.msgpack.encode(self.memory))))
            self._await(w.WriterReady, "after DescribeKV")
        else:
            self._start_writer()
        self._thread = threading.Thread(target=self._supervise, name="pushkv-writer-supervisor", daemon=True)
        self._thread.start()

    def _open_sockets(self) -> None:
        """The writer's event socket (bound here) and command socket (its own: to describe the KV
        cache, mark stored layers, cancel what a dead writer left); once."""
        if self.events is not None:
            return
        taken = P.endpoints_in_use(self.s.cmd_endpoint(self.rank), self.s.handshake_endpoint(self.rank))
        if taken:
            raise RuntimeError(f"pushkv: engine_id {self.s.engine_id!r} rank {self.rank}: another live process "
                               f"listens on {taken}; each vLLM instance on a host needs its own engine_id in "
                               "--kv-transfer-config (or none: vLLM then draws one)")
        dead = P.remove_dead_sockets(P.socket_dir())  # what runs that were killed left there
        if dead:
            log.info("pushkv: removed %d socket files of stopped instances from %s", len(dead), P.socket_dir())
        self.events = self.ctx.socket(zmq.PULL)
        self.events.setsockopt(zmq.LINGER, 0)
        self.events.setsockopt(zmq.MAXMSGSIZE, limits.CONTROL_MSG_BYTES)
        self.events.bind(self.event_endpoint)
        self.cmd = self.ctx.socket(zmq.PUSH)
        self.cmd.setsockopt(zmq.LINGER, 0)
        self.cmd.connect(self.s.cmd_endpoint(self.rank))

    def _writer_allocates(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The allocation hook's GPU half (``cuda_memory: writer``): start this worker's writer
        now, have it allocate vLLM's KV buffer on ``device``, and map its allocation."""
        from pushkv.vllm import cuda_kv

        self._open_sockets()
        self._spawn(self._writer_args(memory="", alloc_bytes=nbytes, alloc_device=int(device.index or 0)))
        got = self._await(w.KVAllocated, "allocating the KV cache")
        if got.reason:
            raise RuntimeError(f"pushkv: the writer could not allocate vLLM's KV cache: {got.reason}")
        t = cuda_kv.open_owned(got.ipc, nbytes)
        self.writer_owns_kv = True
        return t

    def _writer_args(self, **over) -> WriterArgs:
        memory = msgspec.msgpack.encode(self.memory).hex() if self.memory is not None else ""
        args = WriterArgs(role=self.role, engine_id=self.s.engine_id, fd=self.alloc.fd, cuda_ipc=self.cuda_ipc,
                          stream_groups=self.s.stream_groups, memory=memory,
                          cmd_endpoint=self.s.cmd_endpoint(self.rank), event_endpoint=self.event_endpoint,
                          handshake_endpoint=self.s.handshake_endpoint(self.rank), parent_pid=os.getpid(),
                          rank=self.rank, tp=self.s.tp, model_id=self.model_id,
                          registration_wait_s=self.s.registration_wait_s, transfer_s=self.s.transfer_s,
                          secret_file=self.s.secret_file)
        return dataclasses.replace(args, **over)

    def _spawn(self, args: WriterArgs) -> None:
        self._t0 = time.monotonic()
        fds = (self.alloc.fd,) if self.alloc.fd >= 0 else ()
        # no allocator configuration: a cache the writer allocates must be legacy-IPC shareable
        self.proc = subprocess.Popen(args.argv(), pass_fds=fds, stdin=subprocess.DEVNULL,
                                     env=writer_env(os.environ))

    def _start_writer(self) -> None:
        self._spawn(self._writer_args())
        self._await(w.WriterReady, "at start")

    def _await(self, kind: type, when: str):
        """The writer's ``kind`` event (other events are kept for the step): a writer that exits
        first fails now, with its last word if it sent one; one that does not answer is waited on
        WRITER_READY_S at a time while it works, and killed once it is stuck or spins (``start_verdict``)."""
        assert self.events is not None and self.proc is not None
        deadline = time.monotonic() + WRITER_READY_S
        cpu_seen = 0.0  # the writer's CPU seconds at the last deadline
        while True:
            exited = self.proc.poll() is not None
            while self.events.poll(200 if exited else 100):
                msg = w.DEC_TO_CONNECTOR.decode(self.events.recv())
                if isinstance(msg, kind) and getattr(msg, "pid", -1) == self.proc.pid:
                    if kind is w.WriterReady:
                        log.info("pushkv: writer pid %d ready in %.2fs (rank %d, %s)", self.proc.pid,
                                 time.monotonic() - self._t0, self.rank, self.s.handshake_endpoint(self.rank))
                    return msg
                self._early.append(msg)
            if exited:
                raise RuntimeError(f"pushkv writer exited with status {self.proc.returncode} {when}")
            if time.monotonic() > deadline:
                waited, cpu = time.monotonic() - self._t0, cpu_seconds(self.proc.pid)
                verdict = start_verdict(cpu, cpu_seen)
                if verdict == "starting":  # slow, not stuck: a loaded machine
                    log.warning("pushkv: writer pid %d has not answered %s in %.0fs (%s) but is working (%.1f CPU "
                                "seconds so far): waiting on", self.proc.pid, kind.__name__, waited, when, cpu)
                    cpu_seen, deadline = cpu, time.monotonic() + WRITER_READY_S
                    continue
                self.proc.kill()
                raise RuntimeError(f"pushkv writer did not answer {kind.__name__} within {waited:.0f}s ({when}; "
                                   f"{verdict}: {max(cpu, 0.0):.1f} CPU seconds)")

    def _supervise(self) -> None:
        """Watch the writer; when it dies, record why and start a new one."""
        while not self._stopping.is_set():
            proc = self.proc
            code = proc.wait()
            if self._stopping.is_set():
                return
            reason = f"pushkv writer (pid {proc.pid}) died with status {code}"
            if not self.writer_owns_kv:
                log.error("pushkv: %s; restarting it", reason)
            with self._pending_lock:  # what the dead writer had, now: later work goes to its successor
                self._deaths.append((reason, dict(self.pending_sends), dict(self.pending_recvs),
                                     dict(self.streaming)))
                self.pending_sends.clear()
                self.pending_recvs.clear()
                if self.writer_owns_kv:
                    self._fatal = reason
            if self.writer_owns_kv:  # vLLM's KV cache was that writer's memory: no successor can have it
                log.error("pushkv: %s; it owned vLLM's KV cache (cuda_memory: writer), so this worker stops", reason)
                return
            try:
                self._restart()
            except Exception:
                log.exception("pushkv: writer restart failed; retrying in 1s")
                self._stopping.wait(1.0)

    def _restart(self) -> None:
        with self._lock:  # the worker thread must not read the event socket meanwhile
            self.restarts += 1
            self._start_writer()

    def shutdown(self) -> None:
        self._stopping.set()
        if self.writer_owns_kv:  # our mapping of the writer's memory goes before the writer does
            self.alloc.tensor = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(WRITER_STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        opened = self.events is not None
        for sock in (self.events, self.cmd):
            if sock is not None:
                sock.close(0)
        self.events = self.cmd = None
        if opened:  # our event socket's file, and the writer's if it was killed above (it removes its own)
            P.remove_socket_files(self.event_endpoint, self.s.cmd_endpoint(self.rank),
                                  self.s.handshake_endpoint(self.rank))

    # -- per step ------------------------------------------------------------------------
    def save_layer(self, layer_name: str) -> None:
        """vLLM's ``save_kv_layer``: after a layer group's last layer, mark it for the writer."""
        if self.marks is not None:
            self.marks.saved(layer_name)

    def _send_mark(self, msg: w.LayersStored) -> None:
        if self.cmd is not None:
            self.cmd.send(m.encode(msg))

    def preempted(self, streams: dict[str, str]) -> None:
        """vLLM's ``handle_preemptions``, before the step's forward: the scheduler preempted these
        streamed P requests (req id -> transfer id) and freed their blocks, which this step may
        overwrite. The writer goes on with each stream from the blocks vLLM computes it into
        again; this returns once it says no WRITE of theirs still reads the old ones. A writer that
        does not say so within ``transfer_s`` is killed (its WRITEs stop; D fails what it was
        writing and the writer is restarted): a late read could hand D another request's KV."""
        if not streams or self.cmd is None or self.events is None:
            return
        with self._lock:
            for rid, tid in streams.items():
                mark("p_preempt_sent", tid)
                self.cmd.send(m.encode(w.StreamPreempted(rid, tid)))
            waiting = set(streams)
            deadline = time.monotonic() + self.s.transfer_s
            while waiting:
                if self.proc is None or self.proc.poll() is not None:
                    return  # dead: it reads nothing (the supervisor tells vLLM and restarts it)
                left = deadline - time.monotonic()
                if left <= 0:
                    log.error("pushkv: writer pid %d did not release preempted streams %s within %.0fs; "
                              "killing it", self.proc.pid, sorted(streams[r] for r in waiting), self.s.transfer_s)
                    self.proc.kill()
                    self.proc.wait()
                    return
                if self.events.poll(int(min(left, 0.2) * 1000) + 1):
                    msg = w.DEC_TO_CONNECTOR.decode(self.events.recv())
                    if isinstance(msg, w.StreamReleased) and msg.req_id in waiting:
                        waiting.discard(msg.req_id)
                    else:
                        self._early.append(msg)  # the step's results, read by transfer_results

    def bind(self, meta) -> None:
        streams = getattr(meta, "streams", {})
        if self.marks is not None:
            self.marks.step(streams)
        with self._pending_lock:
            for rid, entry in streams.items():
                if rid not in self.reported:
                    self.streaming[rid] = entry[0]
            _forget_oldest(self.streaming)
            for rid, tid in meta.sends.items():
                self.streaming.pop(rid, None)
                early = self.sent_early.pop(rid, None)
                why = self.died_streaming.pop(rid, None)
                if why is not None:  # the writer that streamed it is dead: nothing reads these blocks
                    early = w.BlocksSent(rid, tid, False, why)
                if early is not None:  # the writer answered first: report it now that vLLM waits for it
                    self._released.append(early)
                if rid not in self.reported:
                    self.pending_sends[rid] = tid
            for rid, entry in meta.recvs.items():
                if rid not in self.reported:
                    self.pending_recvs[rid] = entry
        self._idle_wait = meta.idle and (meta.pending or bool(self.pending_sends or self.pending_recvs))

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        sent, recvd, failed = set(), set(), set()
        # what a dead writer had ends now, not once its successor is ready: none of it reads the event socket,
        # which the restart holds until then (a slow start on a loaded machine, or WRITER_READY_S and a retry)
        self._settle(sent, recvd, failed)
        # the lock is only ever held here by a restart (preempted() runs on this thread): a step waits idle_wait_ms
        # for it, as vLLM steps at once while requests wait on a transfer, and stepping unthrottled through a restart
        # would take the cores the new writer boots on; a free lock is taken at once
        if not self._lock.acquire(timeout=self.s.idle_wait_ms / 1e3):
            return sent, recvd, failed  # a restart holds the socket: next step
        try:
            for msg in self._early:
                self._handle(msg, sent, recvd, failed)
            self._early.clear()
            if self.events is None:
                return sent, recvd, failed
            wait_ms = self.s.idle_wait_ms if self._idle_wait else 0
            while self.events.poll(wait_ms):
                self._handle(w.DEC_TO_CONNECTOR.decode(self.events.recv()), sent, recvd, failed)
                wait_ms = 0
        finally:
            self._lock.release()
        self._idle_wait = False
        return sent, recvd, failed

    def _settle(self, sent: set, recvd: set, failed: set) -> None:
        """Dead writers' transfers ended, and streams' blocks handed over after their writer
        answered or died: this thread's own state and the command socket (queued for the
        next writer), never the event socket."""
        with self._pending_lock:
            deaths, self._deaths = self._deaths, []
        for reason, sends, recvs, streams in deaths:
            self._writer_died(reason, sends, recvs, streams, sent, recvd, failed)
        if self._fatal:
            raise RuntimeError(f"pushkv: {self._fatal}; it had allocated vLLM's KV cache "
                               "(cuda_memory: writer), which died with it: restart this vLLM instance")
        released, self._released = self._released, []
        for msg in released:
            self._handle(msg, sent, recvd, failed)

    def _report(self, rid: str) -> bool:
        if not rid or rid in self.reported:
            return False
        self.reported[rid] = None
        while len(self.reported) > REMEMBER:
            self.reported.popitem(last=False)
        return True

    def _handle(self, msg, sent: set, recvd: set, failed: set) -> None:
        if isinstance(msg, w.StreamReleased):  # a late answer (its writer was being replaced): nothing waits
            return
        if isinstance(msg, w.BlocksSent):
            if msg.req_id in self.streaming and msg.req_id not in self.pending_sends:
                self.sent_early[msg.req_id] = msg  # still vLLM's (running, or freed by an abort)
                _forget_oldest(self.sent_early)
                return
            self.pending_sends.pop(msg.req_id, None)
            if self._report(msg.req_id):  # (a second answer, e.g. to a dead writer's stream, is dropped)
                if not msg.ok:
                    log.warning("pushkv: transfer %s (request %s) ended without a WRITE: %s",
                                msg.transfer_id, msg.req_id, msg.reason)
                sent.add(msg.req_id)
                self.last_transfer = {"nbytes": msg.nbytes, "num_descs": msg.num_descs, "write_s": msg.write_s}
        elif isinstance(msg, w.BlocksReceived):
            mark("d_worker_recvd", msg.transfer_id)
            self.pending_recvs.pop(msg.req_id, None)
            if self._report(msg.req_id):
                recvd.add(msg.req_id)
        elif isinstance(msg, w.BlocksFailed):
            entry = self.pending_recvs.pop(msg.req_id, None)
            log.error("pushkv: KV for request %s (transfer %s) failed: %s", msg.req_id, msg.transfer_id, msg.reason)
            if self._report(msg.req_id):
                recvd.add(msg.req_id)
                failed.add(msg.req_id)
                if entry is not None:
                    self.load_errors.update(entry[1])

    def _writer_died(self, reason: str, sends: dict, recvs: dict, streams: dict, sent: set, recvd: set,
                     failed: set) -> None:
        """The dead writer can WRITE nothing more: P's blocks are free, D's transfers failed. A
        stream it had (its prefill may still run) is cancelled at the new writer, which then answers
        the request's ``SendBlocks`` at once instead of waiting for a registration that went to the
        dead one; and its blocks are reported free once vLLM hands them over, whether or not that
        ``SendBlocks`` reached anyone (one sent as the writer died is lost). D saw the death on its link."""
        for rid, tid in streams.items():
            if rid not in sends:
                why = f"{reason} while streaming"
                self.cmd.send(m.encode(w.CancelBlocks(rid, tid, why, "prefill")))
                if rid in self.pending_sends:  # handed over since the death was seen: free now
                    self._released.append(w.BlocksSent(rid, tid, False, why))
                else:
                    self.died_streaming[rid] = why
                    _forget_oldest(self.died_streaming)
        for rid, tid in sends.items():
            log.error("pushkv: transfer %s (request %s) ended: %s", tid, rid, reason)
            if self._report(rid):
                sent.add(rid)
            # a SendBlocks still queued for the next writer must not WRITE these freed blocks
            self.cmd.send(m.encode(w.CancelBlocks(rid, tid, reason, "prefill")))
        for rid, (tid, blocks) in recvs.items():
            log.error("pushkv: KV for request %s (transfer %s) failed: %s", rid, tid, reason)
            if self._report(rid):
                recvd.add(rid)
                failed.add(rid)
                self.load_errors.update(blocks)

    def take_load_errors(self) -> set[int]:
        errs, self.load_errors = self.load_errors, set()
        return errs


def _forget_oldest(d: OrderedDict) -> None:
    """Bound a map whose entries may never be claimed (a streamed request that vLLM aborted)."""
    while len(d) > REMEMBER:
        d.popitem(last=False)
