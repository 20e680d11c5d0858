"""P writer's push rendezvous: a sans-I/O state machine, one per P rank.

Two halves meet here in either order: P's finished blocks (``on_prefill_done``)
and D's destination registrations (``on_registration``, one per D rank this P
rank writes into). When both are complete for the same transfer id AND
generation, the machine asks for the WRITE (:class:`PostWrite`). It never reads
a clock, never touches a socket; events return lists of actions.

States of one (transfer id, generation)::

    WAIT_PREFILL       registrations held, no prefill yet         deadline registration_wait_s
    WAIT_REGISTRATION  prefill (P's blocks) held, registrations
                       incomplete                                 deadline registration_wait_s
    WRITING            WRITE posted                               deadline transfer_s
    DRAINING           failed or cancelled while the WRITE may
                       still read P's blocks: they stay pinned
                       until on_write_done / on_write_failed      deadline transfer_s (then
                                                                  counted write_stuck, kept)

The scheduler's cancel (``answer``) of a transfer whose last WRITE was asked for
**withdraws** it (:class:`Withdraw`): that WRITE, queued behind others on the link or
already on it, decides the outcome when it ends. One that never went (the writer takes it
out of its link queue) or failed fails the transfer and tells D; one that landed carried D's
notification, so D has the KV whole and the transfer completed. (Failed at the cancel,
P answered KVFailed while D, its notification on the way, answered KVReceived.) D's cancel
and a dead peer's fail the transfer at once: D has decided already.

Streaming push (``stream_unit`` > 0 tokens): while P still computes, each ended
prefill chunk reports its progress (``on_prefill_progress``: the prompt's first n
tokens are in the blocks). In WAIT_PREFILL, once every registration is there, the
machine asks for a **part** WRITE of the whole units (multiples of ``stream_unit``,
the lcm of both sides' block sizes, so each part is whole blocks on both sides) not
yet written; parts carry no notification. Up to ``PARTS_AHEAD`` (2) parts are in flight
at a time: a part is asked for as soon as new whole units are computed and fewer are in
flight, so the next part is staged and queued while the previous one is on the wire; once
both fly, the next waits for a completion and then takes everything computed meanwhile, so
a fast link still posts few, large parts. Posting one WRITE at a time on a link is P's
link queue's job (``protocol/link_queue.py``), not this machine's. At prefill end the **last**
WRITE moves the rest with the completion notification, and is asked for only once every part
has completed, so D's one notification means every byte has landed; a prefill that ends while
parts fly asks for its remaining whole units at once as one more part (queued behind them), so
the last WRITE that waits for them carries only the final unit. With
``stream_groups`` > 1 (layer-streamed push) progress is per layer group: the worker
marks each group of layers stored, a part moves each group's whole units not yet
written (one span per group, merged when they agree; the last group's final marked unit
waits for the last WRITE), and the last WRITE moves each group's rest. Marks that arrive
after the prefill half are counted and dropped (the prefill half already covers them). A
prefill that the engine preempts and computes again (``on_prefill_restart``) keeps what was
sent and streams on from there into its new blocks. Parts may complete in either order
(the machine counts them; each names its own spans). A part that fails fails the transfer;
any failure while WRITEs are in flight (the other part, say) drains every one of them first
(DRAINING counts them down, then frees and tells D once), and a streamed transfer that ends before its prefill
half frees (reports) the streamed blocks all the same, so the scheduler always
hears one outcome.

Local events that make no sense in the current state (a second prefill, a
write completion nobody posted) raise :class:`ProtocolError` naming state and
event, and change nothing. Peer input (registrations) never raises: it is
counted and dropped, so a confused peer cannot crash the writer.

Guarantees: each accepted prefill half gets exactly one :class:`FreeBlocks`,
emitted only when no WRITE may still read the blocks; each (transfer id,
generation) gets at most one outcome (:class:`Completed` or :class:`Failed`);
D ranks whose registration was held or arrives for a failed transfer get a
:class:`NotifyFailure`, but never while a posted WRITE may still land in their
blocks: an abandoned WRITE tells D itself when it completes (its WriteDone) and
only a WRITE that drains by failing is followed by a NotifyFailure, since D
reuses its blocks as soon as it hears. Finished (transfer id, generation) pairs are remembered
in a bounded LRU so late halves are released at once instead of waiting out a
deadline as zombies.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Optional, Sequence

from pushkv.kinds import Rendezvous
from pushkv.messages import Register
from pushkv.protocol._deadlines import Deadlines
from pushkv.protocol.actions import (
    Action,
    Completed,
    Count,
    Failed,
    FreeBlocks,
    NotifyFailure,
    PostWrite,
    ProtocolError,
    Withdraw,
)
from pushkv.protocol.tp import consumers_for, is_producer

__all__ = [
    "PARTS_AHEAD", "PushRendezvous", "State", "ProtocolError", "Action", "PostWrite", "FreeBlocks",
    "NotifyFailure", "Completed", "Failed", "Withdraw", "Count",
]

REMEMBER_FINISHED = 4096  # (transfer id, generation) outcomes kept for late halves
# Streamed parts of one transfer in flight at once (asked for and not yet reported). With one,
# the next part was asked only when the previous completed, and its staging copy (GPU to pinned
# host, ~12 ms for a 16k prompt's layer group over a 25 Gbit/s veth on one H200) left the link
# idle before every part; with two, the next one is staged while the previous is on the wire
# and waits in P's link queue, which posts them one after the other under its window. More
# would only split what a completion coalesces into more, smaller parts.
PARTS_AHEAD = 2


class State(str, Enum):
    WAIT_PREFILL = "wait_prefill"
    WAIT_REGISTRATION = "wait_registration"
    WRITING = "writing"
    DRAINING = "draining"


@dataclass
class _Transfer:
    transfer_id: str
    generation: int
    state: State
    order: Rendezvous  # which half came first
    has_prefill: bool = False
    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    first_token: int = 0
    regs: dict[int, Register] = field(default_factory=dict)
    d_tp: int = 0
    needed: frozenset[int] = frozenset()
    deadline: Optional[float] = None
    streamed: bool = False  # prefill progress seen before the prefill half
    progress: list[int] = field(default_factory=list)  # per layer group: prompt tokens computed so far
    sent: list[int] = field(default_factory=list)  # per layer group: prompt tokens asked for in parts
    marked: bool = False  # progress came from layer marks (which may reach the prompt's end before it is done)
    parts: int = 0  # part WRITEs asked for
    inflight: int = 0  # WRITEs asked for (up to PARTS_AHEAD parts, or the last) not yet reported
    final_pending: bool = False  # all halves in; the last WRITE waits for the parts
    failure: str = ""  # why a WRITE failed while others were still in flight
    last_posted: bool = False  # the WRITE with D's notification was asked for
    ended: str = ""  # why the transfer was abandoned
    withdrawn: bool = False  # DRAINING after the scheduler's cancel: the last WRITE decides the outcome
    wait_s: float = 0.0  # WAIT_REGISTRATION: the wait armed last (prefill's, or a renewal's)

    def registrations(self) -> tuple[Register, ...]:
        return tuple(self.regs[d] for d in sorted(self.regs))


@dataclass(frozen=True)
class _Finished:
    ok: bool
    had_prefill: bool


class PushRendezvous:
    def __init__(
        self,
        p_rank: int,
        p_tp: int,
        total_kv_heads: int,
        registration_wait_s: float,
        transfer_s: float,
        remember: int = REMEMBER_FINISHED,
        stream_unit: int = 0,
        stream_groups: int = 1,
    ):
        consumers_for(p_rank, p_tp, p_tp, total_kv_heads)  # validates the geometry
        self.p_rank, self.p_tp, self.total_kv_heads = p_rank, p_tp, total_kv_heads
        # a replica rank (every head produced by a lower rank) gets no registration
        self.produces = is_producer(p_rank, p_tp, total_kv_heads)
        self.registration_wait_s = registration_wait_s
        self.transfer_s = transfer_s
        self.stream_unit = stream_unit  # tokens; 0 = no part WRITEs (progress is still tracked)
        self.stream_groups = max(1, stream_groups)  # layer groups streamed apart (layer mode)
        self._remember = remember
        self._live: dict[str, _Transfer] = {}  # newest non-draining generation per transfer id
        self._draining: dict[tuple[str, int], _Transfer] = {}
        self._finished: OrderedDict[tuple[str, int], _Finished] = OrderedDict()
        self._newest: OrderedDict[str, int] = OrderedDict()  # newest generation seen per id
        self._deadlines: Deadlines[tuple[str, int]] = Deadlines(self._current_deadline)

    # ------------------------------------------------------------------ events
    def on_prefill_done(
        self, transfer_id: str, generation: int, block_ids: Sequence[int],
        num_tokens: int, first_token: int, now: float, wait_s: Optional[float] = None,
    ) -> list[Action]:
        """P's finished blocks. ``wait_s``: how long they wait for D's first sign (its
        registration, or its ``renew`` while its leg still queues), registration_wait_s
        unless given: a late hold, whose D leg the router places only now, waits longer."""
        blocks = tuple(block_ids)
        kind, e = self._lookup(transfer_id, generation)
        if e is not None and kind == "live" and not self.produces:  # a replica that tracked a stream: nothing to write
            e.has_prefill, e.block_ids = True, blocks
            self._retire(e, ok=True)
            return [FreeBlocks(transfer_id, generation, blocks, "replica writes nothing"),
                    Completed(transfer_id, generation, "replica")]
        if e is not None:  # live or draining
            return self._dispatch(e, "prefill_done", now, blocks=blocks,
                                  num_tokens=num_tokens, first_token=first_token, wait_s=wait_s)
        if kind == "finished":
            fin = self._finished[(transfer_id, generation)]
            if fin.had_prefill:
                raise ProtocolError("finished", "prefill_done", transfer_id, generation)
            self._finished[(transfer_id, generation)] = _Finished(fin.ok, had_prefill=True)
            return [FreeBlocks(transfer_id, generation, blocks, "transfer already failed"),
                    Count("late_prefill")]
        if kind == "stale":
            self._finish(transfer_id, generation, ok=False, had_prefill=True)
            return [FreeBlocks(transfer_id, generation, blocks, "stale generation"),
                    Failed(transfer_id, generation, "stale generation"), Count("stale_prefill")]
        if not self.produces:  # nothing to write: done the moment prefill is
            self._finish(transfer_id, generation, ok=True, had_prefill=True)
            return [FreeBlocks(transfer_id, generation, blocks, "replica writes nothing"),
                    Completed(transfer_id, generation, "replica")]
        out = self._supersede(transfer_id, generation, now)
        e = _Transfer(transfer_id, generation, State.WAIT_PREFILL, "prefill_first")
        self._live[transfer_id] = e
        self._note_generation(transfer_id, generation)
        return out + self._accept_prefill(e, now, blocks, num_tokens, first_token, wait_s)

    def on_prefill_progress(self, transfer_id: str, generation: int, block_ids: Sequence[int],
                            num_tokens: int, now: float, group: int = -1) -> list[Action]:
        """Streaming push: a prefill chunk ended (``group`` -1: every layer group) or one layer
        group of a step was stored, and the prompt's first ``num_tokens`` tokens are in
        ``block_ids`` (still the scheduler's: it keeps computing into them)."""
        if group >= self.stream_groups:
            return [Count("bad_progress_group")]
        kind, e = self._lookup(transfer_id, generation)
        if e is not None and kind == "live":
            return self._dispatch(e, "progress", now, blocks=tuple(block_ids), num_tokens=num_tokens, group=group)
        if kind != "new":  # draining, finished or stale: that transfer is over
            return [Count("late_progress")]
        out = self._supersede(transfer_id, generation, now)
        e = _Transfer(transfer_id, generation, State.WAIT_PREFILL, "prefill_first")
        self._live[transfer_id] = e
        self._note_generation(transfer_id, generation)
        return out + self._progress(e, now, tuple(block_ids), num_tokens, group)

    def on_prefill_restart(self, transfer_id: str, generation: int, now: float) -> list[Action]:
        """Streaming push: the engine preempted the prefill before its end, freed the blocks the
        progress named, and will compute the prompt again into new ones (vLLM's recompute). The
        caller makes sure no posted WRITE still reads the old blocks before they are reused. What
        D holds stays: the parts already asked for were read while those blocks were valid. The
        progress starts over (later marks name the new blocks) and parts resume once it passes what
        was sent, so no unit is sent twice; the prefill half brings the whole new table."""
        kind, e = self._lookup(transfer_id, generation)
        if e is not None:
            return self._dispatch(e, "restart", now)
        return [Count("restart_ignored")]  # no stream seen yet, or that transfer is over

    def on_registration(self, reg: Register, now: float) -> list[Action]:
        try:
            wanted = consumers_for(self.p_rank, self.p_tp, reg.d_tp, self.total_kv_heads)
        except ValueError:
            return [Count("bad_registration")]
        if reg.d_rank not in wanted:
            return [Count("unneeded_registration")]
        tid, gen = reg.transfer_id, reg.generation
        kind, e = self._lookup(tid, gen)
        if e is not None:  # live or draining
            return self._dispatch(e, "registration", now, reg=reg)
        if kind == "finished":
            if self._finished[(tid, gen)].ok:
                return [Count("late_registration")]
            return [NotifyFailure(tid, gen, (reg,), "transfer already failed"),
                    Count("late_registration")]
        if kind == "stale":
            return [NotifyFailure(tid, gen, (reg,), "stale generation"), Count("stale_registration")]
        out = self._supersede(tid, gen, now)
        e = _Transfer(tid, gen, State.WAIT_PREFILL, "registration_first",
                      d_tp=reg.d_tp, needed=frozenset(wanted))
        self._live[tid] = e
        self._note_generation(tid, gen)
        return out + self._add_registration(e, now, reg)

    def renew(self, transfer_id: str, generation: int, now: float) -> list[Action]:
        """D still means to register: its leg is queued there, not admitted yet (D says so every
        third of the wait while it queues). P's finished blocks waiting for that registration
        wait ``registration_wait_s`` from now: the clock runs from D's admission, not from
        the end of P's prefill, so a long queue at D fails nothing here. Anything else (no
        prefill yet, already writing, over) has no registration clock: counted, ignored."""
        kind, e = self._lookup(transfer_id, generation)
        if e is None or kind != "live" or e.state is not State.WAIT_REGISTRATION:
            return [Count("renew_ignored")]
        if e.deadline is not None and now >= e.deadline:  # ran out: the next expire() ends it
            return [Count("renew_expired")]
        e.wait_s = self.registration_wait_s
        self._arm(e, now + e.wait_s)
        return [Count("renewed")]

    def on_write_done(self, transfer_id: str, generation: int, now: float, part: bool = False) -> list[Action]:
        return self._local(transfer_id, generation, "write_done", now, part=part)

    def on_write_failed(self, transfer_id: str, generation: int, reason: str, now: float,
                        part: bool = False) -> list[Action]:
        return self._local(transfer_id, generation, "write_failed", now, reason=reason, part=part)

    def cancel(self, transfer_id: str, generation: int, reason: str, now: float,
               answer: bool = False) -> list[Action]:
        """End the transfer (the scheduler's cancel, D's, or a dead peer's). ``answer``: the
        scheduler asked, and it waits for one answer per rank even when we hold none of the
        blocks: a layer-streamed prefill hands them over through the worker's marks, which may
        not be here yet, or D's cancel ended the transfer first. So a cancel that frees nothing
        then still reports an empty ``FreeBlocks`` (the writer answers the scheduler on it; an
        answer it no longer waits for is counted stale there)."""
        kind, e = self._lookup(transfer_id, generation)
        empty: list[Action] = [FreeBlocks(transfer_id, generation, (), reason)] if answer else []
        if e is not None and kind == "live" and not (e.has_prefill or e.streamed):
            return empty + self._dispatch(e, "cancel", now, reason=reason)
        if e is not None:  # live or draining: a drain answers when the WRITEs are done
            return self._dispatch(e, "cancel", now, reason=reason, answer=answer)
        if kind == "new":  # neither half seen: remember, so both die on arrival
            out = self._supersede(transfer_id, generation, now)
            self._finish(transfer_id, generation, ok=False, had_prefill=False)
            return out + empty + [Failed(transfer_id, generation, reason), Count("cancelled")]
        return empty + [Count("cancel_ignored")]

    def expire(self, now: float) -> list[Action]:
        out: list[Action] = []
        for tid, gen in self._deadlines.due(now):
            e = self._entry(tid, gen)
            if e is None:  # due() only returns keys whose entry still holds that deadline
                continue
            e.deadline = None
            out += self._dispatch(e, "expire", now)
        return out

    def next_deadline(self) -> Optional[float]:
        return self._deadlines.next()

    # ------------------------------------------------------------ introspection
    def state_of(self, transfer_id: str, generation: int) -> Optional[str]:
        e = self._entry(transfer_id, generation)
        return e.state.value if e is not None else None

    def held_blocks(self) -> list[int]:
        """P blocks currently pinned by this machine (accounting checks)."""
        entries = list(self._live.values()) + list(self._draining.values())
        return [b for e in entries if e.has_prefill for b in e.block_ids]

    def __len__(self) -> int:
        return len(self._live) + len(self._draining)

    # -------------------------------------------------------- transition table
    def _dispatch(self, e: _Transfer, event: str, now: float, **kw) -> list[Action]:
        handler: Optional[Callable] = _TABLE.get((e.state, event))
        if handler is None:
            raise ProtocolError(e.state.value, event, e.transfer_id, e.generation)
        return handler(self, e, now, **kw)

    def _local(self, tid: str, gen: int, event: str, now: float, **kw) -> list[Action]:
        kind, e = self._lookup(tid, gen)
        if e is None:
            raise ProtocolError(kind if kind != "new" else "unknown", event, tid, gen)
        return self._dispatch(e, event, now, **kw)

    def _accept_prefill(self, e, now, blocks, num_tokens, first_token, wait_s=None) -> list[Action]:
        e.has_prefill, e.block_ids = True, blocks
        e.num_tokens, e.first_token = num_tokens, first_token
        if e.needed and e.needed <= e.regs.keys():
            return self._post(e, now)
        e.state = State.WAIT_REGISTRATION
        e.wait_s = self.registration_wait_s if wait_s is None else wait_s
        self._arm(e, now + e.wait_s)
        return []

    def _add_registration(self, e, now, reg) -> list[Action]:
        if reg.d_tp != e.d_tp and e.regs:
            return [Count("registration_tp_mismatch")]
        if reg.d_rank in e.regs:
            return [Count("duplicate_registration")]
        if not e.regs:
            e.d_tp = reg.d_tp
            e.needed = frozenset(consumers_for(self.p_rank, self.p_tp, reg.d_tp, self.total_kv_heads))
        e.regs[reg.d_rank] = reg
        cached = min(e.regs[d].cached_tokens for d in e.needed) if e.needed <= e.regs.keys() else 0
        if cached:  # D holds the prompt's first tokens in its prefix cache: they stay, in every layer group
            if not e.sent:
                e.progress, e.sent = [0] * self.stream_groups, [0] * self.stream_groups
            e.sent = [max(s, cached) for s in e.sent]
        if e.has_prefill and e.needed <= e.regs.keys():
            return self._post(e, now)
        if e.state is State.WAIT_PREFILL:
            wait = self.registration_wait_s
            if reg.deadline > 0:  # D gives up after this long; waiting longer is pointless
                wait = min(wait, reg.deadline)
            if e.deadline is None or now + wait < e.deadline:
                self._arm(e, now + wait)
            return self._post_part(e)  # a stream under way: what is computed can leave now
        return []

    def _progress(self, e, now, blocks, num_tokens, group=-1) -> list[Action]:
        if not e.progress:
            e.progress, e.sent = [0] * self.stream_groups, [0] * self.stream_groups
        gs = range(self.stream_groups) if group < 0 else (group,)
        if all(num_tokens <= e.progress[g] for g in gs):
            return [Count("stale_progress")]
        for g in gs:
            e.progress[g] = max(e.progress[g], num_tokens)
        e.marked = e.marked or group >= 0
        if len(blocks) >= len(e.block_ids):  # a later step's table holds an earlier one's
            e.block_ids = blocks
        e.streamed = True
        self._arm(e, now + self.registration_wait_s)  # the prefill is alive: wait for its end anew
        return self._post_part(e)

    def _restart(self, e, now) -> list[Action]:
        e.progress = [0] * self.stream_groups
        e.block_ids = ()  # freed: the next progress brings the new table
        self._arm(e, now + self.registration_wait_s)  # the prefill is alive: wait for its end anew
        return [Count("prefill_restarted")]

    def _post_part(self, e) -> list[Action]:
        """Ask for a part WRITE of the whole units computed and not yet asked for, in every
        layer group (none while PARTS_AHEAD parts are in flight: a completion asks again)."""
        if e.inflight >= PARTS_AHEAD:
            return []
        if not (self.stream_unit and e.streamed and e.needed and e.needed <= e.regs.keys()):
            return []
        u = self.stream_unit
        ends = [p // u * u for p in e.progress]
        if e.marked:  # the last group's last marked unit waits for the last WRITE (below)
            ends[-1] = (e.progress[-1] - 1) // u * u
        return self._ask_part(e, ends)

    def _ask_part(self, e, ends: list[int]) -> list[Action]:
        """A part WRITE of each group's units from what was sent to ``ends`` (none if nothing is new)."""
        spans = [(g, e.sent[g], end) for g, end in enumerate(ends) if end > e.sent[g]]
        if not spans:
            return []
        for g, _, end in spans:
            e.sent[g] = end
        e.parts, e.inflight = e.parts + 1, e.inflight + 1
        return [self._write(e, spans, 0, last=False)]

    # Layer marks of a prompt's last step may all arrive before its prefill half, so parts alone
    # could move the whole prompt. The last group's final unit is kept for the last WRITE: it has
    # bytes for its notification to follow (no unit is sent twice), and the KV D has not seen
    # until the last WRITE is the prompt's end, where a fault that damages that WRITE (or a
    # real one) lands in the units every --kv-verify sample checks.
    def _last_write(self, e) -> list[Action]:
        e.final_pending = False
        e.last_posted = True
        e.inflight += 1
        sent = e.sent or [0] * self.stream_groups
        spans = [(g, s, e.num_tokens) for g, s in enumerate(sent) if s < e.num_tokens]
        if not spans:  # every group's parts ended on the prompt's end: the notification needs bytes
            u = self.stream_unit or max(1, e.num_tokens)
            spans = [(len(sent) - 1, max(0, (e.num_tokens - 1) // u * u), e.num_tokens)]
        return [self._write(e, spans, e.first_token, last=True)]

    def _write(self, e, spans, first_token: int, last: bool) -> PostWrite:
        """One WRITE of ``(layer group, first token, end token)`` spans; spans that cover every
        group alike merge into one of all groups (-1)."""
        regs = tuple(e.regs[d] for d in sorted(e.needed))
        ranges = {(a, b) for _, a, b in spans}
        if len(ranges) == 1 and len(spans) == self.stream_groups:
            (a, b), = ranges
            return PostWrite(e.transfer_id, e.generation, e.block_ids, b - a, first_token, regs,
                             token_start=a, last=last)
        lo, hi = min(a for _, a, _ in spans), max(b for _, _, b in spans)
        return PostWrite(e.transfer_id, e.generation, e.block_ids, hi - lo, first_token, regs,
                         token_start=lo, last=last, spans=tuple(spans))

    def _part_done_waiting(self, e, now, part=False) -> list[Action]:
        if not part or e.inflight <= 0:
            raise ProtocolError(e.state.value, "write_done", e.transfer_id, e.generation)
        e.inflight -= 1
        return self._post_part(e)  # what was computed while it flew

    def _part_failed_waiting(self, e, now, reason, part=False) -> list[Action]:
        if not part or e.inflight <= 0:
            raise ProtocolError(e.state.value, "write_failed", e.transfer_id, e.generation)
        e.inflight -= 1
        reason = f"streamed part: {reason}"
        if e.inflight:
            e.failure = reason
            return self._abandon(e, now, reason) + [Count("write_failed")]
        return self._teardown(e, reason) + [Count("write_failed")]

    def _registration_late(self, e, now, reg) -> list[Action]:
        if reg.d_rank in e.regs:
            return [Count("duplicate_registration")]
        out: list[Action] = [Count("late_registration")]
        if e.state is State.DRAINING:
            out.insert(0, NotifyFailure(e.transfer_id, e.generation, (reg,), "transfer already failed"))
        return out

    def _post(self, e, now) -> list[Action]:
        e.state = State.WRITING
        self._arm(e, now + self.transfer_s)
        if e.inflight:  # D's one notification must follow every part's data
            e.final_pending = True
            return self._post_rest(e)
        return self._last_write(e)

    def _post_rest(self, e) -> list[Action]:
        """The prefill ended while parts fly: every whole unit not yet asked for leaves now as one
        more part (beyond PARTS_AHEAD: nothing is left to compute, so nothing would merge into
        it), staged and queued behind them, so the link does not idle while the last WRITE
        waits for them. The last group's final unit stays for the last WRITE (its bytes, which
        the notification follows)."""
        if not (self.stream_unit and e.sent):
            return []
        u = self.stream_unit
        ends = [e.num_tokens // u * u] * len(e.sent)
        ends[-1] = (e.num_tokens - 1) // u * u
        return self._ask_part(e, ends)

    def _write_done(self, e, now, part=False) -> list[Action]:
        if e.inflight <= 0 or part == e.last_posted:  # parts until the last is posted, then only the last
            raise ProtocolError(e.state.value, "write_done", e.transfer_id, e.generation)
        e.inflight -= 1
        if part:
            return self._last_write(e) if e.final_pending and not e.inflight else []
        self._retire(e, ok=True)
        return [FreeBlocks(e.transfer_id, e.generation, e.block_ids, "written"),
                Completed(e.transfer_id, e.generation, e.order)]

    def _write_failed(self, e, now, reason, part=False) -> list[Action]:
        if e.inflight <= 0 or part == e.last_posted:
            raise ProtocolError(e.state.value, "write_failed", e.transfer_id, e.generation)
        e.inflight -= 1
        if e.inflight:  # other WRITEs may still read the blocks: drain them first
            e.failure = reason
            return self._abandon(e, now, reason) + [Count("write_failed")]
        self._retire(e, ok=False)
        return [FreeBlocks(e.transfer_id, e.generation, e.block_ids, reason),
                NotifyFailure(e.transfer_id, e.generation, e.registrations(), reason),
                Failed(e.transfer_id, e.generation, reason), Count("write_failed")]

    def _drained(self, e, now, reason: str = "", part: bool = False) -> list[Action]:
        e.inflight = max(0, e.inflight - 1)
        e.failure = e.failure or reason
        if e.inflight:
            return []
        reason = e.failure
        del self._draining[(e.transfer_id, e.generation)]
        e.deadline = None
        after = "written" if e.withdrawn else "write finished after failure"
        out: list[Action] = [FreeBlocks(e.transfer_id, e.generation, e.block_ids, reason or after)]
        if e.withdrawn:  # the last WRITE's end is the outcome: landed, it told D
            self._finish(e.transfer_id, e.generation, not reason, e.has_prefill)
            out.append(Failed(e.transfer_id, e.generation, reason) if reason else
                       Completed(e.transfer_id, e.generation, e.order))
        # a WRITE failed, or only parts (which carry no notification) were posted: no
        # completion notification reaches D, so tell it
        if reason or not e.last_posted:
            out.append(NotifyFailure(e.transfer_id, e.generation, e.registrations(), reason or e.ended))
        return out

    def _cancel_waiting(self, e, now, reason, answer=False) -> list[Action]:
        if e.inflight:  # streamed parts may still read the blocks
            return self._abandon(e, now, reason) + [Count("cancelled")]
        return self._teardown(e, reason) + [Count("cancelled")]

    def _cancel_writing(self, e, now, reason, answer=False) -> list[Action]:
        if answer and e.last_posted:  # the scheduler's: the last WRITE decides (module docstring)
            return self._abandon(e, now, reason, withdraw=True) + [Count("withdrawn")]
        return self._abandon(e, now, reason) + [Count("cancelled")]

    def _expire_waiting(self, e, now) -> list[Action]:
        if e.state is State.WAIT_PREFILL:
            reason, counter = f"no prefill within {self.registration_wait_s}s of registration", "expired_registration"
        else:
            reason, counter = f"no registration within {e.wait_s}s of prefill or of D's last renewal", "expired_prefill"
        if e.inflight:
            return self._abandon(e, now, reason) + [Count(counter)]
        return self._teardown(e, reason) + [Count(counter)]

    def _expire_writing(self, e, now) -> list[Action]:
        return self._abandon(e, now, f"transfer not done within {self.transfer_s}s") + [Count("expired_transfer")]

    def _expire_draining(self, e, now) -> list[Action]:
        # Still pinned: freeing blocks a WRITE may read would corrupt a later request.
        # The actor should abort the NIXL request and report on_write_failed.
        return [Count("write_stuck")]

    def _late_progress(self, e, now, group=-1, **kw) -> list[Action]:
        """A layer mark after the prefill half (they travel apart, from the worker and the
        scheduler): that half covers it. A chunk's progress travels with the prefill half, in
        order, so one after it is a bug."""
        if group < 0:
            raise ProtocolError(e.state.value, "progress", e.transfer_id, e.generation)
        return [Count("late_progress")]

    def _ignore(self, e, now, **kw) -> list[Action]:
        return [Count("cancel_ignored")]

    def _restart_ignored(self, e, now) -> list[Action]:
        return [Count("restart_ignored")]

    # ---------------------------------------------------------------- helpers
    def _teardown(self, e: _Transfer, reason: str) -> list[Action]:
        """End a waiting transfer: nothing is in flight, so free at once."""
        self._retire(e, ok=False)
        out: list[Action] = []
        if e.has_prefill or e.streamed:  # a stream's blocks are reported too: the scheduler waits
            out.append(FreeBlocks(e.transfer_id, e.generation, e.block_ids, reason))
        if e.regs:
            out.append(NotifyFailure(e.transfer_id, e.generation, e.registrations(), reason))
        out.append(Failed(e.transfer_id, e.generation, reason))
        return out

    def _abandon(self, e: _Transfer, now: float, reason: str, withdraw: bool = False) -> list[Action]:
        """Fail a posted transfer but keep its blocks pinned until the WRITE reports (``withdraw``:
        its outcome is that WRITE's, told when it ends).

        D is not told yet: it would reuse blocks the WRITE may still land in (see _drained)."""
        self._retire(e, ok=False)
        e.ended = e.ended or reason
        e.state = State.DRAINING
        e.withdrawn = withdraw
        self._draining[(e.transfer_id, e.generation)] = e
        self._arm(e, now + self.transfer_s)
        return [(Withdraw if withdraw else Failed)(e.transfer_id, e.generation, reason)]

    def _supersede(self, tid: str, gen: int, now: float) -> list[Action]:
        """A newer generation arrived: end the live older one (reissued request)."""
        old = self._live.get(tid)
        if old is None or old.generation >= gen:
            return []
        reason = f"superseded by generation {gen}"
        if old.state is State.WRITING or old.inflight:
            return self._abandon(old, now, reason) + [Count("superseded_writing")]
        out = self._teardown(old, reason)
        if old.has_prefill:
            out.append(Count("stale_prefill"))
        if old.regs:
            out.append(Count("stale_registration"))
        return out

    def _retire(self, e: _Transfer, ok: bool) -> None:
        if self._live.get(e.transfer_id) is e:
            del self._live[e.transfer_id]
        e.deadline = None
        self._finish(e.transfer_id, e.generation, ok, e.has_prefill)

    def _finish(self, tid: str, gen: int, ok: bool, had_prefill: bool) -> None:
        self._finished[(tid, gen)] = _Finished(ok, had_prefill)
        self._finished.move_to_end((tid, gen))
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)
        self._note_generation(tid, gen)

    def _note_generation(self, tid: str, gen: int) -> None:
        if self._newest.get(tid, gen) <= gen:
            self._newest[tid] = gen
        self._newest.move_to_end(tid)
        while len(self._newest) > self._remember:
            self._newest.popitem(last=False)

    def _arm(self, e: _Transfer, deadline: float) -> None:
        e.deadline = deadline
        self._deadlines.arm((e.transfer_id, e.generation), deadline)

    def _current_deadline(self, key: tuple[str, int]) -> Optional[float]:
        e = self._entry(*key)
        return None if e is None else e.deadline

    def _entry(self, tid: str, gen: int) -> Optional[_Transfer]:
        e = self._live.get(tid)
        if e is not None and e.generation == gen:
            return e
        return self._draining.get((tid, gen))

    def _lookup(self, tid: str, gen: int) -> tuple[str, Optional[_Transfer]]:
        """Classify (tid, gen): live | draining | finished | stale | new."""
        e = self._live.get(tid)
        if e is not None and e.generation == gen:
            return "live", e
        d = self._draining.get((tid, gen))
        if d is not None:
            return "draining", d
        if (tid, gen) in self._finished:
            return "finished", None
        newest = self._newest.get(tid, -1)
        if e is not None:
            newest = max(newest, e.generation)
        if gen < newest:
            return "stale", None
        return "new", None


S = State
_TABLE: dict[tuple[State, str], Callable] = {
    (S.WAIT_PREFILL, "prefill_done"): PushRendezvous._accept_prefill,
    (S.WAIT_PREFILL, "registration"): PushRendezvous._add_registration,
    (S.WAIT_PREFILL, "cancel"): PushRendezvous._cancel_waiting,
    (S.WAIT_PREFILL, "expire"): PushRendezvous._expire_waiting,
    (S.WAIT_PREFILL, "progress"): PushRendezvous._progress,
    (S.WAIT_PREFILL, "write_done"): PushRendezvous._part_done_waiting,
    (S.WAIT_PREFILL, "write_failed"): PushRendezvous._part_failed_waiting,
    (S.WAIT_PREFILL, "restart"): PushRendezvous._restart,
    (S.DRAINING, "restart"): PushRendezvous._restart_ignored,
    (S.WAIT_REGISTRATION, "registration"): PushRendezvous._add_registration,
    (S.WAIT_REGISTRATION, "progress"): PushRendezvous._late_progress,
    (S.WRITING, "progress"): PushRendezvous._late_progress,
    (S.WAIT_REGISTRATION, "cancel"): PushRendezvous._cancel_waiting,
    (S.WAIT_REGISTRATION, "expire"): PushRendezvous._expire_waiting,
    (S.WRITING, "registration"): PushRendezvous._registration_late,
    (S.WRITING, "write_done"): PushRendezvous._write_done,
    (S.WRITING, "write_failed"): PushRendezvous._write_failed,
    (S.WRITING, "cancel"): PushRendezvous._cancel_writing,
    (S.WRITING, "expire"): PushRendezvous._expire_writing,
    (S.DRAINING, "registration"): PushRendezvous._registration_late,
    (S.DRAINING, "write_done"): PushRendezvous._drained,
    (S.DRAINING, "write_failed"): PushRendezvous._drained,
    (S.DRAINING, "cancel"): PushRendezvous._ignore,
    (S.DRAINING, "expire"): PushRendezvous._expire_draining,
}
del S
