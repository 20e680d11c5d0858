"""D side writer: registers reserved blocks with P's writers (push), or READs
them from P (pull, background), and reports the KV received once every
producer rank has completed."""
from __future__ import annotations

import logging
import time

from pushkv import faults
from pushkv import messages as m
from pushkv.protocol import actions as A
from pushkv.protocol import arrivals as ar
from pushkv.protocol.mapping import map_transfer
from pushkv.protocol.tp import head_overlap, producers_for
from pushkv.writer.base import InFlight, WriterBase

log = logging.getLogger(__name__)

_REFUSED = {"finished": "transfer already finished",
            "newer_generation_waiting": "stale generation (a newer one is registered)"}


class DecodeWriter(WriterBase):
    def __init__(self, cfg, inst, rank):
        super().__init__(cfg, inst, rank)
        self.arrivals = ar.KVArrivals()
        self._sources: dict[tuple[str, int], tuple[m.PrefillSource, tuple[int, ...]]] = {}
        self._reads: dict[tuple[str, int], m.ReadKV] = {}
        self._reported: dict[tuple[str, int], set[int]] = {}
        # failed transfers whose producers may still be writing: (outstanding ranks, deadline, reason)
        self._quarantine: dict[tuple[str, int], tuple[set[int], float, str, str]] = {}
        self._dead_engines: set[str] = set()

    def setup(self) -> None:
        super().setup()
        # warm the handshake with the configured prefill instance, off the TTFT path
        if self.cfg.mode in ("push", "pull") and self.cfg.prefill.handshake_endpoints:
            src = self.cfg.prefill
            for r in producers_for(self.rank, self.inst.tp, src.tp, self.layout.total_kv_heads):
                try:
                    self.connect_peer(src.engine_id, r, src.handshake_endpoints[r])
                except Exception as e:  # lazily retried at the first request
                    log.warning("%s: early handshake with %s rank %d failed: %s", self.name, src.engine_id, r, e)

    def has_pending(self) -> bool:
        return self.arrivals.next_deadline() is not None or bool(self._quarantine)

    def _producers(self, src: m.PrefillSource):
        ranks = producers_for(self.rank, self.inst.tp, src.tp, self.layout.total_kv_heads)
        return [self.connect_peer(src.engine_id, r, src.handshake[r]) for r in ranks]

    # -- push: registration at allocation time ------------------------------------------
    def on_ExpectKV(self, msg: m.ExpectKV) -> None:
        now = time.monotonic()
        key = (msg.transfer_id, msg.generation)
        try:
            peers = self._producers(msg.source)
        except Exception as e:
            self.counters["handshake_failed"] += 1
            self.send(self.sched, m.KVFailed(msg.transfer_id, msg.generation, f"cannot reach prefill writers: {e}"))
            return
        ranks = tuple(p.rank for p in peers)
        try:
            acts = self.arrivals.expect(msg.transfer_id, msg.generation, msg.block_ids, ranks, now + msg.deadline_s)
        except ar.ProtocolError as e:  # a finished or older generation: nothing registered, nothing can land
            self.counters["expect_refused"] += 1
            log.error("%s: ExpectKV refused: %s transfer_id=%s", self.name, e, msg.transfer_id)
            if self.arrivals.state_of(msg.transfer_id, msg.generation) != "waiting":  # a live one answers itself
                reason = f"registration refused: {_REFUSED.get(e.state, e.state)}"
                self.send(self.sched, m.KVFailed(msg.transfer_id, msg.generation, reason))
            return
        self._sources[key] = (msg.source, ranks)
        self._reported[key] = set()
        self.apply(acts, now)
        reg = m.Register(msg.transfer_id, msg.generation, self.inst.engine_id, self.rank, self.inst.tp,
                         msg.block_ids, msg.num_tokens, msg.deadline_s)
        for p in peers:
            self.notify(p, reg)
        self.trace_event("registration_sent", msg.transfer_id)
        faults.point(self.name, "registration_sent")

    def notif_WriteDone(self, msg: m.WriteDone, agent: str, now: float) -> None:
        self.counters["write_done_received"] += 1  # one per producer rank per transfer
        if not self._from_producer(msg, agent):
            return
        self._producer_reported(msg, now)
        self.apply(self.arrivals.on_write_done(msg, now), now)

    def notif_WriteFailed(self, msg: m.WriteFailed, agent: str, now: float) -> None:
        if not self._from_producer(msg, agent):
            return
        self._producer_reported(msg, now)
        self.apply(self.arrivals.on_write_failed(msg, now), now)

    def _from_producer(self, msg, agent: str) -> bool:
        """A completion counts only from the agent that is that transfer's producer rank."""
        entry = self._sources.get((msg.transfer_id, msg.generation))
        if entry is None:
            return True  # unknown / finished / stale: the arrivals machine counts it
        peer = self.peers_by_agent.get(agent)
        if peer is not None and peer.engine_id == entry[0].engine_id and peer.rank == msg.p_rank:
            return True
        self.counters["completion_from_wrong_peer"] += 1
        log.error("%s: %s for transfer_id=%s claims P rank %d but came from %s", self.name,
                  type(msg).__name__, msg.transfer_id, msg.p_rank, agent)
        return False

    def _producer_reported(self, msg, now: float) -> None:
        key = (msg.transfer_id, msg.generation)
        if key in self._reported:
            self._reported[key].add(msg.p_rank)
        q = self._quarantine.get(key)
        if q is not None:
            q[0].discard(msg.p_rank)
            if not q[0]:
                self._release_quarantine(key)

    def on_CancelKV(self, msg: m.CancelKV) -> None:
        now = time.monotonic()
        key = (msg.transfer_id, msg.generation)
        if key not in self._sources:  # nothing registered: nothing can be writing
            self.send(self.sched, m.KVFailed(msg.transfer_id, msg.generation, msg.reason))
            return
        self.apply(self.arrivals.cancel(msg.transfer_id, msg.generation, msg.reason, now), now)

    def apply(self, actions, now: float) -> None:
        for a in actions:
            key = (a.transfer_id, a.generation) if hasattr(a, "transfer_id") else None
            if isinstance(a, A.Received):
                self._sources.pop(key, None)
                self._reported.pop(key, None)
                self.counters["kv_received"] += 1
                self.trace_event("kv_received", a.transfer_id)
                self.send(self.sched, m.KVReceived(a.transfer_id, a.generation, a.first_token, a.nbytes, a.num_descs))
            elif isinstance(a, A.Failed):
                self.counters["kv_failed"] += 1
                self._fail_transfer(key, a.reason, now)
            elif isinstance(a, A.Count):
                self.counters[a.name] += 1

    def _fail_transfer(self, key, reason: str, now: float) -> None:
        """Tell the producers to stop; hand the blocks back only once no WRITE can land in them."""
        entry = self._sources.pop(key, None)
        reported = self._reported.pop(key, set())
        outstanding = set(entry[1]) - reported if entry else set()
        if entry is not None:
            src, ranks = entry
            for r in outstanding:
                peer = self.peers.get((src.engine_id, r))
                if peer is not None:
                    self.notify(peer, m.CancelTransfer(key[0], key[1], reason))
        if outstanding and entry[0].engine_id not in self._dead_engines:
            self.counters["quarantined"] += 1
            self._quarantine[key] = (outstanding, now + self.cfg.timeouts.transfer_s, reason, entry[0].engine_id)
        else:
            self.send(self.sched, m.KVFailed(key[0], key[1], reason))

    def peer_instance_down(self, engine_id: str, reason: str, now: float) -> None:
        """Producers that died cannot write any more: nothing to wait for."""
        self._dead_engines.add(engine_id)
        for key, (src, _) in list(self._sources.items()):
            if src.engine_id == engine_id:
                self.counters["failed_peer_death"] += 1
                self.apply(self.arrivals.cancel(key[0], key[1], f"prefill instance lost: {reason}", now), now)
        for key in [k for k, q in self._quarantine.items() if q[3] == engine_id]:
            self._release_quarantine(key)
        self._dead_engines.discard(engine_id)  # a restarted instance is a live peer again

    def _release_quarantine(self, key) -> None:
        reason = self._quarantine.pop(key)[2]
        self.send(self.sched, m.KVFailed(key[0], key[1], reason))

    def expire(self, now: float) -> None:
        nd = self.arrivals.next_deadline()
        if nd is not None and nd <= now:
            self.apply(self.arrivals.expire(now), now)
        for key, q in list(self._quarantine.items()):
            if q[1] <= now:
                self.counters["quarantine_expired"] += 1
                self._release_quarantine(key)

    # -- pull, background: READ on the writer --------------------------------------------
    def on_ReadKV(self, msg: m.ReadKV) -> None:
        if self.cfg.pull_read == "write":  # register now, after the relay; P WRITEs (see config)
            p = msg.pull
            self.on_ExpectKV(m.ExpectKV(msg.transfer_id, msg.generation, msg.block_ids, p.num_tokens,
                                        p.source, msg.deadline_s))
            return
        now = time.monotonic()
        p = msg.pull
        faults.point(self.name, "read_posted")
        fl = InFlight(msg.transfer_id, msg.generation, posted=now)
        try:
            peers = self._producers(p.source)
            for peer in peers:
                heads = head_overlap(peer.rank, p.source.tp, self.rank, self.inst.tp, self.layout.total_kv_heads)
                if heads is None:
                    continue
                regions = map_transfer(peer.layout, p.block_ids, self.layout, msg.block_ids, p.num_tokens, heads)
                local = [(d, s, n) for s, d, n in regions]
                fl.handles.append(self.post("READ", peer, local))
                fl.nbytes += sum(r[2] for r in regions)
                fl.num_descs += len(regions)
        except Exception as e:
            fl.failed = f"READ failed to post: {e}"
        self.trace_event("read_posted", msg.transfer_id, f"{fl.nbytes}B/{fl.num_descs}d")
        self._reads[(msg.transfer_id, msg.generation)] = msg
        if fl.handles:
            self.inflight[(msg.transfer_id, msg.generation)] = fl
        else:
            self.transfer_finished(fl, now)

    def transfer_finished(self, fl: InFlight, now: float) -> None:
        msg = self._reads.pop((fl.transfer_id, fl.generation), None)
        if msg is None:
            return
        self.trace_event("read_failed" if fl.failed else "read_done", fl.transfer_id)
        src = msg.pull.source
        ranks = producers_for(self.rank, self.inst.tp, src.tp, self.layout.total_kv_heads)
        for r in ranks:  # P frees on ReadDone, or on CancelTransfer when we failed
            peer = self.peers.get((src.engine_id, r))
            if peer is None:
                continue
            if fl.failed:
                self.notify(peer, m.CancelTransfer(fl.transfer_id, fl.generation, fl.failed))
            else:
                self.notify(peer, m.ReadDone(fl.transfer_id, fl.generation, self.rank))
        if fl.failed:
            self.send(self.sched, m.KVFailed(fl.transfer_id, fl.generation, fl.failed))
        else:
            self.counters["bytes_read"] += fl.nbytes
            wall = time.time()
            stages = (("read_posted", wall - (now - fl.posted)), ("read_done", wall))
            self.send(self.sched, m.KVReceived(fl.transfer_id, fl.generation, msg.pull.first_token,
                                               fl.nbytes, fl.num_descs, now - fl.posted, stages))
