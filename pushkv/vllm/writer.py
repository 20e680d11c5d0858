"""The pushkv writer of one vLLM worker (one process per TP rank, started and
supervised by that worker's connector): registration, rendezvous and WRITE, out
of vLLM's engine loop (``pushkv/vllm/README.md``).

A shell: the roles are pushkv's pure sides (``PushRendezvous`` and
``writer/sides.PrefillSide`` on P, ``writer/receive_side.ReceiveSide`` on D)
and its writer shell (peers and handshake, posting, the loop); here is only
what is vLLM's: the memory is vLLM's KV cache (``regions.py``, described
in the Hello), and the commands and events carry vLLM's request ids. D watches
each P writer through a socket monitor on the handshake link: a dead P writer
fails its transfers at once.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import msgspec
import zmq

from pushkv import faults
from pushkv import messages as m
from pushkv.protocol import actions as A
from pushkv.protocol import arrivals as ar
from pushkv.protocol import rendezvous as rv
from pushkv.protocol.tp import page_heads, producers_for
from pushkv.security import is_network
from pushkv.supervisor.lifecycle import parent_death_signal
from pushkv.transport.nixl_agent import NixlAgent, TransferError
from pushkv.vllm import stream, writer_args
from pushkv.vllm import wire as w
from pushkv.vllm.memory import open_for_writer
from pushkv.vllm.regions import KVMemory
from pushkv.vllm.timing import mark
from pushkv.writer import memory as mem
from pushkv.writer import sides
from pushkv.writer.peers import Peer
from pushkv.writer.posting import InFlight
from pushkv.writer.receive_side import Lost, ReceiveSide
from pushkv.writer.warm import WarmWriter

log = logging.getLogger(__name__)


class VllmWriter(WarmWriter):
    watch_links = True  # D: a P writer whose link closes is gone, and its transfers with it

    def __init__(self, args: writer_args.WriterArgs):
        super().__init__(f"vllm-{args.role}-writer-{args.rank}", secret_file=args.secret_file)
        self.args = args
        self.role = args.role  # "prefill" | "decode"
        self.engine_id = args.engine_id
        self.rank, self.tp = args.rank, args.tp
        self.model_id = args.model_id
        self.kv = msgspec.msgpack.decode(bytes.fromhex(args.memory), type=KVMemory)
        self.total_kv_heads = self.kv.total_kv_heads or self.tp  # unknown: one "head" per rank (same TP only)
        self.agent_name = f"{self.engine_id}-w{self.rank}-{os.getpid()}"
        self.stuck_s = 2 * args.transfer_s
        self.init_peers()
        self.init_posting()
        self.init_warm(False, beat_ms=0)  # the CPU: no spinning for what is expected, no sink
        self.req_of: dict[str, str] = {}  # transfer id -> this instance's vLLM request id
        self.groups = stream.groups_of(len(self.kv.layers), args.stream_groups)
        self.rdv = rv.PushRendezvous(self.rank, self.tp, self.total_kv_heads, args.registration_wait_s,
                                     args.transfer_s, stream_unit=self.kv.block_tokens if args.stream_groups else 0,
                                     stream_groups=len(self.groups))
        self.side = sides.PrefillSide(self.rank)
        self.recv = ReceiveSide(args.transfer_s, lambda e, r: (e, r) in self.peers)  # D

    # -- lifecycle -------------------------------------------------------------------
    def setup(self) -> None:
        if not parent_death_signal(signal.SIGTERM):  # SIGTERM when the vLLM worker dies, even by SIGKILL
            log.warning("%s: cannot ask for a signal at the vLLM worker's death; its pid is watched", self.name)
        self.mm, base, dev = open_for_writer(self.args.fd, self.args.cuda_ipc, self.kv.nbytes)
        self.memory = mem.Memory(base, self.kv.nbytes, self.kv, dev_id=max(dev, 0))
        self.nixl = NixlAgent(self.agent_name, device="cpu" if dev < 0 else f"cuda:{dev}")
        self.marks = stream.MarkWaiter(stream.event_opener(dev))
        self.add_fd(self.marks.fd, self._marks_ready)
        mem.register(self.nixl, self.memory)  # no grid: vLLM's pages are posted as regions
        self.cmd = self.add_channel(self.socket(zmq.PULL, self.args.cmd_endpoint, bind=True),
                                    w.DEC_TO_WRITER, "vllm-scheduler")
        hs = self.socket(zmq.ROUTER, self.args.handshake_endpoint, bind=True)
        self.handshake = self.add_channel(hs, w.DEC_VHANDSHAKE, "peer-handshake", routed=True)
        self.peers_authenticated = self.security is not None or not is_network(self.args.handshake_endpoint)
        self.events = self.socket(zmq.PUSH, self.args.event_endpoint, bind=False)
        self._emit(w.WriterReady(os.getpid(), self.agent_name))
        log.info("%s: %.1f MiB of vLLM KV registered (%d layers, %d blocks), handshake %s", self.name,
                 self.kv.nbytes / 2**20, len(self.kv.layers), self.kv.num_blocks, self.args.handshake_endpoint)

    def teardown(self) -> None:
        super().teardown()
        self.marks.close()
        self.events.close(0)
        for ep in (self.args.cmd_endpoint, self.args.handshake_endpoint):
            if ep.startswith("ipc://"):  # zmq unlinks a bound file only if its io thread gets to it first
                try:
                    os.unlink(ep[len("ipc://"):])
                except OSError:
                    pass

    def _emit(self, msg: m.Msg) -> None:
        self.events.send(m.encode(msg))

    def _failed(self, tid: str, reason: str) -> None:
        """D: the blocks of vLLM's request for ``tid`` failed to arrive (and nothing lands in them)."""
        self._emit(w.BlocksFailed(self.req_of.pop(tid, ""), tid, reason))

    # -- the handshake: pushkv's, with vLLM's memory in the Hello ------------------------
    def hello(self) -> w.VllmHello:
        return w.VllmHello(self.engine_id, self.rank, self.tp, self.agent_name, self.nixl.metadata(),
                           self.memory.base_addr, self.kv, m.WIRE_VERSION, self.model_id)

    def handshake_decoder(self) -> Any:
        return w.DEC_VHANDSHAKE

    on_VllmHello = WarmWriter.on_Hello

    def check_peer(self, h: w.VllmHello) -> None:
        why = self.kv.pairing_problem(self.tp, h.memory, h.tp, h.engine_id)
        if why:
            raise ValueError(why)

    def peer_of(self, h: w.VllmHello, agent: str) -> Peer:
        return Peer(h.engine_id, h.rank, h.tp, agent, h.base_addr, h.memory, dev_id=max(h.memory.dev_id, 0))

    # -- commands from vLLM's scheduler ------------------------------------------------
    def on_SendBlocks(self, msg: w.SendBlocks) -> None:
        now = time.monotonic()
        self._last_activity = now
        mark("p_send_recvd", msg.transfer_id)
        self.req_of[msg.transfer_id] = msg.req_id
        self.poll_notifs(now)  # a registration may already wait in NIXL's queue
        try:
            acts = self.rdv.on_prefill_done(msg.transfer_id, 0, msg.block_ids, msg.num_tokens, 0, now)
        except A.ProtocolError as e:
            self._emit(w.BlocksSent(msg.req_id, msg.transfer_id, False, f"refused: {e}"))
            return
        self._apply_p(acts, now)

    def on_LayersStored(self, msg: w.LayersStored) -> None:
        self.marks.submit(msg)  # on to the rendezvous once its event completed (_marks_ready)

    def _marks_ready(self) -> None:
        now = time.monotonic()
        for msg, why in self.marks.ready():
            self.req_of.setdefault(msg.transfer_id, msg.req_id)
            acts = self.rdv.cancel(msg.transfer_id, 0, why, now) if why else \
                self.rdv.on_prefill_progress(msg.transfer_id, 0, msg.block_ids, msg.num_tokens, now, msg.group)
            self._apply_p(acts, now)

    def on_ExpectBlocks(self, msg: w.ExpectBlocks) -> None:
        """D: register with every P rank that produces our heads, once their handshakes are
        done (now, if they are); the loop goes on meanwhile."""
        now = time.monotonic()
        self._last_activity = now
        src = msg.source
        self.req_of[msg.transfer_id] = msg.req_id
        try:
            ranks = producers_for(self.rank, self.tp, src.tp, self.total_kv_heads)
            if any(r >= len(src.handshake) for r in ranks):
                raise ValueError(f"{src.engine_id} lists {len(src.handshake)} handshake endpoints for tp={src.tp}")
        except ValueError as e:
            self._failed(msg.transfer_id, f"bad source: {e}")
            return

        self.with_peers(msg.transfer_id, src.engine_id, ranks, src.handshake, lambda peers: self._register(msg, peers),
                        lambda why: self._failed(msg.transfer_id, f"cannot reach prefill writer: {why}"), now)

    def _register(self, msg: w.ExpectBlocks, peers: list[Peer]) -> None:
        now = time.monotonic()
        try:
            effects = self.recv.expect((msg.transfer_id, 0), msg.source.engine_id, [p.rank for p in peers],
                                       msg.block_ids, now + msg.deadline_s, now)
        except (ar.ProtocolError, ValueError) as e:
            self._failed(msg.transfer_id, f"registration refused: {e}")
            return
        self._apply_d(effects)
        mark("d_register_sent", msg.transfer_id)
        reg = m.Register(msg.transfer_id, 0, self.engine_id, self.rank, self.tp, msg.block_ids, msg.num_tokens,
                         msg.deadline_s)
        for p in peers:
            self.notify(p, reg)

    def on_CancelBlocks(self, msg: w.CancelBlocks) -> None:
        now = time.monotonic()
        if self.role == "prefill":
            self._apply_p(self.rdv.cancel(msg.transfer_id, 0, msg.reason, now), now)
        elif self.drop_wait(msg.transfer_id):  # still waiting for handshakes: nothing registered, nothing lands
            self._failed(msg.transfer_id, msg.reason)
        else:
            self._apply_d(self.recv.cancel((msg.transfer_id, 0), msg.reason, now))

    # -- NIXL notifications (pushkv's messages) ------------------------------------------
    def notif_Register(self, msg: m.Register, agent: str, now: float) -> None:
        if agent not in self.peers_by_agent:
            self.counters["register_from_unknown_peer"] += 1
            return
        mark("p_registration_recvd", msg.transfer_id)
        self._apply_p(self.rdv.on_registration(msg, now), now)

    def notif_CancelTransfer(self, msg: m.CancelTransfer, agent: str, now: float) -> None:
        self._apply_p(self.rdv.cancel(msg.transfer_id, msg.generation, msg.reason, now), now)

    def notif_WriteDone(self, msg: "m.WriteDone | m.WriteFailed", agent: str, now: float) -> None:
        peer = self.peers_by_agent.get(agent)
        self._apply_d(self.recv.completion(msg, (peer.engine_id, peer.rank) if peer else None, now))

    notif_WriteFailed = notif_WriteDone

    def peer_gone(self, peer: Peer, reason: str) -> None:
        """A P writer died: nothing of it can still write; its transfers fail now."""
        self._apply_d(self.recv.rank_gone(peer.engine_id, peer.rank, f"prefill {reason}", time.monotonic()))

    # -- the sides' actions ----------------------------------------------------------------
    def _apply_p(self, actions, now: float) -> None:
        for e in self.side.effects(actions):
            if isinstance(e, sides.Post):
                self._post_write(e.write, now)
            elif isinstance(e, sides.Tell):
                peer = self.peers.get(e.peer)
                if peer is not None:
                    self.notify(peer, e.msg)
            elif isinstance(e, sides.Report):
                t, tid = e.transfer, e.free.transfer_id
                self._emit(w.BlocksSent(self.req_of.pop(tid, ""), tid, e.ok, e.reason, t.nbytes, t.num_descs,
                                        t.write_s))
            elif isinstance(e, A.Count):
                self.counters[e.name] += 1

    def _apply_d(self, effects) -> None:
        for e in effects:
            if isinstance(e, A.Received):
                mark("d_kv_received", e.transfer_id)
                self._emit(w.BlocksReceived(self.req_of.pop(e.transfer_id, ""), e.transfer_id, e.nbytes, e.num_descs))
            elif isinstance(e, sides.Tell):
                self.notify(self.peers[e.peer], e.msg)
            elif isinstance(e, Lost):
                self._failed(e.key[0], e.reason)
            elif isinstance(e, A.Count):
                self.counters[e.name] += 1

    def _post_write(self, a: A.PostWrite, now: float) -> None:
        faults.point(self.name, "post_write" if a.last else "post_part")  # tests: die mid-stream
        fl = InFlight(a.transfer_id, a.generation, posted=now, part=not a.last)
        try:
            for reg in a.registrations:
                peer = self.peers.get((reg.d_engine_id, reg.d_rank))
                if peer is None:
                    raise TransferError(f"no handshake with {reg.d_engine_id} rank {reg.d_rank}")
                heads = page_heads(self.rank, self.tp, reg.d_rank, reg.d_tp, self.total_kv_heads)
                if heads is False:
                    continue
                regions = stream.write_regions(self.kv, a, peer.layout, reg.block_ids, reg.num_tokens, heads,
                                               self.groups)
                if not regions:  # a part of blocks D's own prefix cache holds (D did not register them)
                    continue
                nbytes = sum(r[2] for r in regions)
                done = m.WriteDone(a.transfer_id, a.generation, self.rank, 0, nbytes, len(regions))
                fl.handles.append(self.post("WRITE", peer, regions, m.encode(done) if a.last else b""))
                fl.nbytes += nbytes
                fl.num_descs += len(regions)
        except Exception as e:
            log.error("%s: WRITE failed to post: %s transfer_id=%s", self.name, e, a.transfer_id)
            fl.failed = f"WRITE failed to post: {e}"
        if a.last or fl.handles:  # a part: only one that moves bytes (the streaming e2e counts them)
            mark("p_write_posted" if a.last else "p_part_posted", a.transfer_id)
        if fl.handles:
            self.inflight[(a.transfer_id, a.generation)] = fl
        else:
            self.transfer_finished(fl, now)

    def transfer_finished(self, fl: InFlight, now: float) -> None:
        t = self.side.record((fl.transfer_id, fl.generation))
        t.nbytes, t.num_descs = t.nbytes + fl.nbytes, t.num_descs + fl.num_descs
        if not fl.part:
            t.write_s = now - fl.posted  # the last WRITE's: one layer group's, when streamed
        if fl.failed:
            self._apply_p(self.rdv.on_write_failed(fl.transfer_id, fl.generation, fl.failed, now, part=fl.part), now)
        else:
            self._apply_p(self.rdv.on_write_done(fl.transfer_id, fl.generation, now, part=fl.part), now)

    # -- the loop ---------------------------------------------------------------------------
    def expire(self, now: float) -> None:
        self._apply_p(sides.due(self.rdv, now), now)
        self._apply_d(self.recv.expire(now))

    def tick(self, now: float) -> None:
        super().tick(now)
        if os.getppid() != self.args.parent_pid:
            log.error("%s: vLLM worker %d is gone; exiting", self.name, self.args.parent_pid)
            self.stopping = True

    def has_pending(self) -> bool:
        return sides.pending(self.rdv) or self.recv.pending() or bool(self.waits)


def main(argv=None) -> None:
    args = writer_args.parse(argv)
    writer_args.set_up_process(args)
    VllmWriter(args).run()


if __name__ == "__main__":
    main()
