"""The pushkv writer of one vLLM worker (one process per TP rank, started and supervised by
that worker's connector): registration, rendezvous and WRITE, out of vLLM's engine loop
(``pushkv/vllm/README.md``).

A shell over pushkv's: the roles are its pure sides (``PrefillSide``, which owns the
rendezvous, on P; ``ReceiveSide`` on D, mapped to vLLM's events by ``receive.py``), the peers, posting and
loop the writer shell's (``writer/shell.py``). Here is only what is vLLM's: the memory is
vLLM's KV cache (``regions.py``, described in the Hello; on a GPU this writer's own allocation,
``writer_alloc.py``, unless ``cuda_memory: vllm``), and the commands and events carry
vLLM's request ids. D watches each P writer through a socket monitor on the handshake link:
a dead P writer fails its transfers at once.
"""
from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from typing import Optional

import msgspec
import torch
import zmq

from pushkv import faults
from pushkv import messages as m
from pushkv.kv import layer_events
from pushkv.protocol import rendezvous as rv
from pushkv.supervisor.lifecycle import parent_death_signal
from pushkv.trace import stamp as mark
from pushkv.transport.nixl_agent import NixlAgent
from pushkv.vllm import stream, writer_alloc, writer_args
from pushkv.vllm import wire as w
from pushkv.vllm.memory import open_for_writer
from pushkv.vllm.params import remove_socket_files
from pushkv.vllm.receive import Receiver
from pushkv.vllm.regions import KVMemory, cached_problem
from pushkv.writer import memory as mem
from pushkv.writer import sides
from pushkv.writer.peers import Peer
from pushkv.writer.posting import InFlight
from pushkv.writer.shell import WriterShell

log = logging.getLogger(__name__)


