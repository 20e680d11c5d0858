"""The router's instance set and its per-request accounting, around the pure policy.

``Balancer`` keeps one ``SchedulerLink`` and one ``policy.Load`` per P and D
instance (from a discovery ``Watcher``: it does not care where records come
from), and what each request holds on them. A ``RequestRun`` asks it to place
the request (``request``) and, for a late request whose prefill is done, its D
leg (``request_decode``); what cannot be placed now waits here, FIFO, and is
handed to its run as a ``Placed`` / ``DecodePlaced`` message on the run's queue
once room appears (``drain``, after every release and every instance change).

It also keeps what placement learns as requests run: the approximate prefix index
(``prefix_index``: P holds a prompt once its prefill finished, D the prompt and
answer once the request ended) and the cost model (``cost``: every request that
ended well is a sample of its timeline).
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from pushkv import messages as m
from pushkv.config import DeploymentConfig, Mode, Role
from pushkv.discovery.etcd_keys import REASON_WITHDRAWN
from pushkv.discovery.records import InstanceRecord
from pushkv.router import cost as C
from pushkv.router import policy as P
from pushkv.router.prefix_index import PrefixIndex, hashes, usable_hit_tokens
from pushkv.router.request_msgs import DecodePlaced, Placed, Source


class RequestRun(Protocol):
    """What the balancer reads of a request (``flow.RequestRun``, over ``request.Request``): it never
    imports the flow, and it only reads."""

    @property
    def transfer_id(self) -> str: ...

    @property
    def prompt(self) -> tuple[int, ...]: ...

    @property
    def output_ids(self) -> list[int]: ...  # tokens streamed so far

    @property
    def done(self) -> bool: ...  # D's last token came (the request ended well)

    @property
    def cached(self) -> dict[str, int]: ...  # leg -> prompt tokens that leg's instance took from its prefix cache

    @property
    def timeline(self) -> dict[str, float]: ...  # <leg>.<stage> -> wall seconds

    @property
    def hash_cache(self) -> dict[int, list[int]]: ...  # block size -> the prompt's chained block hashes

    @property
    def cache_salt(self) -> str: ...  # vLLM's: the root its prompt's chain starts from ("": the shared one)

    @property
    def lora(self) -> str: ...  # its LoRA adapter ("": the base model)

    @property
    def lora_root(self) -> str: ...  # what its chain's root names of its adapter: the name and which load of it

    @property
    def reuses_prefix(self) -> bool: ...  # False: asked prompt logprobs, so it is computed whole wherever it runs

    @property
    def decode_tokens(self) -> int: ...

    def deliver(self, leg: Source, msg: Any) -> None: ...


SchedulerLink = Any  # flow.SchedulerLink: held per instance, handed back to the flow, never used here

log = logging.getLogger(__name__)


def hold_tokens(run: "RequestRun") -> int:
    """The tokens whose blocks a D leg takes at its admission: the prompt and the first token's slot (D takes the
    output's blocks as it decodes, and preempts when it runs short). The router's ``committed`` counts these."""
    return min(len(run.prompt) + 1, run.decode_tokens)


def prefix_caching(cfg: DeploymentConfig) -> dict[str, bool]:
    """Per role, whether its instances take cached prefixes and keep what they computed or received, as their
    schedulers decide: a role's prefix cache (``DeploymentConfig.caches_prefixes``: never under dynamic RoPE), and
    on D not with sliding-window layers (only the window's blocks move, so D never takes a hit nor keeps what
    arrived: ``DecodeScheduler._reuses_prefix``). The router's index predicts hits only where they can happen."""
    return {"prefill": any(cfg.caches_prefixes(i) for i in cfg.role_instances("prefill")),
            "decode": any(cfg.caches_prefixes(i) for i in cfg.role_instances("decode"))
            and not cfg.model.sliding_window}


