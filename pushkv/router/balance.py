"""The router's instance set and its per-request accounting, around the pure policy.

``Balancer`` keeps one ``SchedulerLink`` and one ``policy.Load`` per P and D
instance (from a discovery ``Watcher``: it does not care where records come
from), and what each request holds on them. A ``RequestRun`` asks it to place
the request (``request``) and, for a late request whose prefill is done, its D
leg (``request_decode``); what cannot be placed now waits here, FIFO, and is
handed to its run as a ``Placed`` / ``DecodePlaced`` message on the run's queue
once room appears (``drain``, after every release and every instance change).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from pushkv import messages as m
from pushkv.discovery.records import InstanceRecord
from pushkv.router import policy as P


class RequestRun(Protocol):
    """What the balancer reads of a request (``flow.RequestRun``): it never imports the flow."""

    transfer_id: str
    prompt: tuple[int, ...]

    @property
    def decode_tokens(self) -> int: ...

    def deliver(self, leg: str, msg: Any) -> None: ...


SchedulerLink = Any  # flow.SchedulerLink: held per instance, handed back to the flow, never used here

log = logging.getLogger(__name__)


class Refused(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class Placed:
    """To a waiting run: go, with this verdict (PUSH or LATE)."""

    verdict: P.Verdict


@dataclass
class DecodePlaced:
    """To a late run waiting for a D: send the D leg to ``engine_id``."""

    engine_id: str


@dataclass
class Held:
    """What one request holds in the router's accounting."""

    prefill: str = ""
    prefill_tokens: int = 0  # still counted in P's queued_tokens
    decode: str = ""
    decode_blocks: int = 0  # counted in D's committed
    pinned: int = 0  # counted in D's pinned (push: reserved early, KV not here yet)
    late: bool = False


