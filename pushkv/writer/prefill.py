"""P side writer: rendezvous of prefill-done and D's registration, then WRITE.

Pull mode: holds finished blocks under a lease until D's READ is done.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

from pushkv import faults
from pushkv import messages as m
from pushkv.kv import damage
from pushkv.kv.layout import transfer_of, window_group
from pushkv.protocol import actions as A
from pushkv.protocol import rendezvous as rv
from pushkv.protocol.lease import Leases
from pushkv.protocol.link_queue import window_of
from pushkv.protocol.tp import consumers_for, head_overlap
from pushkv.transport import poster
from pushkv.transport.nixl_agent import TransferError
from pushkv.transport.poster import QueuedPost
from pushkv.transport.stage_slots import Grant, Placement, placement
from pushkv.writer import sides, staging
from pushkv.writer.base import InFlight, WriterBase
from pushkv.writer.kv_damage import KVDamage
from pushkv.writer.link_posts import LinkPosts
from pushkv.writer.posting import SpanPost

log = logging.getLogger(__name__)

MAX_TRACKED = 4096  # bounded bookkeeping for transfers that never complete


@dataclass
class _Post:
    """A planned WRITE to one D rank, waiting for its turn in that rank's link queue."""

    a: A.PostWrite
    reg: m.Register
    peer: object
    sp: SpanPost
    notif: bytes
    fl: InFlight
    staged: Any = None  # --staging pushkv: the copy of its bytes into the staging area (a CUDA event)
    slots: Optional[Grant] = None  # --staging pushkv: the area's cells it WRITEs from (per cut, its slots)


@dataclass
class _SlotWait:
    """A WRITE to one D rank waiting for room in the staging area (--staging pushkv)."""

    a: A.PostWrite
    reg: m.Register
    peer: object
    heads: tuple
    fl: InFlight
    place: Placement  # its spans, and the cells they need