class Refused(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class Held:
    """What one request holds in the router's accounting."""

    prefill: str = ""
    prefill_leg: bool = False  # counted in P's legs: until D has the KV (P's part done), or the end
    prefill_tokens: int = 0  # still counted in P's queued_tokens (the prompt less P's predicted hit)
    decode: str = ""
    decode_blocks: int = 0  # counted in D's committed
    pinned: int = 0  # counted in D's pinned (push: reserved early, KV not here yet)
    late: bool = False
    local: bool = False  # D prefills it (DECODE_LOCAL)
    local_tokens: int = 0  # D: still counted in D's queued_tokens (its own prefill)
    predicted: int = 0  # prompt tokens the index said the prefilling instance holds
    predicted_decode: int = 0  # ... and D (push and late: what need not move)
    batch_at_first: int = 0  # D's legs when its first token came
    resets: int = 0  # the balancer's /reset_prefix_cache count when it was placed


def drained_reason(reason: str) -> str:
    """Why a draining instance's requests still in flight fail as it leaves the registry: its host stopped at the end
    of its drain (--shutdown-timeout ran out, or a second signal), or its lease lapsed meanwhile."""
    if reason == REASON_WITHDRAWN:
        return "its host stopped at the end of its drain (--shutdown-timeout)"
    return f"{reason} while its host drained"


class Balancer:
    def __init__(self, mode: Mode, pin_fraction: float, queue_bound: int, metrics=None, prefix_cache: bool = False,
                 conditional: bool = False, pin_wait_ms: float = math.inf, decode_cache: Optional[bool] = None):
        self.mode = mode
        self.pin_fraction = pin_fraction
        self.pin_wait_ms = pin_wait_ms  # push: no D pinned for a prefill P would finish later (policy.place)
        self.queue_bound = queue_bound
        self.metrics = metrics
        # which roles' instances cache prefixes (``prefix_caching``; ``decode_cache`` None: D as P): the index
        # records and predicts only theirs, and is worth keeping where any does
        self.caching = {"prefill": prefix_cache, "decode": prefix_cache if decode_cache is None else decode_cache}
        self.prefix_cache = any(self.caching.values())
        self.conditional = conditional
        self.index = PrefixIndex()
        self.resets = 0  # /reset_prefix_cache's since the start (Held.resets)
        self.cost = C.CostModel()
        self.loads: dict[str, P.Load] = {}
        self.links: dict[str, "SchedulerLink"] = {}
        self.records: dict[str, InstanceRecord] = {}
        self.held: dict[str, Held] = {}  # by transfer id
        self.queue: deque["RequestRun"] = deque()  # not started: no D could hold them
        self.decode_queue: deque["RequestRun"] = deque()  # late: prefill done, waiting for a D
        self.waited: set[str] = set()  # transfer ids counted in pushkv_router_queued: each request once
        self.picks = 0  # sequence of choices: ties go to the instance chosen least recently
        self.joining: dict[str, int] = {}  # linked, not chosen yet (add(joining=True) until ready): its join's number
        self.joins = 0

    # -- the instance set ------------------------------------------------------------
    def add(self, rec: InstanceRecord, make_link: Callable[[InstanceRecord], "SchedulerLink"],
            fresh: bool = False, joining: bool = False, draining: bool = False) -> None:
        """An instance is up (new, or back after InstanceDown); ``fresh``: a new link even at the
        same endpoint (a host back from a cut: the old TCP connection may still hold unsent bytes
        for a process that is gone, and would lose what we send next); ``joining``: linked but not
        chosen until ``ready`` (it is told first what changed since the launch: router/loras.py); ``draining``: met
        already draining (its host stops with --shutdown-timeout), linked and never chosen."""
        load = self.loads.get(rec.engine_id)
        if load is None or fresh or self.records[rec.engine_id].sched_endpoint != rec.sched_endpoint:
            old = self.links.pop(rec.engine_id, None)
            if old is not None:
                old.retire()
            self.links[rec.engine_id] = make_link(rec)
        if load is None:  # a known one keeps its accounting: runs still holding it release into it
            order = sum(1 for l in self.loads.values() if l.role == rec.role)
            load = self.loads[rec.engine_id] = P.Load(rec.engine_id, rec.role, order=order)
        load.num_blocks, load.block_size, load.up = rec.num_blocks, rec.block_size, not joining
        load.healthy, load.draining = True, draining  # a new incarnation
        self.records[rec.engine_id] = rec
        if joining:
            self.joins += 1
            self.joining[rec.engine_id] = self.joins
            log.info("%s instance %s joining (%d blocks)", rec.role, rec.engine_id, rec.num_blocks)
            return
        self.joining.pop(rec.engine_id, None)
        log.info("%s instance %s up (%d blocks)%s", rec.role, rec.engine_id, rec.num_blocks,
                 ", draining: chosen for no request" if draining else "")
        self.drain()

    def ready(self, engine_id: str, join: int) -> bool:
        """The instance that joined as ``join`` (``joining``'s number) is chosen from now (False: it went down, or
        joined again, meanwhile)."""
        if self.joining.get(engine_id) != join:
            return False
        del self.joining[engine_id]
        load = self.loads[engine_id]
        load.up = True
        log.info("%s instance %s up (%d blocks)", load.role, engine_id, load.num_blocks)
        self.drain()
        return True

    def health(self, engine_id: str, healthy: bool) -> Optional[P.Load]:
        """A process of the instance stopped answering its supervisor (it is chosen last), or answers again."""
        load = self.loads.get(engine_id)
        if load is not None and load.healthy != healthy:
            load.healthy = healthy
            if healthy:
                self.drain()
            return load
        return None

    def draining(self, rec: InstanceRecord) -> Optional[P.Load]:
        """The instance's host is stopping with --shutdown-timeout (its record says ``draining``): it is chosen for
        no new request from now, while the requests that hold it go on (their legs, its accounting and its link
        stay); it is lost only when it leaves the registry. None where it is not up here (unknown, down, or
        joining: not chosen anyway), or already draining."""
        load = self.loads.get(rec.engine_id)
        if load is None or not load.up or load.draining:
            self.joining.pop(rec.engine_id, None)
            return None
        load.draining = True
        self.records[rec.engine_id] = rec
        return load

    def down(self, engine_id: str) -> Optional[P.Load]:
        load = self.loads.get(engine_id)
        self.joining.pop(engine_id, None)
        if load is not None:
            load.up = False
            self.index.forget(engine_id)  # back, it starts with an empty cache
        return load

    def reset_index(self) -> None:
        """The instances forgot every cached prefix (/reset_prefix_cache): so does the index, and it records nothing
        of the requests placed before: their instances index none of what they held across the reset (its chain's
        head was forgotten: ``scheduler.Request.unchained``)."""
        self.index = PrefixIndex()
        self.resets += 1

    def source(self, engine_id: str) -> m.PrefillSource:
        rec = self.records[engine_id]
        return m.PrefillSource(rec.engine_id, rec.tp, tuple(rec.handshake_endpoints))

    def placed(self, v: P.Verdict) -> Placed:
        return Placed(v, self.source(v.prefill) if v.kind == P.PUSH else None)

    def live(self, role: Role) -> list[str]:
        return [e for e, l in self.loads.items() if l.role == role and l.up]

    @property
    def waiting(self) -> int:
        return len(self.queue) + len(self.decode_queue)

    # -- placing requests ------------------------------------------------------------------
    def _hits(self, run: "RequestRun") -> dict[str, int]:
        """Per live instance: the prompt tokens it would take from its cache, as the index guesses. For a
        request that asked prompt logprobs the instance that prefills it takes no hit (its positions would have
        no logits: ``Ask.whole``), but a D's hit still spares the transfer that much of the prompt."""
        if not self.prefix_cache or not len(self.index):
            return {}
        p_sizes = {l.block_size for l in self.loads.values() if l.role == "prefill" and l.up} or {1}
        out = {}
        for e, l in self.loads.items():
            if not P.placeable(l) or not l.block_size or not self.caching[l.role]:
                continue
            unit = l.block_size if l.role == "prefill" else math.lcm(l.block_size, *p_sizes)
            blocks = self.index.overlap(e, hashes(run.prompt, l.block_size, run.hash_cache, run.cache_salt,
                                                  run.lora_root))
            if blocks:
                out[e] = usable_hit_tokens(blocks, len(run.prompt), l.block_size, unit)
        return out

    def ask(self, run: "RequestRun") -> P.Ask:
        return P.Ask(len(run.prompt), self._hits(run), self.cost.costs, self.conditional, whole=not run.reuses_prefix,
                     hold_tokens=hold_tokens(run))

    def request(self, run: "RequestRun") -> Optional[P.Verdict]:
        """Place a new request now (its verdict), or queue it (None); Refused past the bound."""
        ask = self.ask(run)
        v = P.place(list(self.loads.values()), run.decode_tokens, mode=self.mode,
                    pin_fraction=self.pin_fraction, waiting=self.waiting, queue_bound=self.queue_bound, ask=ask,
                    pin_wait_ms=self.pin_wait_ms)
        if v.kind == P.REFUSE:
            if self.metrics is not None:
                self.metrics.refused.labels(status=str(v.status)).inc()
            raise Refused(v.status, v.reason)
        if v.kind == P.WAIT:
            self.queue.append(run)
            self._count_wait(run)
            log.debug("queued transfer_id=%s: %s (%d waiting)", run.transfer_id, v.reason, self.waiting)
            return None
        self._commit(run, v, ask)
        return v

    def _commit(self, run: "RequestRun", v: P.Verdict, ask: Optional[P.Ask] = None) -> None:
        h = self.held.setdefault(run.transfer_id, Held(resets=self.resets))
        hits = ask.hits if ask is not None else {}
        computed = {} if ask is not None and ask.whole else hits  # what spares the prefilling instance compute
        if self.metrics is not None:
            self.metrics.paths.labels(path=v.kind).inc()
        if v.kind == P.DECODE_LOCAL:
            h.local = True
            h.predicted = computed.get(v.decode, 0)
            self._commit_decode(h, v.decode, hold_tokens(run), pin=False)
            d = self.loads[v.decode]
            h.local_tokens = len(run.prompt) - h.predicted
            d.queued_tokens += h.local_tokens
            return
        p = self.loads[v.prefill]
        h.predicted = computed.get(v.prefill, 0)
        if v.decode:
            h.predicted_decode = hits.get(v.decode, 0)
        # P's queue is what P will compute: its cached prefix costs no step time (as D's own prefills count, and
        # the planner's P); the whole prompt made a P that held a busy prefix look as loaded as one computing it all
        h.prefill, h.prefill_tokens = v.prefill, len(run.prompt) - h.predicted
        p.queued_tokens += h.prefill_tokens
        p.legs += 1
        h.prefill_leg = True
        self.picks += 1
        p.last_pick = self.picks
        if v.kind == P.PUSH:
            self._commit_decode(h, v.decode, hold_tokens(run), pin=True)
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
        d = P.pick_decode(self.loads.values(), run.decode_tokens, self.ask(run)) if not self.decode_queue else None
        if d is None:
            self.decode_queue.append(run)
            self._count_wait(run)  # it waits at the router for a D that can hold it, as a queued arrival does
            return None
        self._commit_late_decode(run, d.engine_id)
        return d.engine_id

    def _count_wait(self, run: "RequestRun") -> None:
        """pushkv_router_queued counts requests: one queued at arrival whose late D leg waits again counts once."""
        if self.metrics is not None and run.transfer_id not in self.waited:
            self.metrics.queued.inc()
        self.waited.add(run.transfer_id)

    def _commit_late_decode(self, run: "RequestRun", engine_id: str) -> None:
        h = self.held.setdefault(run.transfer_id, Held(resets=self.resets))
        h.predicted_decode = self._hits(run).get(engine_id, 0)
        self._commit_decode(h, engine_id, hold_tokens(run), pin=False)

    # -- what a run reports ------------------------------------------------------------------
    def prefill_done(self, run: "RequestRun") -> None:
        h = self.held.get(run.transfer_id)
        if h is not None and h.prefill_tokens:
            self.loads[h.prefill].queued_tokens -= h.prefill_tokens
            h.prefill_tokens = 0
        # P indexed the prompt as it computed it
        if h is not None and h.prefill and self.caching["prefill"] and h.resets == self.resets:
            p = self.loads[h.prefill]
            self.index.record(h.prefill, hashes(run.prompt, p.block_size, run.hash_cache, run.cache_salt,
                                                run.lora_root), p.num_blocks)

    def kv_arrived(self, run: "RequestRun") -> None:
        """D's first token: its KV is there (or D computed it)."""
        h = self.held.get(run.transfer_id)
        if h is None:
            return
        if h.prefill_leg:  # P's part is done (its KV is in D): it no longer counts in P's legs in flight
            self.loads[h.prefill].legs -= 1
            h.prefill_leg = False
        if h.decode:
            h.batch_at_first = self.loads[h.decode].legs
        if h.local_tokens:
            self.loads[h.decode].queued_tokens -= h.local_tokens
            h.local_tokens = 0
        if h.pinned:
            self.loads[h.decode].pinned -= h.pinned
            h.pinned = 0
            self.drain()

    def _learn(self, run: "RequestRun", h: Held) -> None:
        """A request ended well: what its instances now hold, and what its timeline says of costs."""
        leg = "decode" if h.local else "prefill"
        cached = run.cached.get(leg, 0)
        d_cached = run.cached.get("decode", 0)
        p_bs = self.loads[h.prefill].block_size if h.prefill else 1
        moved = 0 if h.local else P.blocks_for(len(run.prompt) - d_cached, p_bs)
        batch = (h.batch_at_first + self.loads[h.decode].legs) / 2 if h.decode else 1.0
        self.cost.add(C.samples(run.timeline, len(run.prompt), len(run.output_ids), prefill_leg=leg,
                                cached_tokens=cached, moved_blocks=moved, decode_batch=batch,
                                prefill_work=getattr(run, "prefill_work", ()),
                                decode_work=getattr(run, "decode_work", ())))
        if self.metrics is not None and self.prefix_cache:
            self.metrics.prefix_guess(leg, h.predicted, cached)
            if not h.local:
                self.metrics.prefix_guess("decode", h.predicted_decode, d_cached)
        if self.caching["decode"] and h.decode and run.output_ids and h.resets == self.resets:
            d = self.loads[h.decode]  # D keeps prompt + answer (the last token's KV was never computed)
            seq = tuple(run.prompt) + tuple(run.output_ids[:-1])
            self.index.record(h.decode, hashes(seq, d.block_size, {}, run.cache_salt, run.lora_root), d.num_blocks)

    def release(self, run: "RequestRun") -> None:
        """The run is over: give back everything it holds, and let waiting runs go."""
        for q in (self.queue, self.decode_queue):
            if run in q:
                q.remove(run)
        self.waited.discard(run.transfer_id)
        h = self.held.pop(run.transfer_id, None)
        if h is not None and getattr(run, "done", False):
            self._learn(run, h)
        if h is not None:
            if h.prefill:
                p = self.loads[h.prefill]
                p.queued_tokens -= h.prefill_tokens
                p.legs -= h.prefill_leg
            if h.decode:
                d = self.loads[h.decode]
                d.queued_tokens -= h.local_tokens
                d.committed -= h.decode_blocks
                d.pinned -= h.pinned
                d.legs -= 1
        self.drain()

    def drain(self) -> None:
        """Hand room that appeared to waiting runs: late D legs first (their P did the work)."""
        while self.decode_queue:
            run = self.decode_queue[0]
            d = P.pick_decode(self.loads.values(), run.decode_tokens, self.ask(run))
            if d is None:
                return
            self.decode_queue.popleft()
            self._commit_late_decode(run, d.engine_id)
            run.deliver("router", DecodePlaced(d.engine_id))
        while self.queue:
            run = self.queue[0]
            ask = self.ask(run)
            v = P.place_waiting(list(self.loads.values()), run.decode_tokens, mode=self.mode,
                                pin_fraction=self.pin_fraction, ask=ask, pin_wait_ms=self.pin_wait_ms)
            if v.kind not in (P.PUSH, P.LATE, P.DECODE_LOCAL):
                return  # no room yet (or no live instance: it may come back before the deadline)
            self.queue.popleft()
            self._commit(run, v, ask)
            run.deliver("router", self.placed(v))

    def holder(self, run: "RequestRun") -> Held:
        return self.held.get(run.transfer_id) or Held()