class Balancer:
    def __init__(self, mode: str, pin_fraction: float, queue_bound: int, metrics=None):
        self.mode = mode
        self.pin_fraction = pin_fraction
        self.queue_bound = queue_bound
        self.metrics = metrics
        self.loads: dict[str, P.Load] = {}
        self.links: dict[str, "SchedulerLink"] = {}
        self.records: dict[str, InstanceRecord] = {}
        self.held: dict[str, Held] = {}  # by transfer id
        self.queue: deque["RequestRun"] = deque()  # not started: no D could hold them
        self.decode_queue: deque["RequestRun"] = deque()  # late: prefill done, waiting for a D
        self.picks = 0  # sequence of choices: ties go to the instance chosen least recently

    # -- the instance set ------------------------------------------------------------
    def add(self, rec: InstanceRecord, make_link: Callable[[InstanceRecord], "SchedulerLink"],
            fresh: bool = False) -> None:
        """An instance is up (new, or back after InstanceDown); ``fresh``: a new link even at the
        same endpoint (a host back from a cut: the old TCP connection may still hold unsent bytes
        for a process that is gone, and would lose what we send next)."""
        load = self.loads.get(rec.engine_id)
        if load is None or fresh or self.records[rec.engine_id].sched_endpoint != rec.sched_endpoint:
            old = self.links.pop(rec.engine_id, None)
            if old is not None:
                old.retire()
            self.links[rec.engine_id] = make_link(rec)
        if load is None:  # a known one keeps its accounting: runs still holding it release into it
            order = sum(1 for l in self.loads.values() if l.role == rec.role)
            load = self.loads[rec.engine_id] = P.Load(rec.engine_id, rec.role, order=order)
        load.num_blocks, load.block_size, load.up = rec.num_blocks, rec.block_size, True
        self.records[rec.engine_id] = rec
        log.info("%s instance %s up (%d blocks)", rec.role, rec.engine_id, rec.num_blocks)
        self.drain()

    def down(self, engine_id: str) -> Optional[P.Load]:
        load = self.loads.get(engine_id)
        if load is not None:
            load.up = False
        return load

    def source(self, engine_id: str) -> m.PrefillSource:
        rec = self.records[engine_id]
        return m.PrefillSource(rec.engine_id, rec.tp, tuple(rec.handshake_endpoints))

    def live(self, role: str) -> list[str]:
        return [e for e, l in self.loads.items() if l.role == role and l.up]

    @property
    def waiting(self) -> int:
        return len(self.queue) + len(self.decode_queue)

    # -- placing requests ------------------------------------------------------------------
    def request(self, run: "RequestRun") -> Optional[P.Verdict]:
        """Place a new request now (its verdict), or queue it (None); Refused past the bound."""
        v = P.place(list(self.loads.values()), run.decode_tokens, mode=self.mode,
                    pin_fraction=self.pin_fraction, waiting=self.waiting, queue_bound=self.queue_bound)
        if v.kind == P.REFUSE:
            if self.metrics is not None:
                self.metrics.refused.labels(status=str(v.status)).inc()
            raise Refused(v.status, v.reason)
        if v.kind == P.WAIT:
            self.queue.append(run)
            if self.metrics is not None:
                self.metrics.queued.inc()
            log.debug("queued transfer_id=%s: %s (%d waiting)", run.transfer_id, v.reason, self.waiting)
            return None
        self._commit(run, v)
        return v

    def _commit(self, run: "RequestRun", v: P.Verdict) -> None:
        h = self.held.setdefault(run.transfer_id, Held())
        p = self.loads[v.prefill]
        h.prefill, h.prefill_tokens = v.prefill, len(run.prompt)
        p.queued_tokens += h.prefill_tokens
        p.legs += 1
        self.picks += 1
        p.last_pick = self.picks
        if v.kind == P.PUSH:
            self._commit_decode(h, v.decode, run.decode_tokens, pin=True)
        else:
            h.late = True
            if self.mode == "push" and self.metrics is not None:
                self.metrics.late_allocations.inc()
        if self.metrics is not None:
            self.metrics.legs.labels(role="prefill", engine=v.prefill).inc()

    def _commit_decode(self, h: Held, engine_id: str, tokens: int, pin: bool) -> None:
        d = self.loads[engine_id]
        need = P.decode_need(d, tokens)
        h.decode, h.decode_blocks = engine_id, need
        d.committed += need
        d.legs += 1
        self.picks += 1
        d.last_pick = self.picks
        if pin:
            h.pinned = need
            d.pinned += need
        if self.metrics is not None:
            self.metrics.legs.labels(role="decode", engine=engine_id).inc()

    def request_decode(self, run: "RequestRun") -> Optional[str]:
        """A late request's prefill is done: the D to send its leg to, or None (it waits here)."""
        d = P.pick_decode(self.loads.values(), run.decode_tokens) if not self.decode_queue else None
        if d is None:
            self.decode_queue.append(run)
            return None
        self._commit_decode(self.held.setdefault(run.transfer_id, Held()), d.engine_id, run.decode_tokens, pin=False)
        return d.engine_id

    # -- what a run reports ------------------------------------------------------------------
    def prefill_done(self, run: "RequestRun") -> None:
        h = self.held.get(run.transfer_id)
        if h is not None and h.prefill_tokens:
            self.loads[h.prefill].queued_tokens -= h.prefill_tokens
            h.prefill_tokens = 0

    def kv_arrived(self, run: "RequestRun") -> None:
        h = self.held.get(run.transfer_id)
        if h is not None and h.pinned:
            self.loads[h.decode].pinned -= h.pinned
            h.pinned = 0
            self.drain()

    def release(self, run: "RequestRun") -> None:
        """The run is over: give back everything it holds, and let waiting runs go."""
        for q in (self.queue, self.decode_queue):
            if run in q:
                q.remove(run)
        h = self.held.pop(run.transfer_id, None)
        if h is not None:
            if h.prefill:
                p = self.loads[h.prefill]
                p.queued_tokens -= h.prefill_tokens
                p.legs -= 1
            if h.decode:
                d = self.loads[h.decode]
                d.committed -= h.decode_blocks
                d.pinned -= h.pinned
                d.legs -= 1
        self.drain()

    def drain(self) -> None:
        """Hand room that appeared to waiting runs: late D legs first (their P did the work)."""
        while self.decode_queue:
            run = self.decode_queue[0]
            d = P.pick_decode(self.loads.values(), run.decode_tokens)
            if d is None:
                return
            self.decode_queue.popleft()
            self._commit_decode(self.held.setdefault(run.transfer_id, Held()), d.engine_id, run.decode_tokens,
                                pin=False)
            run.deliver("router", DecodePlaced(d.engine_id))
        while self.queue:
            run = self.queue[0]
            v = P.place_waiting(list(self.loads.values()), run.decode_tokens, mode=self.mode,
                                pin_fraction=self.pin_fraction)
            if v.kind not in (P.PUSH, P.LATE):
                return  # no room yet (or no live instance: it may come back before the deadline)
            self.queue.popleft()
            self._commit(run, v)
            run.deliver("router", Placed(v))

    def holder(self, run: "RequestRun") -> Held:
        return self.held.get(run.transfer_id) or Held()