class PrefillWriter(WriterBase):
    def __init__(self, cfg, inst, rank):
        super().__init__(cfg, inst, rank)
        t = cfg.timeouts
        plan = transfer_of(cfg)  # decided by the planner
        self.stream, unit = plan.sent, plan.unit
        # the rendezvous, its inputs in and effects out; each transfer's record
        self.side = sides.PrefillSide(rv.PushRendezvous(rank, inst.tp, self.layout.total_kv_heads,
                                                        t.registration_wait_s, t.transfer_s,
                                                        stream_unit=unit, stream_groups=plan.groups))
        self._parts_posted = 0  # keys of part WRITEs in flight: (tid, gen, n)
        self.leases = Leases(t.lease_s, t.lease_max_s)
        self.reads = plan.direction == "read"  # D READs from leases (pull); else every transfer is a WRITE
        self.damage = lambda effects: effects  # tests of --kv-verify: KVDamage's filter (damaged_by)
        self._checksums: dict[tuple[str, int], m.KVChecksums] = {}  # until the transfer's blocks are freed
        # one queue per D rank we WRITE into (cfg.link_window; None: every WRITE posts at once)
        window = window_of(cfg.link_window, cfg.link_window_mib, poster.wanted("auto", os.environ.get("UCX_TLS", "")))
        self.link_posts = LinkPosts(window, cfg.link_order) if window is not None else None
        self._slots_of: dict[int, Grant] = {}  # id(posted handle) -> the staging cells it WRITEs from
        # --staging pushkv: planned WRITEs whose copy into the area runs, in the copy stream's order
        # (the loop polls their events and never waits on one: a wait held the loop, and every
        # notification, registration and completion behind it, for the whole copy)
        self._copying: staging.Copying[_Post] = staging.Copying()
        self._poster_posts: dict[int, tuple[Any, int]] = {}  # id(poster's handle) -> (key, WRITE number): stamps
        self._held_back: list[tuple[float, m.HoldKV]] = []  # tests (faults' delay "hold"): holds handled late

    def has_pending(self) -> bool:
        return self.side.pending() or sides.pending(self.leases) or bool(self._copying) or bool(self._held_back)

    def tick(self, now: float) -> None:
        if self._copying:
            self._copies_done()
        super().tick(now)

    def poll_timeout_ms(self) -> int:
        if self._copying:  # a copy ends within milliseconds and its WRITE should go at once
            os.sched_yield()
            return 0
        return super().poll_timeout_ms()

    def damaged_by(self, kv: KVDamage) -> None:
        """Fault tests of --kv-verify: the side's effects go through ``kv`` (a last WRITE damaged)."""
        self.damage = kv.effects

    # -- from the scheduler ----------------------------------------------------------
    def on_SendKV(self, msg: m.SendKV) -> None:
        if msg.checksums is not None:  # --kv-verify: they go to D with the WRITE's notification
            self._checksums[(msg.transfer_id, msg.generation)] = msg.checksums
            while len(self._checksums) > MAX_TRACKED:  # transfers refused before they began
                self._checksums.pop(next(iter(self._checksums)))
        self._prefill_done(msg)

    def _prefill_done(self, msg: "m.SendKV | m.HoldKV", wait_s: float | None = None) -> None:
        """The blocks hold the KV: WRITE once D's registration is here (or now, if it is)."""
        now = time.monotonic()
        self.last_activity = now
        self.counters["prefill_done_received"] += 1
        # registrations may already sit in NIXL's queue: take them first
        self.posting.poll_notifs(now)
        key = (msg.transfer_id, msg.generation)
        self.apply(self.side.prefill_done(key, msg.block_ids, msg.num_tokens, msg.first_token, now, wait_s), now)
        self._sync_warm(key, now)

    def on_StreamKV(self, msg: m.StreamKV) -> None:
        """A prefill chunk ended: WRITE what is whole now (once D's registration is here)."""
        now = time.monotonic()
        self.last_activity = now
        self.counters["stream_progress_received"] += 1
        key = (msg.transfer_id, msg.generation)
        self._stamp(key, "stream_progress")
        self.posting.poll_notifs(now)
        self.apply(self.side.progress(key, msg.block_ids, msg.num_tokens, now), now)
        self._sync_warm(key, now)

    def takes_marks(self) -> bool:
        return self.stream == "layer"

    def on_LayersStored(self, msg: m.LayersStored) -> None:
        """Our worker stored a layer group of a step: once its event completes (the mark waiter's
        thread waits; a CPU mark has none), WRITE that group's computed units of each streaming
        prompt (once D's registration is here)."""
        self.last_activity = time.monotonic()
        self.counters["layer_marks_received"] += 1
        arrived = time.time()
        for e in msg.entries:
            stages = self._record((e.transfer_id, e.generation)).stages
            if msg.recorded:  # the worker's side of the mark: when its forward passed the group
                stages.setdefault(f"layers_recorded_{msg.group}", msg.recorded)
            stages.setdefault(f"layers_arrived_{msg.group}", arrived)
        if self.mark_waiter is None or not msg.event:  # the CPU: stored when the worker sent it
            self._take_mark(msg)
            return
        self.mark_waiter.submit(msg)

    def _marks_ready(self) -> None:
        if self.mark_waiter is None:
            return
        for msg, why in self.mark_waiter.ready():
            if why:  # the WRITE at prefill end still moves the group: streaming is lost, not the KV
                self.counters["layer_mark_failed"] += 1
                log.error("%s: %s (step %d): its WRITE waits for the prefill's end", self.name, why, msg.step_id)
                continue
            self._take_mark(msg)

    def _take_mark(self, msg: m.LayersStored) -> None:
        """A mark whose group is stored: WRITE it. A mark may trail the prefill half (they travel
        apart): the rendezvous counts and drops it."""
        now = time.monotonic()
        self.last_activity = now
        self.posting.poll_notifs(now)  # registrations may already sit in NIXL's queue: take them first
        for e in msg.entries:
            key = (e.transfer_id, e.generation)
            self._stamp(key, "stream_progress")
            self._stamp(key, f"layers_stored_{msg.group}")
            self.apply(self.side.progress(key, e.block_ids, e.num_tokens, now, group=msg.group), now)
            self._sync_warm(key, now)

    def _refused(self, r: sides.Refused) -> None:
        """A half the protocol refuses (its transfer already finished, say): these blocks were
        never handed over, so the scheduler may free them; a live half answers for itself."""
        self.counters["command_refused"] += 1
        log.error("%s: %s refused: %s transfer_id=%s", self.name, r.event, r.error, r.key[0])
        if not r.live and self.leases.deadline_of(*r.key) is None:
            self.send(self.sched, m.KVFailed(*r.key, f"refused: transfer already {r.state}"))

    def on_HoldKV(self, msg: m.HoldKV) -> None:
        faults.point(self.name, "lease_held")
        late_s = faults.delay(self.name, "hold")  # tests: D's answers come first, as they may
        if late_s:
            self._held_back.append((time.monotonic() + late_s, msg))
            return
        self._hold(msg)

    def _hold(self, msg: m.HoldKV) -> None:
        if msg.write:  # the scheduler says (the deployment's TransferPlan.direction, or a late push)
            self._hold_for_write(msg)
        else:
            self._hold_for_read(msg)

    def _hold_for_write(self, msg: m.HoldKV) -> None:
        """Pull's protocol, push's transfer: D registers after the relay, and we WRITE then.
        D's leg leaves the router only now, and may wait there for room: the blocks wait for
        D's first sign (its registration, or its renewal while the leg queues at D) up to the
        cap of a lease, and from then on registration_wait_s from D's last renewal."""
        self._prefill_done(msg, wait_s=max(self.cfg.timeouts.lease_max_s, self.cfg.timeouts.registration_wait_s))

    def _hold_for_read(self, msg: m.HoldKV) -> None:
        """Keep the blocks under a lease until D's READ is done."""
        now = time.monotonic()
        if not self.side.produces:  # a replica rank: no D rank reads from it
            self._apply_leases([A.Completed(msg.transfer_id, msg.generation, "replica"),
                                A.FreeBlocks(msg.transfer_id, msg.generation, msg.block_ids, "replica")], now)
            return
        try:
            acts = self.leases.hold(msg.transfer_id, msg.generation, msg.block_ids, now)
        except A.ProtocolError as e:
            key = (msg.transfer_id, msg.generation)
            self._refused(sides.Refused(key, e.event, e.state, str(e), self.side.live(key)))
            return
        self._apply_leases(acts, now)

    def on_CancelKV(self, msg: m.CancelKV) -> None:
        """One answer per cancel: from the lease that holds the blocks (pull), else from the
        rendezvous (push), which answers even a transfer it has not seen yet."""
        now = time.monotonic()
        if self.leases.deadline_of(msg.transfer_id, msg.generation) is not None:
            self._apply_leases(self.leases.cancel(msg.transfer_id, msg.generation, msg.reason, now), now)
        else:
            self.apply(self.side.cancel((msg.transfer_id, msg.generation), msg.reason, now, answer=True), now)

    # -- from D's writers (NIXL notifications) --------------------------------------------
    def notif_Register(self, msg: m.Register, agent: str, now: float) -> None:
        if agent not in self.peers.by_agent:
            self.counters["register_from_unknown_peer"] += 1
            log.error("%s: Register from unknown agent %s transfer_id=%s", self.name, agent, msg.transfer_id)
            return
        self.counters["registrations_received"] += 1
        why = self._bad_cached_tokens(msg, self.peers.by_agent[agent])
        if why:  # refused at once: D fails the request now rather than at its WRITE deadline
            self.counters["register_bad_cached_tokens"] += 1
            log.error("%s: Register refused: %s transfer_id=%s", self.name, why, msg.transfer_id)
            self.posting.control(self.peers.by_agent[agent],
                                 m.WriteFailed(msg.transfer_id, msg.generation, self.rank, why))
            return
        self._stamp((msg.transfer_id, msg.generation), "registration_received")
        faults.point(self.name, "registration_received")
        self.apply(self.side.registration(msg, now), now)
        self._sync_warm((msg.transfer_id, msg.generation), now)
        self.warmup.beat_for((msg.transfer_id, msg.generation), agent)  # our WRITE to this D rank is coming

    def _bad_cached_tokens(self, msg: m.Register, peer) -> str:
        """Why D's prefix-cache offset cannot be honoured ("" if it can): a WRITE starts on whole
        blocks of both tables (else it would write into D's cached blocks), leaves at least the
        last token to carry D's notification, and a window group moves only the last window."""
        t0, d_bs = msg.cached_tokens, peer.layout.block_size
        if not t0:
            return ""
        if t0 < 0 or t0 % self.layout.block_size or t0 % d_bs:
            return f"cached_tokens={t0} is not whole blocks of {self.layout.block_size} and {d_bs} tokens"
        if t0 >= msg.num_tokens:
            return f"cached_tokens={t0} leaves nothing of the {msg.num_tokens}-token prompt to write"
        if window_group(self.layout) >= 0:
            return "cached_tokens with sliding-window layers (they move only the last window)"
        return ""

    def notif_CancelTransfer(self, msg: m.CancelTransfer, agent: str, now: float) -> None:
        self.apply(self.side.cancel((msg.transfer_id, msg.generation), msg.reason, now), now)
        if self.reads:  # a cancel not held yet is kept for its hold: only where holds are leases
            self._apply_leases(self.leases.cancel(msg.transfer_id, msg.generation, msg.reason, now), now)

    def notif_ReadDone(self, msg: m.ReadDone, agent: str, now: float) -> None:
        peer = self.peers.by_agent.get(agent)
        readers = len(consumers_for(self.rank, self.inst.tp, peer.tp, self.layout.total_kv_heads)) if peer else 1
        self.warmup.transfer_arrived(msg.transfer_id, msg.generation)
        self._apply_leases(self.leases.on_read_done(msg.transfer_id, msg.generation, msg.d_rank, readers), now)

    def notif_RenewLease(self, msg: m.RenewLease, agent: str, now: float) -> None:
        """D still means to read (queued, or READing): the lease lives on, up to its cap. A push
        transfer (late, or D's leg queued at D): the wait for D's registration starts anew."""
        if agent not in self.peers.by_agent:
            self.counters["renew_from_unknown_peer"] += 1
            log.error("%s: RenewLease from unknown agent %s transfer_id=%s", self.name, agent, msg.transfer_id)
            return
        if self.leases.deadline_of(msg.transfer_id, msg.generation) is not None:
            self._apply_leases(self.leases.renew(msg.transfer_id, msg.generation, now), now)
        else:
            self.apply(self.side.renew((msg.transfer_id, msg.generation), now), now)

    # -- the side's effects, carried out ----------------------------------------------------
    def apply(self, effects: list, now: float) -> None:
        for e in self.damage(effects):
            if isinstance(e, sides.Post):
                self._post_write(e.write, now, e.swap_dest)
            elif isinstance(e, sides.Report):
                self._free(e)
            elif isinstance(e, sides.Drop):
                self._drop_queued(e.key, e.reason)
            elif isinstance(e, sides.Refused):
                self._refused(e)
            else:
                self.count_or_tell(e, self.posting.control)
        if self.warmup.warm:
            for key in sides.keys_of(effects):
                self._sync_warm(key, now)

    def _apply_leases(self, actions: list, now: float) -> None:
        """Pull: the leases' actions, as the side's effects."""
        self.apply(self.side.effects(actions), now)

    def _sync_warm(self, key, now: float) -> None:
        """Warm while the transfer waits for its other half (D's registration or our prefill):
        its WRITE is coming; capped by the rendezvous' own wait. Posted, done or gone: cool
        (a posted WRITE is spun on as in flight)."""
        if self.side.waiting(key):
            self.warmup.warm_for(key, now + self.cfg.timeouts.registration_wait_s)
        else:
            self.warmup.cool(key)

    def peer_instance_down(self, engine_id: str, reason: str, now: float) -> None:
        for key in self.side.registered_by(engine_id):
            self.counters["cancelled_peer_death"] += 1
            with self.ending_for_loss("decode", reason):
                self.apply(self.side.cancel(key, f"decode instance lost: {reason}", now), now)

    def _record(self, key) -> sides.PrefillTransfer:
        return self.side.record(key)

    def _stamp(self, key, stage: str) -> None:
        self._record(key).stages.setdefault(stage, time.time())

    def _free(self, r: sides.Report) -> None:
        a, t = r.free, r.transfer
        self._checksums.pop((a.transfer_id, a.generation), None)
        if isinstance(r.outcome, A.Completed):
            self.send(self.sched, m.KVSent(a.transfer_id, a.generation, t.nbytes, t.num_descs, t.write_s,
                                           r.outcome.order, tuple(t.stages.items()), t.parts, self.stream))
        else:
            self.send(self.sched, m.KVFailed(a.transfer_id, a.generation, r.reason or "transfer failed",
                                             lost=self._lost))

    def _post_write(self, a, now: float, swap: bool = False) -> None:
        faults.point(self.name, "post_write" if a.last else "post_part")
        key = (a.transfer_id, a.generation)
        if self.link_posts is not None:  # (the post's own stamps come when it leaves the queue)
            self._stamp(key, "write_queued" if a.last else "part_queued")
        fl = InFlight(a.transfer_id, a.generation, posted=now, part=not a.last)
        token_spans = list(_token_spans(a))
        fl.number = self._stamp_asked(key, token_spans)
        try:
            for reg in a.registrations:
                self._post_to(a, reg, fl, token_spans, swap)
        except Exception as e:  # failed to post: tell D now, not at its deadline
            self._post_failed(fl, e)
        self._posted(a, fl, now)

    def _stamp_asked(self, key, token_spans) -> int:
        """The WRITE's number in its transfer (1, 2, ...; the last WRITE's is its parts + 1), with
        its per-WRITE stamps begun: ``w<n>_asked`` (the rendezvous asked for it) and
        ``w<n>_stored`` (the newest layer mark among the groups it carries, when marks came)."""
        t = self._record(key)
        n = t.parts + 1
        self._stamp(key, f"w{n}_asked")
        groups = range(self.side.rdv.stream_groups) if any(g < 0 for g, _, _ in token_spans) else \
            {g for g, _, _ in token_spans}
        marks = [t.stages[f"layers_stored_{g}"] for g in groups if f"layers_stored_{g}" in t.stages]
        if marks:
            t.stages.setdefault(f"w{n}_stored", max(marks))
        return n

    def _post_to(self, a, reg, fl: InFlight, token_spans: list, swap: bool) -> None:
        """Post D rank ``reg``'s share of the WRITE (nothing when it holds no head of ours)."""
        peer = self.peers.get((reg.d_engine_id, reg.d_rank))
        if peer is None:
            raise TransferError(f"no handshake with {reg.d_engine_id} rank {reg.d_rank}")
        heads = head_overlap(self.rank, self.inst.tp, reg.d_rank, reg.d_tp, self.layout.total_kv_heads)
        if heads is None:
            return
        # a part (or the last WRITE after parts) starts at a token that is a whole block
        # on both sides (the rendezvous' stream unit), so it is whole blocks of both tables;
        # a layer-streamed one moves each layer group from its own first token
        spans = [(a.block_ids[t // self.layout.block_size:],
                  _swapped(reg.block_ids[t // peer.layout.block_size:], swap), end - t, None if g < 0 else (g,))
                 for g, t, end in token_spans]
        if self.area is None:
            self._post_spans(a, reg, peer, heads, fl, spans)
            return
        # the cells it carries: a layer-streamed part takes its own group's only (stage_slots.py)
        place = placement(spans, self.layout.block_size, self.area.slots.groups, self.area.slots.cut)
        if max(place.need) > self.area.blocks:
            raise TransferError(f"the WRITE needs {max(place.need)} staging blocks and the staging area holds "
                                f"{self.area.blocks}: raise --staging-mib")
        fl.queued += 1  # (until it has its slots: a failed transfer drops it, see _drop_queued)
        self.area.queue.ask(_SlotWait(a, reg, peer, heads, fl, place), place.need)  # (the queue counts a wait)
        self._take_slots()

    def _take_slots(self) -> None:
        """Posts waiting for staging slots take them in arrival order while the area has room."""
        while self.area is not None and (got := self.area.queue.grant()) is not None:
            w, slots = got
            w.fl.queued -= 1
            if w.fl.failed:  # its transfer failed meanwhile
                self.area.queue.give_back(slots)
                continue
            try:
                self._post_spans(w.a, w.reg, w.peer, w.heads, w.fl, w.place, slots)
            except Exception as e:
                self._post_failed(w.fl, e)

    def _give_slots(self, slots) -> None:
        if slots and self.area is not None:
            self.area.queue.give_back(slots)
            self._take_slots()

    def _post_spans(self, a, reg, peer, heads, fl: InFlight, spans, slots: Optional[Grant] = None) -> None:
        """Plan and post (or queue on the link) the WRITE of ``spans`` to D rank ``reg``; with a
        staging area, ``spans`` is their ``Placement`` and they go from the cells ``slots`` granted
        it, their bytes copied out first."""
        key = (a.transfer_id, a.generation)
        staged = None
        try:
            if slots is not None:
                spans, staged = self._stage_out(key, fl.number, spans, slots)
            sums = self._checksums.get(key) if a.last else None
            sp = self.posting.plan_spans("WRITE", peer, heads, spans)
        except Exception:
            self._give_slots(slots)
            raise
        sizes = self._record(key).part_sizes  # what the parts before this WRITE carried to this D rank
        nbytes, runs = sizes.get(reg.d_rank, (0, 0))
        if not a.last:
            sizes[reg.d_rank] = (nbytes + sp.nbytes, runs + sp.runs)
        if a.last:  # D's count of the transfer is the parts' and this WRITE's
            notif = m.encode(m.WriteDone(a.transfer_id, a.generation, self.rank, a.first_token, nbytes + sp.nbytes,
                                         runs + sp.runs, sums))
        elif slots is not None:  # staged: D copies each part in once it landed, which this notification says
            notif = m.encode(m.PartWritten(a.transfer_id, a.generation, self.rank, _token_spans(a)))
        else:
            notif = b""
        post = _Post(a, reg, peer, sp, notif, fl, staged, slots)
        if slots is not None and not staging.done(staged):  # posted once the loop sees its copy done
            fl.queued += 1
            self.counters["stage_out_pending"] += 1
            self._copying.add(post, staged)
            if a.last and self.link_posts is not None:  # its link keeps a room for it meanwhile
                self.link_posts.hold((reg.d_engine_id, reg.d_rank), key)
            return
        if slots is not None:
            self._copied(post)
        self._enqueue(post)

    def _post_failed(self, fl: InFlight, e: Exception) -> None:
        """A WRITE that failed to post: its transfer fails now (D is told), not at its deadline."""
        self.counters["write_post_failed"] += 1
        log.error("%s: WRITE post failed: %s transfer_id=%s", self.name, e, fl.transfer_id)
        fl.failed = f"WRITE failed to post: {e}"

    def _copies_done(self) -> None:
        """The planned WRITEs whose copy into the staging area is done go on, in the copy stream's
        order (one stream: a later copy never ends before an earlier one); a WRITE whose transfer
        failed meanwhile gives its slots back now that no copy writes them."""
        for post in self._copying.ready():
            post.fl.queued -= 1
            if post.fl.failed:
                self._give_slots(post.slots)
                self._unhold(post)
                continue
            self._copied(post)
            try:
                self._enqueue(post)
            except Exception as e:
                self._post_failed(post.fl, e)
                self._unhold(post)

    def _unhold(self, post: _Post) -> None:
        """A staged last WRITE that will not be offered: the room its link kept for it goes on."""
        if post.a.last and self.link_posts is not None:
            self._send_released(self.link_posts.unhold((post.reg.d_engine_id, post.reg.d_rank),
                                                       (post.a.transfer_id, post.a.generation)))

    def _copied(self, post: _Post) -> None:
        """Stamp a WRITE's copy into the area done, and ``w<n>_copy_begun``: when the device began
        it (the done time less its time on the device), later than ``w<n>_stage_out_issued`` by
        what it waited for on the GPU."""
        stages, n = self._record((post.a.transfer_id, post.a.generation)).stages, post.fl.number
        if f"w{n}_stage_out_done" not in stages:  # (the first D rank's)
            wall = time.time()
            stages[f"w{n}_stage_out_done"] = wall
            stages[f"w{n}_copy_begun"] = wall - staging.device_s(post.staged)

    def _enqueue(self, post: _Post) -> None:
        """Post a planned WRITE (its bytes staged, if it is staged), or queue it on its link."""
        a, sp, fl, reg = post.a, post.sp, post.fl, post.reg
        key = (a.transfer_id, a.generation)
        if self.link_posts is None:
            self._send(post)
            return
        t = self._record(key)
        t.first_queued = t.first_queued or fl.posted
        # bytes the request has left (order "shortest"): this post's rate over the prompt's rest
        left = max(1, len(a.block_ids) * self.layout.block_size - a.token_start)
        remaining = sp.nbytes * left // max(1, a.num_tokens)
        fl.queued += 1
        self.counters["link_posts_queued"] += 1
        self._send_released(self.link_posts.offer((reg.d_engine_id, reg.d_rank), key, sp.nbytes, remaining,
                                                  t.first_queued + self.cfg.timeouts.transfer_s, t.first_queued,
                                                  post, last=a.last))

    def _stage_out(self, key, number: int, place: Placement, slots: Grant) -> tuple[list, Any]:
        """--staging pushkv: the spans with their blocks replaced by the cells ``slots`` granted,
        and the copy (started now, on the copy stream) of those cells from the pool into the area;
        the post waits for it (``_copies_done``)."""
        assert self.area is not None
        self._stamp(key, "stage_out_start")
        self._stamp(key, f"w{number}_stage_out_start")
        out, copies = place.place(slots)
        pairs = self.area.copies_pairs(copies)
        self.counters["stage_out_copies"] += 1
        self.counters["stage_out_pairs"] += len(pairs)
        self.counters["stage_out_cells"] += place.cells  # each layer group of each block it carries, once
        self.counters["stage_out_cells_taken"] += place.cells_taken  # the room it held for them
        copy = self.area.copy_out(pairs)
        self._stamp(key, f"w{number}_stage_out_issued")  # from _start: planning and issuing the copies
        return out, copy

    def _send(self, post: _Post):
        """Post one planned WRITE to one D rank now; returns its handle (raises if it fails to post)."""
        key = (post.a.transfer_id, post.a.generation)
        if post.slots is not None:  # its bytes must be in the staging area: they are (_copies_done)
            if not staging.done(post.staged):  # (never: a guard, since a half copy must not go)
                self.counters["stage_out_waits"] += 1
                staging.wait(post.staged)
            self._stamp(key, "stage_out_done")
        try:
            h = self._post_now(post)
        except Exception:
            self._give_slots(post.slots)
            raise
        if post.slots is not None:  # they go back when this WRITE ends (handles_ended)
            self._slots_of[id(h)] = post.slots
        return h

    def _post_now(self, post: _Post):
        a, key = post.a, (post.a.transfer_id, post.a.generation)
        self._stamp(key, "write_post_start" if a.last else "part_post_first")  # to write_posted: our post cost
        self._stamp(key, f"w{post.fl.number}_posted")
        h = self.posting.post_planned(post.sp, post.notif)
        post.fl.handles.append(h)
        if isinstance(h, QueuedPost):
            self._poster_posts[id(h)] = (key, post.fl.number)
        if a.last:
            self._stamp(key, "write_post_returned")  # the NIXL post to this D rank returned
        self._hint(a, post.reg, post.peer, post.sp.nbytes)
        if a.last:
            self._stamp(key, "write_woke")
            self._stamp(key, "write_posted")
        self.counters["write_posts" if a.last else "part_posts"] += 1  # one per D rank this rank writes into
        post.fl.nbytes += post.sp.nbytes  # (the side books them when the WRITE ends)
        post.fl.num_descs += post.sp.runs
        if not a.last:
            self.counters["part_bytes"] += post.sp.nbytes
        return h

    def _send_released(self, released) -> None:
        """Post what the link queues released (each the next WRITE on its link). A post that
        fails, or whose transfer failed meanwhile, frees its room at once and fails its WRITE."""
        assert self.link_posts is not None
        while released:
            link, pid, post = released.pop(0)
            fl = post.fl
            fl.queued -= 1
            if not fl.failed:
                try:
                    self.link_posts.sent(link, pid, self._send(post))
                    continue
                except Exception as e:
                    self._post_failed(fl, e)
            else:
                self.counters["link_posts_skipped"] += 1
                self._give_slots(post.slots)
            released += self.link_posts.done(link, pid)

    def handles_ended(self, handles: list, now: float) -> None:
        for h in handles:
            posted = self._poster_posts.pop(id(h), None)
            t = self.side.transfers.get(posted[0]) if posted is not None else None
            if posted is not None and t is not None and h.ended:  # the poster's times: pickup, post call, end
                for stamp, at in (("picked", h.picked), ("returned", h.returned), ("ended", h.ended)):
                    if at:
                        t.stages.setdefault(f"w{posted[1]}_poster_{stamp}", at)
            slots = self._slots_of.pop(id(h), None)
            if slots is not None:
                self._give_slots(slots)
            if self.link_posts is not None:  # its room waits for what the end asks (release_links)
                self.link_posts.ended(h, release=False)

    def release_links(self) -> None:
        """After the ends of a reaping pass are heard: a request's last WRITE that its last part's
        end asked for has been offered (or, staged, holds a room), and goes before the next
        request's part (``protocol/link_queue.py``)."""
        if self.link_posts is not None:
            self._send_released(self.link_posts.release())

    def _drop_queued(self, key, reason: str) -> None:
        """A failed transfer's WRITEs still queued never go: each fails its InFlight, which then
        ends (the loop's reaping) and lets the rendezvous free the blocks as for a failed WRITE."""
        gone = self.area.queue.drop(lambda w: (w.a.transfer_id, w.a.generation) == key) if self.area else []
        for w in gone:
            w.fl.queued -= 1
            w.fl.failed = w.fl.failed or f"dropped while waiting for staging room: {reason}"
        for post in self._copying:  # (they end, and give their slots back, once their copy is done)
            if (post.a.transfer_id, post.a.generation) == key:
                post.fl.failed = post.fl.failed or f"dropped while copied into the staging area: {reason}"
        if self.link_posts is None:
            return
        for post in self.link_posts.drop(key):
            post.fl.queued -= 1
            post.fl.failed = post.fl.failed or f"dropped from the link queue: {reason}"
            self.counters["link_posts_dropped"] += 1
            self._give_slots(post.slots)

    def _hint(self, a, reg, peer, nbytes: int) -> None:
        """After the post, off its path: the hint's ZMQ message wakes D's loop at once, and D's
        polling only speeds up seeing our notification (the data moves without it); a warm D
        polls already, and the hint's send costs 20-40 us here. A part carries no WriteDone (a
        staged one a PartWritten, which D copies it in by): a hint would have D spin for the
        part's whole expected time (spin_s: 28 ms for 4 MiB) however fast the link moved it, on
        the cores our next chunk computes on; D's pending poll (every 1 ms while it waits for the
        KV) drives UCX's side of a part, and sees its PartWritten, instead."""
        if not a.last:
            self.counters["wake_hints_skipped_part"] += 1
        elif not reg.warm:
            self.warmup.wake_peer(peer, a.transfer_id, a.generation, nbytes)
        else:
            self.counters["wake_hints_skipped"] += 1

    def _posted(self, a, fl: InFlight, now: float) -> None:
        """Book the posted WRITE, then spin on it a moment (or finish it: nothing was posted)."""
        key = (a.transfer_id, a.generation)
        self.trace_event("write_posted" if a.last else "part_posted", a.transfer_id, f"{fl.nbytes}B/{fl.num_descs}d")
        t = self._record(key)
        ikey: tuple = key  # a part's: (transfer id, generation, its number)
        if not a.last:
            t.parts += 1
            self._parts_posted += 1
            ikey = (a.transfer_id, a.generation, self._parts_posted)
        if self.posting.book(ikey, fl, now) and fl.handles:
            self.posting.settle(ikey)

    def transfer_finished(self, fl: InFlight, now: float) -> None:
        key = (fl.transfer_id, fl.generation)
        self._stamp(key, f"w{fl.number}_done")
        if fl.part:
            self._stamp(key, "part_done_first")  # with part_post_first: the first part's time on the wire
            self._record(key).stages["part_done_last"] = time.time()  # the newest part's completion (not setdefault)
        else:
            self._stamp(key, "write_done")
        self.trace_event(("part" if fl.part else "write") + ("_done" if not fl.failed else "_failed"), fl.transfer_id)
        if not fl.failed:
            self.counters["bytes_written"] += fl.nbytes
            self.counters["parts" if fl.part else "writes"] += 1
        effects = self.side.write_ended(key, now, part=fl.part, failed=fl.failed, nbytes=fl.nbytes,
                                        num_descs=fl.num_descs, posted=fl.posted)
        if "DISCONNECT" in fl.failed:  # D's agent vanished under the WRITE: D died, whoever hears it first
            with self.ending_for_loss("decode", f"its writer disconnected during the WRITE ({fl.failed})"):
                self.apply(effects, now)
            return
        self.apply(effects, now)

    def expire(self, now: float) -> None:
        while self._held_back and self._held_back[0][0] <= now:
            self._hold(self._held_back.pop(0)[1])
        self.apply(self.side.expire(now), now)
        self._apply_leases(sides.due(self.leases, now), now)

def _token_spans(a: A.PostWrite) -> tuple[tuple[int, int, int], ...]:
    """What a WRITE moves: ``(layer group, first token, end token)`` per span; group -1: every group."""
    return a.spans or ((-1, a.token_start, a.token_start + a.num_tokens),)


def _swapped(ids, swap: bool):
    return damage.swap_first_two(ids) if swap else ids
