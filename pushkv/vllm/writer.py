"""The pushkv writer of one vLLM worker: registration, rendezvous and WRITE,
out of vLLM's engine loop.

One process per vLLM worker (TP rank), started and supervised by that worker's
connector. It maps the worker's KV cache (a shared-memory file whose
descriptor it inherits, see ``memory.py``), registers it with NIXL, and runs
pushkv's protocol machines unchanged: ``PushRendezvous`` on P, ``KVArrivals``
on D, with pushkv's NIXL notifications between writers. vLLM's scheduler
process sends it commands directly (``SendBlocks`` when P's request finished,
``ExpectBlocks`` when D allocated), so neither the registration nor the WRITE
waits for an engine step; its outcomes go to the worker connector, which hands
them to vLLM as finished sends / receives.

D watches each P writer it talks to through a ZMQ socket monitor: when a P
writer dies, its transfers fail at once with that reason.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

import msgspec
import zmq

from pushkv import limits
from pushkv import messages as m
from pushkv.actor import Actor
from pushkv.security import secure_connect
from pushkv.protocol import actions as A
from pushkv.protocol import arrivals as ar
from pushkv.protocol import rendezvous as rv
from pushkv.transport.nixl_agent import NixlAgent, TransferError
from pushkv.vllm import wire as w
from pushkv.vllm.memory import map_fd, mapping_addr
from pushkv.vllm.regions import KVMemory, map_blocks
from pushkv.vllm.timing import mark

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_MS = 5000
BUSY_POLL_MS = 1
IDLE_POLL_MS = 10  # NIXL notifications have no fd: look this often when idle (~0.1 % of a core)


@dataclass
class Peer:
    engine_id: str
    rank: int
    agent: str
    base_addr: int
    memory: KVMemory
    endpoint: str = ""
    monitor: Optional[zmq.Socket] = None  # D side: tells us when the P writer's socket closes
    link: Optional[zmq.Socket] = None


@dataclass
class Posted:
    req_id: str
    transfer_id: str
    handles: list
    posted: float
    nbytes: int
    num_descs: int
    failed: str = ""


class VllmWriter(Actor):
    def __init__(self, args):
        super().__init__(f"vllm-{args.role}-writer-{args.rank}", secret_file=args.secret_file)
        self.args = args
        self.role = args.role  # "prefill" | "decode"
        self.engine_id = args.engine_id
        self.rank, self.tp = args.rank, args.tp
        self.memory = msgspec.msgpack.decode(bytes.fromhex(args.memory), type=KVMemory)
        self.agent_name = f"{self.engine_id}-w{self.rank}-{os.getpid()}"
        self.peers: dict[tuple[str, int], Peer] = {}
        self.peers_by_agent: dict[str, Peer] = {}
        self.req_of: dict[str, str] = {}  # transfer id -> this instance's vLLM request id
        self.posted: dict[str, Posted] = {}
        self.sources: dict[str, tuple[str, int]] = {}  # D: transfer id -> producing P peer
        self.quarantine: dict[str, tuple[float, str]] = {}  # D: failed, P may still write
        self.stats: dict[str, tuple[int, int, float]] = {}
        self.rdv = rv.PushRendezvous(self.rank, self.tp, self.tp, args.registration_wait_s, args.transfer_s)
        self.arrivals = ar.KVArrivals()
        self._last_activity = 0.0

    # -- lifecycle -------------------------------------------------------------------
    def setup(self) -> None:
        _die_with_parent()
        self.mm = map_fd(self.args.fd, self.memory.nbytes)
        self.base_addr = mapping_addr(self.mm)
        self.nixl = NixlAgent(self.agent_name)
        self.nixl.register(self.base_addr, self.memory.nbytes)
        self.cmd = self.add_channel(self.socket(zmq.PULL, self.args.cmd_endpoint, bind=True),
                                    w.DEC_TO_WRITER, "vllm-scheduler")
        hs = self.socket(zmq.ROUTER, self.args.handshake_endpoint, bind=True)
        self.handshake = self.add_channel(hs, w.DEC_VHANDSHAKE, "peer-handshake", routed=True)
        self.events = self.socket(zmq.PUSH, self.args.event_endpoint, bind=False)
        self._emit(w.WriterReady(os.getpid(), self.agent_name))
        log.info("%s: %.1f MiB of vLLM KV registered (%d layers, %d blocks), handshake %s", self.name,
                 self.memory.nbytes / 2**20, len(self.memory.layers), self.memory.num_blocks,
                 self.args.handshake_endpoint)

    def teardown(self) -> None:
        for p in self.posted.values():
            for h in p.handles:
                self.nixl.release(h)
        for peer in list(self.peers.values()):
            self._close_link(peer)
        self.nixl.deregister()
        self.events.close(0)

    def _emit(self, msg: m.Msg) -> None:
        self.events.send(m.encode(msg))

    def hello(self) -> w.VllmHello:
        return w.VllmHello(self.engine_id, self.rank, self.tp, self.agent_name, self.nixl.metadata(),
                           self.base_addr, self.memory)

    # -- handshake -------------------------------------------------------------------
    def _add_peer(self, h: w.VllmHello) -> Peer:
        if h.tp != self.tp:
            raise ValueError(f"peer {h.engine_id} has tp={h.tp}, this instance tp={self.tp} (must match)")
        if not self.memory.same_pages(h.memory):
            raise ValueError(f"peer {h.engine_id} KV pages differ (block size, heads, dtype or layers)")
        old = self.peers.get((h.engine_id, h.rank))
        if old is not None:
            self._forget(old)
        agent = self.nixl.add_remote(h.agent_metadata)
        peer = Peer(h.engine_id, h.rank, agent, h.base_addr, h.memory)
        self.peers[(h.engine_id, h.rank)] = peer
        self.peers_by_agent[agent] = peer
        log.info("%s: connected to %s rank %d (agent %s)", self.name, h.engine_id, h.rank, agent)
        return peer

    def on_VllmHello(self, msg: w.VllmHello, identity: bytes) -> None:
        try:
            self._add_peer(msg)
        except ValueError as e:
            log.error("%s: refusing peer: %s", self.name, e)
            self.send(self.handshake, w.HandshakeRefused(str(e)), identity)
            return
        self.send(self.handshake, self.hello(), identity)

    def connect(self, engine_id: str, rank: int, endpoint: str) -> Peer:
        """D: handshake with a P writer (bounded); keep the socket open and monitored."""
        peer = self.peers.get((engine_id, rank))
        if peer is not None:
            return peer
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, limits.CONTROL_MSG_BYTES)
        sock.setsockopt(zmq.RCVTIMEO, HANDSHAKE_TIMEOUT_MS)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        secure_connect(sock, endpoint, self.security)
        sock.send(m.encode(self.hello()))
        try:
            reply = w.DEC_VHANDSHAKE.decode(sock.recv())
        except zmq.Again:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            raise TransferError(f"handshake with {engine_id} rank {rank} at {endpoint} timed out")
        if isinstance(reply, w.HandshakeRefused) or reply.engine_id != engine_id or reply.rank != rank:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            why = reply.reason if isinstance(reply, w.HandshakeRefused) else f"answered by {reply.engine_id}"
            raise TransferError(f"handshake with {engine_id} rank {rank} refused: {why}")
        peer = self._add_peer(reply)
        peer.endpoint, peer.link, peer.monitor = endpoint, sock, monitor
        return peer

    def _close_link(self, peer: Peer) -> None:
        if peer.link is not None:
            peer.link.disable_monitor()
            peer.monitor.close(0)
            peer.link.close(0)
            peer.link = peer.monitor = None

    def _forget(self, peer: Peer) -> None:
        self._close_link(peer)
        self.peers.pop((peer.engine_id, peer.rank), None)
        self.peers_by_agent.pop(peer.agent, None)
        self.nixl.remove_remote(peer.agent)

    def _check_links(self, now: float) -> None:
        for peer in list(self.peers.values()):
            if peer.monitor is None:
                continue
            try:
                peer.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            reason = f"prefill writer {peer.agent} lost (its connection closed)"
            log.error("%s: %s", self.name, reason)
            self._forget(peer)
            for tid, src in list(self.sources.items()):
                if src == (peer.engine_id, peer.rank):
                    self.sources.pop(tid)  # nothing can still write: no quarantine
                    self._apply(self.arrivals.cancel(tid, 0, reason, now), now)
            for tid in list(self.quarantine):
                self._release_quarantine(tid)

    # -- commands from vLLM's scheduler ------------------------------------------------
    def on_SendBlocks(self, msg: w.SendBlocks) -> None:
        now = time.monotonic()
        self._last_activity = now
        mark("p_send_recvd", msg.transfer_id)
        self.req_of[msg.transfer_id] = msg.req_id
        self._poll_notifs(now)  # a registration may already wait in NIXL's queue
        try:
            acts = self.rdv.on_prefill_done(msg.transfer_id, 0, msg.block_ids, msg.num_tokens, 0, now)
        except A.ProtocolError as e:
            self._emit(w.BlocksSent(msg.req_id, msg.transfer_id, False, f"refused: {e}"))
            return
        self._apply(acts, now)

    def on_ExpectBlocks(self, msg: w.ExpectBlocks) -> None:
        now = time.monotonic()
        self._last_activity = now
        src = msg.source
        try:
            peer = self.connect(src.engine_id, self.rank, src.handshake[self.rank])
        except Exception as e:
            self._emit(w.BlocksFailed(msg.req_id, msg.transfer_id, f"cannot reach prefill writer: {e}"))
            return
        try:
            acts = self.arrivals.expect(msg.transfer_id, 0, msg.block_ids, [self.rank], now + msg.deadline_s)
        except (ar.ProtocolError, ValueError) as e:
            self._emit(w.BlocksFailed(msg.req_id, msg.transfer_id, f"registration refused: {e}"))
            return
        self.req_of[msg.transfer_id] = msg.req_id
        self.sources[msg.transfer_id] = (peer.engine_id, peer.rank)
        self._apply(acts, now)
        mark("d_register_sent", msg.transfer_id)
        self._notify(peer, m.Register(msg.transfer_id, 0, self.engine_id, self.rank, self.tp,
                                      msg.block_ids, msg.num_tokens, msg.deadline_s))

    def on_CancelBlocks(self, msg: w.CancelBlocks) -> None:
        now = time.monotonic()
        if self.role == "prefill":
            self._apply(self.rdv.cancel(msg.transfer_id, 0, msg.reason, now), now)
        else:
            self._apply(self.arrivals.cancel(msg.transfer_id, 0, msg.reason, now), now)

    # -- NIXL notifications ------------------------------------------------------------
    def _notify(self, peer: Peer, msg: m.Msg) -> None:
        try:
            self.nixl.send_notif(peer.agent, m.encode(msg))
        except Exception as e:  # a dead peer: its deadline or the link monitor covers it
            self.counters["notif_send_failed"] += 1
            log.error("%s: %s to %s failed: %s transfer_id=%s", self.name, type(msg).__name__, peer.agent, e,
                      getattr(msg, "transfer_id", ""))

    def _poll_notifs(self, now: float) -> None:
        for agent, payload, msg in self.nixl.poll_decoded(m.DEC_PEER):
            self._last_activity = now
            if isinstance(msg, Exception):
                self.counters["bad_notif"] += 1
                log.error("%s: undecodable notification from %s: %s", self.name, agent, msg)
                continue
            self._on_notif(msg, agent, now)

    def _on_notif(self, msg, agent: str, now: float) -> None:
        if isinstance(msg, m.Register):
            if agent not in self.peers_by_agent:
                self.counters["register_from_unknown_peer"] += 1
                return
            mark("p_registration_recvd", msg.transfer_id)
            self._apply(self.rdv.on_registration(msg, now), now)
        elif isinstance(msg, m.CancelTransfer):
            self._apply(self.rdv.cancel(msg.transfer_id, msg.generation, msg.reason, now), now)
        elif isinstance(msg, (m.WriteDone, m.WriteFailed)):
            peer = self.peers_by_agent.get(agent)
            src = self.sources.get(msg.transfer_id)
            if src is not None and (peer is None or (peer.engine_id, peer.rank) != src):
                self.counters["completion_from_wrong_peer"] += 1
                return
            if msg.transfer_id in self.quarantine:
                self._release_quarantine(msg.transfer_id)
                return
            if isinstance(msg, m.WriteFailed):  # the producer itself reported: nothing can land any more
                self.sources.pop(msg.transfer_id, None)
                self._apply(self.arrivals.on_write_failed(msg, now), now)
            else:
                self._apply(self.arrivals.on_write_done(msg, now), now)
        else:
            self.counters["unexpected_notif"] += 1

    # -- protocol actions ------------------------------------------------------------------
    def _apply(self, actions, now: float) -> None:
        outcome: dict[str, object] = {}
        for a in actions:
            if isinstance(a, (A.Completed, A.Failed)):
                outcome[a.transfer_id] = a
        for a in actions:
            if isinstance(a, A.PostWrite):
                self._post_write(a, now)
            elif isinstance(a, A.NotifyFailure):
                for reg in a.registrations:
                    peer = self.peers.get((reg.d_engine_id, reg.d_rank))
                    if peer is not None:
                        self._notify(peer, m.WriteFailed(a.transfer_id, a.generation, self.rank, a.reason))
            elif isinstance(a, A.FreeBlocks):
                o = outcome.get(a.transfer_id)
                ok = isinstance(o, A.Completed)
                nbytes, ndescs, secs = self.stats.pop(a.transfer_id, (0, 0, 0.0))
                reason = "" if ok else (o.reason if isinstance(o, A.Failed) else a.reason)
                self._emit(w.BlocksSent(self.req_of.pop(a.transfer_id, ""), a.transfer_id, ok, reason,
                                        nbytes, ndescs, secs))
            elif isinstance(a, A.Received):
                mark("d_kv_received", a.transfer_id)
                self.sources.pop(a.transfer_id, None)
                self._emit(w.BlocksReceived(self.req_of.pop(a.transfer_id, ""), a.transfer_id,
                                            a.nbytes, a.num_descs))
            elif isinstance(a, A.Failed) and self.role == "decode":
                self._fail_receive(a.transfer_id, a.reason, now)
            elif isinstance(a, A.Count):
                self.counters[a.name] += 1

    def _fail_receive(self, tid: str, reason: str, now: float) -> None:
        """Tell P to stop; report the blocks failed only once no WRITE can still land."""
        src = self.sources.pop(tid, None)
        peer = self.peers.get(src) if src else None
        if peer is None:
            self._emit(w.BlocksFailed(self.req_of.pop(tid, ""), tid, reason))
            return
        self._notify(peer, m.CancelTransfer(tid, 0, reason))
        self.quarantine[tid] = (now + self.args.transfer_s, reason)

    def _release_quarantine(self, tid: str) -> None:
        _, reason = self.quarantine.pop(tid)
        self._emit(w.BlocksFailed(self.req_of.pop(tid, ""), tid, reason))

    def _post_write(self, a: A.PostWrite, now: float) -> None:
        p = Posted(self.req_of.get(a.transfer_id, ""), a.transfer_id, [], now, 0, 0)
        try:
            for reg in a.registrations:
                peer = self.peers.get((reg.d_engine_id, reg.d_rank))
                if peer is None:
                    raise TransferError(f"no handshake with {reg.d_engine_id} rank {reg.d_rank}")
                regions = map_blocks(self.memory, a.block_ids, peer.memory, reg.block_ids)
                nbytes = sum(r[2] for r in regions)
                done = m.WriteDone(a.transfer_id, a.generation, self.rank, 0, nbytes, len(regions))
                p.handles.append(self.nixl.post("WRITE", regions, self.base_addr, peer.agent, peer.base_addr,
                                                m.encode(done)))
                p.nbytes += nbytes
                p.num_descs += len(regions)
        except Exception as e:
            log.error("%s: WRITE failed to post: %s transfer_id=%s", self.name, e, a.transfer_id)
            p.failed = f"WRITE failed to post: {e}"
        mark("p_write_posted", a.transfer_id)
        self.posted[a.transfer_id] = p
        if not p.handles:
            self._finish_write(p, now)

    def _check_posted(self, now: float) -> None:
        for tid, p in list(self.posted.items()):
            stuck = "WRITE stuck; abandoned" if now - p.posted > 2 * self.args.transfer_s else ""
            pending, failure = self.nixl.reap(p.handles, "WRITE failed in flight", stuck)
            p.failed = p.failed or failure
            p.handles = pending
            if not pending:
                self._finish_write(p, now)

    def _finish_write(self, p: Posted, now: float) -> None:
        self.posted.pop(p.transfer_id, None)
        self.stats[p.transfer_id] = (p.nbytes, p.num_descs, now - p.posted)
        self._last_activity = now
        if p.failed:
            self._apply(self.rdv.on_write_failed(p.transfer_id, 0, p.failed, now), now)
        else:
            self._apply(self.rdv.on_write_done(p.transfer_id, 0, now), now)

    # -- the loop ---------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        self._poll_notifs(now)
        if self.posted:
            self._check_posted(now)
        self._check_links(now)
        nd = self.rdv.next_deadline()
        if nd is not None and nd <= now:
            self._apply(self.rdv.expire(now), now)
        nd = self.arrivals.next_deadline()
        if nd is not None and nd <= now:
            self._apply(self.arrivals.expire(now), now)
        for tid, (deadline, _) in list(self.quarantine.items()):
            if deadline <= now:
                self._release_quarantine(tid)
        if os.getppid() != self.args.parent_pid:
            log.error("%s: vLLM worker %d is gone; exiting", self.name, self.args.parent_pid)
            self.stopping = True

    def poll_timeout_ms(self) -> int:
        if self.posted:
            return 0  # we drive UCX progress while data moves
        busy = (self.rdv.next_deadline() is not None or self.arrivals.next_deadline() is not None
                or self.quarantine or time.monotonic() - self._last_activity < 0.05)
        return BUSY_POLL_MS if busy else IDLE_POLL_MS


def _die_with_parent() -> None:
    """SIGTERM when the vLLM worker dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="pushkv writer for one vLLM worker (started by the connector)")
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--fd", type=int, required=True, help="inherited shared-memory fd of the KV cache")
    ap.add_argument("--memory", required=True, help="msgpack KVMemory, hex")
    ap.add_argument("--cmd-endpoint", required=True)
    ap.add_argument("--event-endpoint", required=True)
    ap.add_argument("--handshake-endpoint", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--registration-wait-s", type=float, default=30.0)
    ap.add_argument("--transfer-s", type=float, default=30.0)
    ap.add_argument("--secret-file", default="", help="CURVE secret for the tcp handshake sockets")
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("PUSHKV_LOG", "INFO"),
                        format=f"%(asctime)s pushkv-writer[{args.role}-{args.rank}] %(levelname)s %(message)s")
    try:
        import setproctitle

        setproctitle.setproctitle(f"pushkv-vllm-writer {args.role} {args.engine_id} rank {args.rank}")
    except ImportError:
        pass
    VllmWriter(args).run()


if __name__ == "__main__":
    main()