class VllmWriter(WriterShell):
    hello_decoder = w.DEC_VHANDSHAKE

    def __init__(self, args: writer_args.WriterArgs, owned: Optional[torch.Tensor] = None):
        # no sink; D: a P writer whose link closes is gone; warm (spin while KV is expected, as pushkv's
        # writers do: "auto") on a GPU only, where a 1 ms poll is a tenth of a layer group's WRITE
        gpu = args.alloc_device >= 0 or bool(args.cuda_ipc)
        super().__init__(f"vllm-{args.role}-writer-{args.rank}", secret_file=args.secret_file, beat_ms=0,
                         watch_links=True, stuck_s=2 * args.transfer_s, warm=gpu)
        self.args = args
        self.owned = owned  # the worker's KV cache, allocated by this process (cuda_memory writer)
        self.role = args.role  # "prefill" | "decode"
        self.engine_id = args.engine_id
        self.rank, self.tp = args.rank, args.tp
        self.model_id = args.model_id
        self.kv = msgspec.msgpack.decode(bytes.fromhex(args.memory), type=KVMemory)
        self.total_kv_heads = self.kv.total_kv_heads or self.tp  # unknown: one "head" per rank (same TP only)
        self.agent_name = f"{self.engine_id}-w{self.rank}-{os.getpid()}"
        self.req_of: dict[str, str] = {}  # P: transfer id -> this instance's vLLM request id
        self.releasing: dict[tuple[str, int], str] = {}  # P: preempted streams whose WRITE still flies -> req id
        self._part_ids = itertools.count(1)  # P: a part's key in flight, (tid, gen, n): two may fly at once
        self.groups = stream.groups_of(len(self.kv.layers), args.stream_groups)
        self.side = sides.PrefillSide(rv.PushRendezvous(  # P's role
            self.rank, self.tp, self.total_kv_heads, args.registration_wait_s, args.transfer_s,
            stream_unit=self.kv.block_tokens if args.stream_groups else 0, stream_groups=len(self.groups)))
        self.d = Receiver(self, self.tp, self.total_kv_heads, args.transfer_s, self._emit)  # D's role (vllm/receive.py)

    # -- lifecycle -------------------------------------------------------------------
    def setup(self) -> None:
        self.watch_parent(self.args.parent_pid)  # the vLLM worker
        self.mm: object  # what keeps the KV cache mapped here
        if self.owned is not None:  # NIXL registers our own allocation: VRAM at the link's speed
            if self.kv.nbytes > self.owned.numel():
                raise ValueError(f"the worker describes {self.kv.nbytes} B of KV, this writer allocated "
                                 f"{self.owned.numel()} B")
            self.mm, base, dev = self.owned, self.owned.data_ptr(), self.args.alloc_device
        else:
            self.mm, base, dev = open_for_writer(self.args.fd, self.args.cuda_ipc, self.kv.nbytes)
        self.memory = mem.Memory(base, self.kv.nbytes, self.kv, dev_id=max(dev, 0))
        self.nixl = NixlAgent(self.agent_name, device="cpu" if dev < 0 else f"cuda:{dev}")
        self.marks = layer_events.MarkWaiter(layer_events.event_opener(dev))
        self.add_fd(self.marks.fd, self._marks_ready)
        mem.register(self.nixl, self.memory)  # no grid: vLLM's pages are posted as regions
        self.cmd = self.add_channel(self.socket(zmq.PULL, self.args.cmd_endpoint, bind=True),
                                    w.DEC_TO_WRITER, "vllm-scheduler")
        self.bind_handshake(self.args.handshake_endpoint)
        self.events = self.socket(zmq.PUSH, self.args.event_endpoint, bind=False)
        self._emit(w.WriterReady(os.getpid(), self.agent_name))
        log.info("%s: %.1f MiB of vLLM KV registered (%d layers, %d blocks), handshake %s", self.name,
                 self.kv.nbytes / 2**20, len(self.kv.layers), self.kv.num_blocks, self.args.handshake_endpoint)

    def teardown(self) -> None:
        super().teardown()
        self.marks.close()
        self.events.close(0)
        remove_socket_files(self.args.cmd_endpoint, self.args.handshake_endpoint)

    def _emit(self, msg: m.Msg) -> None:
        self.events.send(m.encode(msg))

    # -- the handshake: pushkv's, with vLLM's memory in the Hello ------------------------
    def hello(self) -> w.VllmHello:
        return w.VllmHello(self.engine_id, self.rank, self.tp, self.agent_name, self.nixl.metadata(),
                           self.memory.base_addr, self.kv, m.WIRE_VERSION, self.model_id)

    on_VllmHello = WriterShell.on_Hello

    def check_peer(self, h: w.VllmHello) -> None:
        why = self.kv.pairing_problem(self.tp, h.memory, h.tp, h.engine_id)
        if why:
            raise ValueError(why)

    def peer_of(self, h: w.VllmHello, agent: str) -> Peer:
        return Peer(h.engine_id, h.rank, h.tp, agent, h.base_addr, h.memory, dev_id=max(h.memory.dev_id, 0))

    # -- commands from vLLM's scheduler ------------------------------------------------
    def on_SendBlocks(self, msg: w.SendBlocks) -> None:
        now = self.last_activity = time.monotonic()
        mark("p_send_recvd", msg.transfer_id)
        other = self.req_of.get(msg.transfer_id)
        if other is not None and other != msg.req_id:  # refused alone: the request that has it keeps it
            self._emit(w.BlocksSent(msg.req_id, msg.transfer_id, False, f"transfer id {msg.transfer_id} is in "
                                    f"flight for request {other} already (a router must give each P request its own)"))
            return
        self.req_of[msg.transfer_id] = msg.req_id
        self.posting.poll_notifs(now)  # a registration may already wait in NIXL's queue
        self._apply_p(self.side.prefill_done((msg.transfer_id, 0), msg.block_ids, msg.num_tokens, 0, now), now)

    def on_LayersStored(self, msg: w.LayersStored) -> None:
        self.marks.submit(msg)  # on to the rendezvous once its event completed (_marks_ready)

    def on_StreamPreempted(self, msg: w.StreamPreempted) -> None:
        self.marks.submit(msg)  # after the marks sent before it (_marks_ready)

    def _marks_ready(self) -> None:
        now = time.monotonic()
        for msg, why in self.marks.ready():
            if isinstance(msg, w.StreamPreempted):
                self._preempted(msg, now)
                continue
            self.req_of.setdefault(msg.transfer_id, msg.req_id)
            key = (msg.transfer_id, 0)
            self._apply_p(self.side.cancel(key, why, now) if why else
                          self.side.progress(key, msg.block_ids, msg.num_tokens, now, msg.group), now)

    def _preempted(self, msg: w.StreamPreempted, now: float) -> None:
        """vLLM freed the stream's blocks: the stream goes on from its new ones, and the worker,
        whose next step may overwrite the old ones, hears once no WRITE of ours reads them."""
        key = (msg.transfer_id, 0)
        mark("p_stream_preempted", msg.transfer_id)
        for e in self.side.restart(key, now):
            if isinstance(e, sides.Refused):  # its prefill half is in: vLLM preempts no finished request
                log.error("%s: preemption refused: %s transfer_id=%s", self.name, e.error, msg.transfer_id)
            else:
                self.count_or_tell(e, self.posting.notify)
        if self._reading(key):  # a part WRITE still reads them: answered when the last one ends
            self.releasing[key] = msg.req_id
        else:
            self._released(key, msg.req_id)

    def _released(self, key: tuple[str, int], req_id: str) -> None:
        mark("p_stream_released", key[0])
        self._emit(w.StreamReleased(req_id, key[0]))

    def on_ExpectBlocks(self, msg: w.ExpectBlocks) -> None:
        self.d.expect(msg)

    def on_ForgetTransfer(self, msg: w.ForgetTransfer) -> None:
        self.d.forget(msg)

    def on_CancelBlocks(self, msg: w.CancelBlocks) -> None:
        now = time.monotonic()
        if (msg.leg or self.role) == "prefill":  # (a kv_both instance's writer: by the request's leg)
            self._apply_p(self.side.cancel((msg.transfer_id, 0), msg.reason, now), now)
        else:
            self.d.cancel(msg)

    # -- NIXL notifications (pushkv's messages) ------------------------------------------
    def notif_Register(self, msg: m.Register, agent: str, now: float) -> None:
        if agent not in self.peers.by_agent:
            self.counters["register_from_unknown_peer"] += 1
            return
        why = cached_problem(self.kv.block_tokens, len(msg.block_ids), msg.num_tokens, msg.cached_tokens)
        if why:  # refused at once: D fails the request now, not at its deadline
            self.counters["register_bad_cached_tokens"] += 1
            log.error("%s: Register refused: %s transfer_id=%s", self.name, why, msg.transfer_id)
            self.posting.notify(self.peers.by_agent[agent], m.WriteFailed(msg.transfer_id, msg.generation,
                                                                          self.rank, f"registration refused: {why}"))
            return
        mark("p_registration_recvd", msg.transfer_id)
        self._apply_p(self.side.registration(msg, now), now)

    def notif_CancelTransfer(self, msg: m.CancelTransfer, agent: str, now: float) -> None:
        self._apply_p(self.side.cancel((msg.transfer_id, msg.generation), msg.reason, now), now)

    def notif_WriteDone(self, msg: "m.WriteDone | m.WriteFailed", agent: str, now: float) -> None:
        self.d.completion(msg, agent, now)

    notif_WriteFailed = notif_WriteDone

    def peer_gone(self, peer: Peer, reason: str) -> None:
        self.d.rank_gone(peer, reason)

    # -- the sides' effects, carried out ------------------------------------------------------
    def _apply_p(self, effects: list, now: float) -> None:
        for e in effects:
            if isinstance(e, sides.Post):
                a = e.write
                faults.point(self.name, "post_write" if a.last else "post_part")  # tests: die mid-stream
                fl = self.posting.post_regions(a, stream.regions_of(self.kv, a, self.rank, self.tp,
                                                                    self.total_kv_heads, self.groups), now)
                if a.last or fl.handles or fl.queued:  # a part: only one that moves bytes (the e2e counts them)
                    mark("p_write_posted" if a.last else "p_part_posted", fl.transfer_id)
                else:  # nothing of it is in D's registered blocks: no post
                    mark("p_part_empty", fl.transfer_id)
                # a part's own key: two of a transfer may fly at once (rendezvous.PARTS_AHEAD)
                ikey = (fl.transfer_id, fl.generation) if a.last else (fl.transfer_id, fl.generation,
                                                                      next(self._part_ids))
                self.posting.book(ikey, fl, now)
            elif isinstance(e, sides.Report):
                t, tid = e.transfer, e.free.transfer_id
                self._emit(w.BlocksSent(self.req_of.pop(tid, ""), tid, e.ok, e.reason, t.nbytes, t.num_descs,
                                        t.write_s))
            elif isinstance(e, sides.Refused):  # these blocks were never handed over
                self._emit(w.BlocksSent(self.req_of.get(e.key[0], ""), e.key[0], False, f"refused: {e.error}"))
            else:
                self.count_or_tell(e, self.posting.notify)

    def transfer_finished(self, fl: InFlight, now: float) -> None:
        key = (fl.transfer_id, fl.generation)
        self._apply_p(self.side.write_ended(key, now, part=fl.part, failed=fl.failed,
                                            nbytes=fl.nbytes, num_descs=fl.num_descs, posted=fl.posted), now)
        if key in self.releasing and not self._reading(key):  # (no part of the old blocks follows)
            self._released(key, self.releasing.pop(key))

    def _reading(self, key: tuple[str, int]) -> bool:
        """Whether a WRITE of transfer ``key`` (a part, or the last) is still in flight."""
        return any(k[:2] == key for k in self.posting.inflight)

    # -- the loop ---------------------------------------------------------------------------
    def expire(self, now: float) -> None:
        self._apply_p(self.side.expire(now), now)
        self.d.expire(now)

    def has_pending(self) -> bool:
        return self.side.pending() or self.d.pending() or bool(self.peers.waits)


def main(argv=None) -> None:
    args = writer_args.parse(argv)
    writer_args.set_up_process(args)
    owned = None
    if args.alloc_bytes:  # ends with the worker from now: its KV cache is about to be ours
        parent_death_signal(signal.SIGTERM)
        owned, args = writer_alloc.allocate_and_wait(args)
    VllmWriter(args, owned).run()


if __name__ == "__main__":
    main()
