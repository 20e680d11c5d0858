"""The vLLM writer's D role: vLLM's ``ExpectBlocks`` / ``CancelBlocks`` and pushkv's completions in,
vLLM's ``BlocksReceived`` / ``BlocksFailed`` out.

What D decides is the pure ``writer/receive_side.ReceiveSide`` (arrivals, producers, quarantine);
the peers and notifications are the writer shell's (``writer/shell.py``). Here is only the mapping:
vLLM's request ids to pushkv's transfers (generation 0: vLLM retries under a new transfer id) and
the side's effects to vLLM's events.
"""
from __future__ import annotations

import time
from typing import Callable

from pushkv import messages as m
from pushkv.protocol import actions as A
from pushkv.protocol import arrivals as ar
from pushkv.protocol.tp import producers_for
from pushkv.trace import stamp as mark
from pushkv.vllm import wire as w
from pushkv.writer.peers import Peer
from pushkv.writer.receive_side import Lost, ReceiveSide
from pushkv.writer.shell import WriterShell


class Receiver:
    def __init__(self, shell: WriterShell, tp: int, total_kv_heads: int, transfer_s: float,
                 emit: Callable[[m.Msg], None]):
        self.shell = shell
        self.tp, self.total_kv_heads = tp, total_kv_heads
        self.emit = emit
        self.req_of: dict[str, str] = {}  # transfer id -> this instance's vLLM request id
        self.side = ReceiveSide(transfer_s, lambda e, r: (e, r) in shell.peers)

    def pending(self) -> bool:
        return self.side.pending()

    def expect(self, msg: w.ExpectBlocks) -> None:
        """Register with every P rank that produces our heads, once their handshakes are done
        (now, if they are); the loop goes on meanwhile."""
        now = self.shell.last_activity = time.monotonic()
        other = self.req_of.get(msg.transfer_id)
        if other is not None:  # refused alone: the request that has it keeps its transfer and its blocks
            self.emit(w.BlocksFailed(msg.req_id, msg.transfer_id, f"transfer id {msg.transfer_id} is in flight "
                                     f"for request {other} already (a router must give each D request its own)"))
            return
        self.req_of[msg.transfer_id] = msg.req_id
        rank = self.shell.rank
        self.shell.peers.when_source_connected(
            msg.transfer_id, msg.source, lambda p_tp: producers_for(rank, self.tp, p_tp, self.total_kv_heads),
            lambda peers: self._register(msg, peers),
            lambda why: self._failed(msg.transfer_id, f"cannot reach prefill writer: {why}"), now)

    def _register(self, msg: w.ExpectBlocks, peers: list[Peer]) -> None:
        now = time.monotonic()
        try:
            effects = self.side.expect((msg.transfer_id, 0), msg.source.engine_id, [p.rank for p in peers],
                                       msg.block_ids, now + msg.deadline_s, now)
        except (ar.ProtocolError, ValueError) as e:
            self._failed(msg.transfer_id, f"registration refused: {e}")
            return
        self._apply(effects)
        self.shell.warmup.warm_for(msg.transfer_id, now + msg.deadline_s)  # its parts are coming: poll hot
        mark("d_register_sent", msg.transfer_id)
        reg = m.Register(msg.transfer_id, 0, self.shell.engine_id, self.shell.rank, self.tp, msg.block_ids,
                         msg.num_tokens, msg.deadline_s, cached_tokens=msg.cached_tokens)
        for p in peers:
            self.shell.posting.notify(p, reg)

    def cancel(self, msg: w.CancelBlocks) -> None:
        if self.shell.peers.drop_wait(msg.transfer_id):  # still handshaking: nothing registered, nothing lands
            self._failed(msg.transfer_id, msg.reason)
        else:
            self._apply(self.side.cancel((msg.transfer_id, 0), msg.reason, time.monotonic()))

    def forget(self, msg: w.ForgetTransfer) -> None:
        """vLLM's request ended before it registered: P's ranks of ours free its blocks now (a rank we
        are not connected to frees them at its registration deadline)."""
        ranks = producers_for(self.shell.rank, self.tp, msg.source.tp, self.total_kv_heads)
        for r in ranks:
            peer = self.shell.peers.get((msg.source.engine_id, r))
            if peer is not None:
                self.shell.posting.notify(peer, m.CancelTransfer(msg.transfer_id, 0, msg.reason))

    def completion(self, msg: "m.WriteDone | m.WriteFailed", agent: str, now: float) -> None:
        peer = self.shell.peers.by_agent.get(agent)
        self._apply(self.side.completion(msg, (peer.engine_id, peer.rank) if peer else None, now))

    def rank_gone(self, peer: Peer, reason: str) -> None:
        """A P writer died: nothing of it can still write; its transfers fail now."""
        self._apply(self.side.rank_gone(peer.engine_id, peer.rank, f"prefill {reason}", time.monotonic()))

    def expire(self, now: float) -> None:
        self._apply(self.side.expire(now))

    def _failed(self, tid: str, reason: str) -> None:
        """The blocks of vLLM's request for ``tid`` failed to arrive (and nothing lands in them)."""
        self.shell.warmup.cool(tid)
        self.emit(w.BlocksFailed(self.req_of.pop(tid, ""), tid, reason))

    def _apply(self, effects: list) -> None:
        for e in effects:
            if isinstance(e, A.Received):
                mark("d_kv_received", e.transfer_id)
                self.shell.warmup.cool(e.transfer_id)
                self.emit(w.BlocksReceived(self.req_of.pop(e.transfer_id, ""), e.transfer_id, e.nbytes, e.num_descs))
            elif isinstance(e, Lost):
                self._failed(e.key[0], e.reason)
            else:
                self.shell.count_or_tell(e, self.shell.posting.notify)
