"""D side writer: registers reserved blocks with P's writers (push), or READs
them from P (pull, background), and reports the KV received once every
producer rank has completed. Handshakes with P's writers run on the loop: a
request whose producers are not connected yet waits for them (``peers.when_connected``)
while every other transfer goes on. Pull's READs from one P instance go through a link
queue (``writer/link_posts.py``, the queue P's writer runs for its WRITEs) under the
deployment's link window and order: over UCX's TCP lanes two at a time (``AUTO_WINDOW``), where
READs posted at once waited for the one moving and then shared the link, each ending as late as
the last (docs/results/2026-12-03-read-queue)."""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pushkv import faults
from pushkv import messages as m
from pushkv.kv import layout as L
from pushkv.protocol import actions as A
from pushkv.protocol import arrivals as ar
from pushkv.protocol.link_queue import window_of
from pushkv.protocol.tp import head_overlap, producers_for
from pushkv.transport import poster
from pushkv.transport.staged_parts import PartLedger
from pushkv.writer import sides
from pushkv.writer.base import InFlight, WriterBase
from pushkv.writer.kv_damage import KVDamage
from pushkv.writer.link_posts import LinkPosts
from pushkv.writer.stage_in import Ending, StageIn

log = logging.getLogger(__name__)

_REFUSED = {"finished": "transfer already finished",
            "newer_generation_waiting": "stale generation (a newer one is registered)"}


@dataclass
class Registered:
    """A transfer whose blocks we registered with its producer ranks (push)."""

    source: m.PrefillSource
    ranks: tuple[int, ...]
    reported: set[int] = field(default_factory=set)  # producer ranks that sent WriteDone/WriteFailed
    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    checksums: "m.KVChecksums | None" = None  # --kv-verify: P's, from the first WriteDone that has them
    sent: float = 0.0  # wall time our Register left (the scheduler's registration_sent is when it asked)
    cached_tokens: int = 0  # the prompt's first tokens already in our blocks (prefix cache): not written
    slots: "list[int] | None" = None  # --staging pushkv: the staging area's blocks P WRITEs into
    parts: "PartLedger | None" = None  # --staging pushkv: what of them landed, and what is copied in
    part_copied: tuple[float, ...] = ()  # wall times of its first and newest part copy
    parts_landed: list[float] = field(default_factory=list)  # wall times each PartWritten came (pw<n>_landed)


@dataclass
class SlotWait:
    """--staging pushkv: a registration waiting for room in the staging area."""

    key: tuple[str, int]
    deadline: float
    then: Callable[[list[int]], None]


class DecodeWriter(WriterBase):
    def __init__(self, cfg, inst, rank):
        super().__init__(cfg, inst, rank)
        self.arrivals = ar.KVArrivals()
        self._registered: dict[tuple[str, int], Registered] = {}
        self._reads: dict[tuple[str, int], m.ReadKV] = {}
        self._reads_cancelled: dict[tuple[str, int], str] = {}  # READs in flight whose request was cancelled
        self.quarantine = sides.Quarantine()  # failed transfers a producer may still write into
        self._dead_engines: set[str] = set()
        self.stage_in: "StageIn | None" = None  # --staging pushkv: copies from the area into the pool
        # pull's READs per P instance under the link window (None: each posted at once, as on a fast link)
        window = window_of(cfg.link_window, cfg.link_window_mib, poster.wanted("auto", os.environ.get("UCX_TLS", "")),
                           "read" if cfg.mode == "pull" else "write")  # push's late READs: on a stream with WRITEs
        self.link_posts = LinkPosts(window, cfg.link_order) if window is not None else None
        self._reads_queued: dict[tuple[str, int], tuple[m.ReadKV, list]] = {}  # READs waiting on their link
        self._read_links: dict[tuple[str, int], tuple[Any, Any]] = {}  # READ -> (its link, post id) in flight

    def setup(self) -> None:
        super().setup()
        if self.area is not None:
            self.stage_in = StageIn(self.area)
        # start the handshakes with the configured prefill instance, off the TTFT path
        if self.cfg.mode in ("push", "pull"):
            now = time.monotonic()
            for src in self.cfg.role_instances("prefill"):  # every P instance this host planned
                if not src.handshake_endpoints:
                    continue
                for r in self._producers(src.tp):
                    self.peers.start_link(src.engine_id, r, src.handshake_endpoints[r], now)

    def damaged_by(self, kv: KVDamage) -> None:
        """Fault tests of --kv-verify: what we receive (push or pull) and what a READ moves, damaged."""
        self._received = kv.received(self._received)  # type: ignore[method-assign]
        self._read_done = kv.read_done(self._read_done)  # type: ignore[method-assign]
        self._read_dest = kv.read_dest(self._read_dest, self.cfg.prefill.block_size)  # type: ignore[method-assign]

    def has_pending(self) -> bool:
        return (sides.pending(self.arrivals) or bool(self.quarantine) or bool(self.peers.waits)
                or bool(self.stage_in) or bool(self.area is not None and self.area.queue))

    def _with_producers(self, key, src: m.PrefillSource, then, now: float) -> None:
        """``then(peers)`` once P's producer ranks for us are connected; KVFailed if one cannot be."""
        def failed(reason: str) -> None:
            self.counters["handshake_failed"] += 1
            self.warmup.cool(key)
            self.send(self.sched, m.KVFailed(key[0], key[1], f"cannot reach prefill writers: {reason}"))

        self.peers.when_source_connected(key, src, self._producers, then, failed, now)

    def _producers(self, p_tp: int) -> list[int]:
        """The ranks of a P instance of TP ``p_tp`` whose heads we take (ValueError: none can shard the model)."""
        return producers_for(self.rank, self.inst.tp, p_tp, self.layout.total_kv_heads)

    # -- push: registration at allocation time ------------------------------------------
    def on_ExpectKV(self, msg: m.ExpectKV) -> None:
        self._register(msg.transfer_id, msg.generation, msg.block_ids, msg.num_tokens, msg.source,
                       msg.deadline_s, msg.cached_tokens)

    def _register(self, tid: str, gen: int, block_ids, num_tokens: int, source: m.PrefillSource,
                  deadline_s: float, cached_tokens: int = 0) -> None:
        """Register our reserved blocks with the producer ranks (after their handshakes)."""
        deadline = time.monotonic() + deadline_s
        self.warmup.warm_for((tid, gen), deadline)  # P's WRITE and its WriteDone are coming: be awake for them
        self._with_producers((tid, gen), source, lambda peers: self._registered_with(
            tid, gen, block_ids, num_tokens, source, deadline_s, deadline, peers, cached_tokens), time.monotonic())

    def _registered_with(self, tid, gen, block_ids, num_tokens, source, deadline_s, deadline, peers,
                         cached_tokens: int = 0, slots: "list[int] | None" = None) -> None:
        now = time.monotonic()
        key = (tid, gen)
        written = len(block_ids) - cached_tokens // self.layout.block_size  # the blocks P WRITEs
        if self.area is not None and slots is None:  # --staging pushkv: P WRITEs into slots of our area
            if written > self.area.blocks:
                self.counters["staging_too_small"] += 1
                self.warmup.cool(key)
                self.send(self.sched, m.KVFailed(tid, gen, f"the KV needs {written} staging blocks and the staging "
                                                 f"area holds {self.area.blocks}: raise --staging-mib"))
                return
            wait = SlotWait(key, deadline, lambda got: self._registered_with(
                tid, gen, block_ids, num_tokens, source, deadline_s, deadline, peers, cached_tokens, got))
            self.area.queue.ask(wait, written)  # whole slots (the queue counts a wait for room)
            self._take_slots()
            return
        ranks = tuple(p.rank for p in peers)
        try:
            acts = self.arrivals.expect(tid, gen, block_ids, ranks, deadline)
        except ar.ProtocolError as e:  # a finished or older generation: nothing registered, nothing can land
            self._give_slots(slots)
            self.counters["expect_refused"] += 1
            self.warmup.cool(key)
            log.error("%s: registration refused: %s transfer_id=%s", self.name, e, tid)
            if self.arrivals.state_of(tid, gen) != "waiting":  # a live one answers itself
                reason = f"registration refused: {_REFUSED.get(e.state, e.state)}"
                self.send(self.sched, m.KVFailed(tid, gen, reason))
            return
        parts = None
        if slots is not None:  # what of the slots landed, part by part (they are copied in as they do)
            bs = self.layout.block_size
            parts = PartLedger(ranks, len(L.layer_groups(self.layout)), bs, num_tokens, cached_tokens // bs)
        self._registered[key] = Registered(source, ranks, block_ids=tuple(block_ids), num_tokens=num_tokens,
                                           cached_tokens=cached_tokens, slots=slots, parts=parts)
        self.apply(acts, now)
        # staged: P WRITEs into our slots (the cached prefix's entries, which it never writes, name the first)
        ids = tuple(block_ids) if slots is None else (slots[0],) * (len(block_ids) - written) + tuple(slots)
        reg = m.Register(tid, gen, self.inst.engine_id, self.rank, self.inst.tp, ids, num_tokens, deadline_s,
                         warm=key in self.warmup.warm, cached_tokens=cached_tokens)
        for p in peers:
            self.posting.control(p, reg)
        self._registered[key].sent = time.time()  # a held loop shows between the scheduler's stamp and this
        self.trace_event("registration_sent", tid)
        faults.point(self.name, "registration_sent")

    def notif_WriteDone(self, msg: m.WriteDone, agent: str, now: float) -> None:
        self.counters["write_done_received"] += 1  # one per producer rank per transfer
        if not self._from_producer(msg, agent):
            return
        reg = self._registered.get((msg.transfer_id, msg.generation))
        if reg is not None and reg.checksums is None:
            reg.checksums = msg.checksums
        self._producer_reported(msg, now)
        self.apply(self.arrivals.on_write_done(msg, now), now)

    def notif_PartWritten(self, msg: m.PartWritten, agent: str, now: float) -> None:
        """A producer's staged part landed in our slots: copy in what every producer's parts have
        landed now, while the later parts are on the wire."""
        if not self._from_producer(msg, agent):
            return
        key = (msg.transfer_id, msg.generation)
        reg = self._registered.get(key)
        if reg is None or reg.parts is None or self.stage_in is None:  # over (its rest copied), or not staged
            self.counters["part_written_ignored"] += 1
            return
        cells = reg.parts.landed(msg.p_rank, msg.spans)
        if cells is None:
            self.counters["part_written_bad"] += 1
            log.error("%s: PartWritten with spans %s from P rank %d does not fit transfer_id=%s", self.name,
                      msg.spans, msg.p_rank, msg.transfer_id)
            return
        self.counters["parts_written_received"] += 1
        reg.parts_landed.append(time.time())
        if not cells:  # another producer's part with these cells is still on the wire
            return
        assert reg.slots is not None
        self.stage_in.copy(key, reg.block_ids[reg.cached_tokens // self.layout.block_size:], reg.slots, cells)
        wall = time.time()
        reg.part_copied = (reg.part_copied[0] if reg.part_copied else wall, wall)
        self.counters["stage_in_part_copies"] += 1
        self.counters["stage_in_part_cells"] += sum(len(i) for _, i in cells)

    def notif_WriteFailed(self, msg: m.WriteFailed, agent: str, now: float) -> None:
        if not self._from_producer(msg, agent):
            return
        self._producer_reported(msg, now)
        self.apply(self.arrivals.on_write_failed(msg, now), now)

    def _from_producer(self, msg, agent: str) -> bool:
        """A completion counts only from the agent that is that transfer's producer rank."""
        reg = self._registered.get((msg.transfer_id, msg.generation))
        if reg is None:
            return True  # unknown / finished / stale: the arrivals machine counts it
        peer = self.peers.by_agent.get(agent)
        if peer is not None and peer.engine_id == reg.source.engine_id and peer.rank == msg.p_rank:
            return True
        self.counters["completion_from_wrong_peer"] += 1
        log.error("%s: %s for transfer_id=%s claims P rank %d but came from %s", self.name,
                  type(msg).__name__, msg.transfer_id, msg.p_rank, agent)
        return False

    def _producer_reported(self, msg, now: float) -> None:
        key = (msg.transfer_id, msg.generation)
        self.warmup.transfer_arrived(*key)
        reg = self._registered.get(key)
        if reg is not None:
            reg.reported.add(msg.p_rank)
        self._release(self.quarantine.answered(key, msg.p_rank))

    def on_CancelKV(self, msg: m.CancelKV) -> None:
        now = time.monotonic()
        key = (msg.transfer_id, msg.generation)
        self.warmup.cool(key)
        if self.area is not None and self.area.queue.drop(lambda w: w.key == key):  # never registered
            self.send(self.sched, m.KVFailed(msg.transfer_id, msg.generation, msg.reason))
            return
        ending = self.stage_in.ending.get(key) if self.stage_in is not None else None
        if ending is not None:  # the KV is here, being copied into the blocks: answer when that ends
            ending.reason = ending.reason or msg.reason
            self.counters["stage_in_cancel_deferred"] += 1
            return
        if self._drop_queued_read(key, msg.reason):  # never posted: nothing lands in the blocks
            self.send(self.sched, m.KVFailed(msg.transfer_id, msg.generation, msg.reason))
            return
        if key in self.posting.inflight and key in self._reads:  # our READ still lands in these blocks: answer then
            self._reads_cancelled[key] = msg.reason
            self.counters["read_cancel_deferred"] += 1
            return
        if self.peers.drop_wait(key) or key not in self._registered:  # nothing registered: nothing can be writing
            self.send(self.sched, m.KVFailed(msg.transfer_id, msg.generation, msg.reason))
            return
        self.apply(self.arrivals.cancel(msg.transfer_id, msg.generation, msg.reason, now), now)

    def apply(self, actions, now: float) -> None:
        for a in actions:
            key: Any = (a.transfer_id, a.generation) if hasattr(a, "transfer_id") else None
            if isinstance(a, (A.Received, A.Failed)):
                self.warmup.cool(key)
            if isinstance(a, A.Received):
                reg = self._registered.pop(key, None)
                if reg is not None and reg.slots is not None:
                    self._stage_in(key, a, reg)
                else:
                    self._received(a, reg)
            elif isinstance(a, A.Failed):
                self.counters["kv_failed"] += 1
                self._fail_transfer(key, a.reason, now)
            elif isinstance(a, A.Count):
                self.counters[a.name] += 1

    def _received(self, a: A.Received, reg: "Registered | None", staged: tuple = ()) -> None:
        """Every producer's bytes are in our blocks: the scheduler may decode from them."""
        self.counters["kv_received"] += 1
        self.trace_event("kv_received", a.transfer_id)
        stages = (("writer_registration_sent", reg.sent),) if reg is not None and reg.sent else ()
        self.send(self.sched, m.KVReceived(a.transfer_id, a.generation, a.first_token, a.nbytes, a.num_descs,
                                           timeline=stages + staged,
                                           checksums=reg.checksums if reg is not None else None))

    # -- --staging pushkv: the landed bytes go from the staging area to the pool ----------------
    def _stage_in(self, key, a: A.Received, reg: Registered) -> None:
        """Every producer's last WRITE landed: copy what no part copied yet into our blocks past
        the cached prefix (on the copy stream); ``check_staging`` reports the KV received once
        every copy into them is done."""
        assert self.stage_in is not None and reg.slots is not None and reg.parts is not None
        cells = reg.parts.rest()
        self.counters["stage_in_copies"] += 1
        self.counters["stage_in_rest_cells"] += sum(len(i) for _, i in cells)
        self.stage_in.finish(key, Ending(reg.slots, a, reg, started=time.time()),
                             reg.block_ids[reg.cached_tokens // self.layout.block_size:], reg.slots, cells)
        self.warmup.warm_for(key, time.monotonic() + self.cfg.timeouts.transfer_s)  # its report is a copy away
        self.check_staging()

    def _failed(self, key, reason: str, slots, lost: str = "") -> None:
        """Tell the scheduler the transfer failed and give its slots back, once no copy into its
        blocks runs any more (a part's may: then when it ends, ``check_staging``)."""
        if self.stage_in is not None and self.stage_in.running(key):
            self.counters["stage_in_fail_deferred"] += 1
            self.stage_in.finish(key, Ending(slots, reason=reason, lost=lost))
            return
        self.send(self.sched, m.KVFailed(key[0], key[1], reason, lost=lost))
        self._give_slots(slots)

    # -- the staging area's slots ----------------------------------------------------------
    def _take_slots(self) -> None:
        """Registrations waiting for staging room take it in arrival order while there is some."""
        while self.area is not None and (got := self.area.queue.grant()) is not None:
            wait, (slots,) = got  # D's area is whole: one cut, each slot in every layer group
            wait.then(slots)

    def _give_slots(self, slots) -> None:
        if slots and self.area is not None:
            self.area.queue.give_back([slots])
            self._take_slots()

    def check_staging(self) -> None:
        if self.stage_in is None:
            return
        for key, st in self.stage_in.ended():
            self.warmup.cool(key)
            self._give_slots(st.slots)
            if st.received is None or st.reason:  # every copy into the blocks is over: they may go back now
                self.counters["kv_failed"] += 1
                self.send(self.sched, m.KVFailed(key[0], key[1], st.reason, lost=st.lost))
                continue
            parts = st.reg.part_copied if st.reg is not None else ()
            stamps = tuple(zip(("stage_in_part_first", "stage_in_part_last"), parts))
            if st.reg is not None:
                stamps += tuple((f"pw{i}_landed", t) for i, t in enumerate(st.reg.parts_landed, 1))
            self._received(st.received, st.reg, stamps + (("stage_in_start", st.started),
                                                          ("stage_in_done", time.time())))

    def tick(self, now: float) -> None:
        super().tick(now)
        if self.stage_in:
            self.check_staging()

    def _fail_transfer(self, key, reason: str, now: float) -> None:
        """Tell the producers to stop; hand the blocks back only once no WRITE can land in them."""
        reg = self._registered.pop(key, None)
        self.warmup.transfer_arrived(*key)
        outstanding = set(reg.ranks) - reg.reported if reg else set()
        engine, slots = (reg.source.engine_id, reg.slots) if reg else ("", None)
        for r in outstanding:
            peer = self.peers.get((engine, r))
            if peer is not None:
                self.posting.control(peer, m.CancelTransfer(key[0], key[1], reason))
        if outstanding and engine not in self._dead_engines:
            self.counters["quarantined"] += 1
            self.quarantine.hold(key, engine, outstanding, now + self.cfg.timeouts.transfer_s, reason, slots)
        else:
            self._failed(key, reason, slots, self._lost)

    def peer_instance_down(self, engine_id: str, reason: str, now: float) -> None:
        """Producers that died cannot write any more: nothing to wait for."""
        self._dead_engines.add(engine_id)
        for key, reg in list(self._registered.items()):
            if reg.source.engine_id == engine_id:
                self.counters["failed_peer_death"] += 1
                with self.ending_for_loss("prefill", reason):
                    self.apply(self.arrivals.cancel(key[0], key[1], f"prefill instance lost: {reason}", now), now)
        self._release(self.quarantine.engine_gone(engine_id))
        why = f"prefill instance lost: {reason}"
        for key, (msg, _) in list(self._reads_queued.items()):
            if msg.pull.source.engine_id == engine_id:  # queued READs from it: never to be posted
                self.counters["failed_peer_death"] += 1
                self._drop_queued_read(key, why, tell_peers=False)
                with self.ending_for_loss("prefill", reason):
                    self.send(self.sched, m.KVFailed(key[0], key[1], why, lost=self._lost))
        self._dead_engines.discard(engine_id)  # a restarted instance is a live peer again

    def _release(self, released) -> None:
        """Quarantined blocks no WRITE can land in any more go back to the scheduler."""
        for key, q in released:
            self._failed(key, q.reason, q.slots)

    def expire(self, now: float) -> None:
        for w in self.area.queue.drop(lambda w: w.deadline <= now) if self.area is not None else ():
            self.counters["staging_wait_expired"] += 1
            self.warmup.cool(w.key)
            self.send(self.sched, m.KVFailed(w.key[0], w.key[1], "no room in the staging area within the "
                                             "transfer's deadline"))
        self.apply(sides.due(self.arrivals, now), now)
        for key, q in self.quarantine.expired(now):
            self.counters["quarantine_expired"] += 1
            self._release([(key, q)])

    # -- pull, background: READ on the writer --------------------------------------------
    def on_ReadKV(self, msg: m.ReadKV) -> None:
        p = msg.pull
        if msg.write:  # register now, after the relay; P WRITEs (the scheduler says: TransferPlan.direction)
            self._register(msg.transfer_id, msg.generation, msg.block_ids, p.num_tokens, p.source, msg.deadline_s,
                           msg.cached_tokens)
            return
        self._with_producers((msg.transfer_id, msg.generation), p.source,
                             lambda peers: self._post_read(msg, peers), time.monotonic())

    def on_RenewKV(self, msg: m.RenewKV) -> None:
        """Our scheduler still means to read this request's KV: tell the P ranks we read from to
        keep their lease. Not past our own READ deadline: by then we give the READ up, and P's
        cap (lease_max_s) bounds the rest. A producer not connected yet gets its handshake started
        (the READ will need it) and this renewal is skipped: the next one, a third of the lease
        later, finds it connected."""
        now = time.monotonic()
        key = (msg.transfer_id, msg.generation)
        read, fl = self._reads.get(key), self.posting.inflight.get(key)
        if read is not None and fl is not None and now - fl.posted > read.deadline_s:
            self.counters["lease_renew_past_deadline"] += 1
            return
        src = msg.source
        renew = m.RenewLease(msg.transfer_id, msg.generation, self.rank)
        try:
            ranks = self._producers(src.tp)
        except ValueError:  # a TP size that cannot shard the model: nobody to renew with
            self.counters["bad_source"] += 1
            return
        for r in ranks:
            peer = self.peers.get((src.engine_id, r))
            if peer is not None:
                self.posting.notify(peer, renew)
                self.counters["lease_renewals_sent"] += 1
            else:
                self.counters["lease_renew_no_peer"] += 1
                if r < len(src.handshake):
                    self.peers.start_link(src.engine_id, r, src.handshake[r], now)

    def _post_read(self, msg: m.ReadKV, peers) -> None:
        """Post the READ, or queue it on its P's link (``link_posts``) behind the READs before it."""
        if self.link_posts is None:
            return self._post_read_now(msg, peers)
        key, now = (msg.transfer_id, msg.generation), time.monotonic()
        blocks = -(-(msg.pull.num_tokens - msg.cached_tokens) // self.layout.block_size)
        nbytes = blocks * L.block_bytes(self.layout)
        self._reads_queued[key] = (msg, peers)
        self.counters["read_posts_queued"] += 1
        # one queue per P instance (its ranks' READs go together, one post): the link's rank is 0
        released = self.link_posts.offer((msg.pull.source.engine_id, 0), key, nbytes, nbytes, now + msg.deadline_s,
                                         now, (msg, peers))
        if not released:
            self.counters["read_posts_waited"] += 1  # behind a READ on its link
        self._send_reads(released)

    def _send_reads(self, released) -> None:
        """Post the READs their links released (each ending may release the next: ``transfer_finished``)."""
        for link, pid, (msg, peers) in released:  # (a cancelled READ was dropped from its queue: never here)
            key = (msg.transfer_id, msg.generation)
            del self._reads_queued[key]
            self._read_links[key] = (link, pid)
            self._post_read_now(msg, peers)

    def _drop_queued_read(self, key, reason: str, tell_peers: bool = True) -> bool:
        """Take a READ still waiting on its link out (never to be posted); True if it was. Its P ranks
        free their lease at once (``tell_peers``) instead of at its end."""
        queued = self._reads_queued.pop(key, None)
        if queued is None:
            return False
        if self.link_posts is not None:
            self.link_posts.drop(key)
        self.counters["read_posts_dropped"] += 1
        for peer in queued[1] if tell_peers else ():
            self.posting.control(peer, m.CancelTransfer(key[0], key[1], reason))
        return True

    def _post_read_now(self, msg: m.ReadKV, peers) -> None:
        now = time.monotonic()
        p = msg.pull
        faults.point(self.name, "read_posted")
        fl = InFlight(msg.transfer_id, msg.generation, posted=now)
        # the prompt's first cached_tokens are in our prefix cache (whole blocks of both sides): READ the rest
        t0 = msg.cached_tokens
        dst, num_tokens = self._read_dest(msg)
        try:
            for peer in peers:
                heads = head_overlap(peer.rank, p.source.tp, self.rank, self.inst.tp, self.layout.total_kv_heads)
                if heads is None:
                    continue
                src = p.block_ids[t0 // peer.layout.block_size:]
                # a READ may need P's progress: wake P before posting
                h, nbytes, runs = self.posting.post_blocks(
                    "READ", peer, heads, src, dst, num_tokens - t0,
                    before=functools.partial(self.warmup.wake_peer, peer, msg.transfer_id, msg.generation))
                fl.handles.append(h)
                fl.nbytes += nbytes
                fl.num_descs += runs
        except Exception as e:
            fl.failed = f"READ failed to post: {e}"
        self.trace_event("read_posted", msg.transfer_id, f"{fl.nbytes}B/{fl.num_descs}d")
        self._reads[(msg.transfer_id, msg.generation)] = msg
        self.posting.book((msg.transfer_id, msg.generation), fl, now)

    def _read_dest(self, msg: m.ReadKV) -> tuple:
        """The blocks a READ lands in (past our cached prefix) and its end token."""
        return msg.block_ids[msg.cached_tokens // self.layout.block_size:], msg.pull.num_tokens

    def transfer_finished(self, fl: InFlight, now: float) -> None:
        msg = self._reads.pop((fl.transfer_id, fl.generation), None)
        if msg is None:
            return
        cancelled = self._reads_cancelled.pop((fl.transfer_id, fl.generation), "")
        fl.failed = fl.failed or cancelled  # answered only now: the READ wrote into the blocks until it ended
        self.trace_event("read_failed" if fl.failed else "read_done", fl.transfer_id)
        src = msg.pull.source
        ranks = self._producers(src.tp)
        for r in ranks:  # P frees on ReadDone, or on CancelTransfer when we failed
            peer = self.peers.get((src.engine_id, r))
            if peer is None:
                continue
            if fl.failed:
                self.posting.control(peer, m.CancelTransfer(fl.transfer_id, fl.generation, fl.failed))
            else:
                self.posting.notify(peer, m.ReadDone(fl.transfer_id, fl.generation, self.rank))
        if fl.failed:
            lost = self._lost or sides.peer_gone(fl.failed, "prefill")
            self.send(self.sched, m.KVFailed(fl.transfer_id, fl.generation, fl.failed, lost=lost))
        else:
            self.counters["bytes_read"] += fl.nbytes
            self._read_done(fl, msg, now)
        link = self._read_links.pop((fl.transfer_id, fl.generation), None)
        if link is not None and self.link_posts is not None:  # its link's room: the next READ goes
            self._send_reads(self.link_posts.done(*link))

    def _read_done(self, fl: InFlight, msg: m.ReadKV, now: float) -> None:
        """The READ's bytes are in our blocks: the scheduler may decode from them."""
        wall = time.time()
        stages = (("read_posted", wall - (now - fl.posted)), ("read_done", wall))
        self.send(self.sched, m.KVReceived(fl.transfer_id, fl.generation, msg.pull.first_token,
                                           fl.nbytes, fl.num_descs, now - fl.posted, stages))
