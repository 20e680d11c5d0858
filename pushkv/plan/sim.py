"""A discrete-event simulation of a pushkv deployment, priced by the router's cost model.

Pure: no processes, no sockets, no clock. ``simulate(workload, profile, mode, n_p, n_d)`` runs
every turn of the workload through ``n_p`` prefill and ``n_d`` decode instances (``local``:
``n_d`` instances that do both) and returns each turn's TTFT and TPOT.

What it models, as pushkv does it:

- **P** prefills in steps, computing what its prefix cache lacks: the prompts that arrive while
  a step runs go in the next step together (``plan/prefill_step.py``: arrival order, up to the
  profile's ``max_batch_tokens`` and ``max_num_seqs``; budget 0, one prompt a step), the step costs
  the router's prefill price of all its tokens (one fixed part a step), and every prompt of it waits
  for the whole step, its layer groups stored at the step's shares; the router picks the P that
  would finish first and the D holding the most of the prompt (``router.policy``'s rules, the
  same prices);
- **one device** (``profile.one_device``: P and D on one GPU): the steps of P and D that run at
  once share it, each at an equal share of its time (the GPU time-slices between the processes),
  so a prefill while D decodes takes up to twice its lone time, and D's steps too; where the
  transport stages the transfers through that device (``profile.staged_holds``: pull's READs
  through UCX's ``cuda_copy``), no transfer moves while a prefill computes (``plan/link.py``, "Held");
- **D** runs continuous batching: a step of ``b`` sequences of mean context ``c`` costs
  ``step_ms(b, c)``; a prefill on D (local mode, or conditional disaggregation's decode-local)
  runs inside a step and every sequence of that step waits for it;
- **handoff**: push WRITEs after the prefill (``push``), or each layer group as it is stored
  (``push-layer``: only the last group's share, or what the link could not move during the
  prefill, is left); pull relays P's answer through the router (``relay_ms``) and READs
  (``pull``, on D's writer) or READs inside D's step (``pull-inline``: D's engine waits);
- **the link** (only with ``profile.link_window`` set): every transfer into a D goes on D's one
  link (``plan/link.py``), sharing its rate. Each P's WRITEs into it (push's one, push-layer's
  parts: a request's next part as soon as a group is stored and fewer than ``PARTS_AHEAD`` (2) of
  its parts are queued or on the link, else once one of them has landed, carrying every group
  stored since, as P's rendezvous asks them, and at the prefill's end the rest at once; D has
  the KV once every part has landed and the last WRITE's notice, the fixed cost, is paid) queue
  under that P writer's window and order
  (``protocol/link_queue.py``, the queue P's writer runs per D, which keeps a request's parts in
  the order asked); pull's READs queue on D's side: ``pull-inline``'s one at a time because D's
  engine waits for each (no step runs while one is under way), ``pull``'s in D's writer's queue per
  P (``profile.read_window``, the link window where None; two at a time over TCP; before D had that
  queue, its READs posted at once to one P moved about one after another, modelled so on the CPU's
  capped link: -4 % and +4 % at 0.5 and 0.9 of the link; shared instead: +20 % and +60 %); push's
  late allocation is D's READ on that lane too, one at a time, as pushkv does it. A P's WRITEs
  and D's READs from it are one stream (``plan/link.py``): a
  READ waits for the WRITEs on the wire before it, not sharing the link with them (push-off at 8k
  on the H200: +36 % shared, +13 % so). Without
  it each transfer moves alone at the link's rate however many overlap;
- **D memory**: a request holds prompt + output tokens on D; push reserves them at arrival
  (while P computes; past ``pin_fraction`` of D pinned, late allocation), pull after the
  prefill; a request no D can hold waits at the router, FIFO;
- **P memory**: a prompt holds its blocks on P from its admission until its KV has left P (the
  last of P's WRITEs, or D's READ, has moved its bytes), as P's scheduler frees them; a prompt P
  cannot hold waits at P, FIFO (pull's READs keep P's blocks for as long as they take);
- **prefix caches** (``prefix_cache``): P keeps a conversation's prompts, D its prompts and
  answers, both the shared system prompt, and a replayed turn's ``cached`` prefix (held from
  before the run); no eviction (the planner assumes caches large enough for the working set);
- ``conditional``: push, with D prefilling a request itself when ``policy.choose_path`` says so.

The first token comes with the KV (D re-emits P's token when the KV lands) or, on D, at the end
of the step that prefilled it; TPOT is a request's mean gap between its later tokens.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Literal, Optional, TypeVar, get_args

import numpy as np

from pushkv.plan.link import Link, LinkSpec
from pushkv.plan.prefill_step import next_step
from pushkv.plan.profile import Profile
from pushkv.plan.workload import Turn, Workload
from pushkv.protocol.link_queue import LinkPost, Window
from pushkv.protocol.rendezvous import PARTS_AHEAD
from pushkv.router import policy as P

SimMode = Literal["local", "push", "push-layer", "pull", "pull-inline", "conditional"]
MODES: tuple[SimMode, ...] = get_args(SimMode)




T = TypeVar("T")
DEVICE = "device"  # the links' key of the device P's and D's steps share (profile.one_device)
US_PER_MS = 1000  # a step's compute on the shared device, in its units (µs of lone compute)


def _set(value: Optional[T]) -> T:
    """A field the simulation has set by the time it reads it (a request's instance, its times)."""
    assert value is not None
    return value

@dataclass(eq=False)  # identity: two requests alike are still two
class Req:
    turn: Turn
    arrival: float = 0.0
    p: Optional[int] = None
    d: Optional[int] = None
    path: str = ""
    p_hit: int = 0
    d_hit: int = 0
    prefill_ms: float = 0.0
    pinned: bool = False  # D reserved at arrival, KV not there yet
    first: Optional[float] = None
    last: Optional[float] = None
    tokens: int = 0
    blocks: int = 0  # what moves (the link model)
    groups_stored: int = 0  # push-layer: layer groups P has stored
    parts_posted: int = 0  # push-layer: groups whose part has been offered to the link
    parts_on_link: int = 0  # its parts queued or in flight (up to PARTS_AHEAD, as P's rendezvous asks them)
    first_offer: Optional[float] = None  # its first post's offer (orders "arrival" and "deadline")
    prefill_end: Optional[float] = None  # P's prefill ended (P's leg)
    p_held: int = 0  # tokens of P's blocks it holds (0: none, or freed)

    @property
    def need(self) -> int:
        return self.turn.prompt + self.turn.output

    @property
    def ttft_ms(self) -> float:
        return _set(self.first) - self.arrival

    @property
    def tpot_ms(self) -> Optional[float]:
        return (_set(self.last) - _set(self.first)) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class Instance:
    held: dict = field(default_factory=dict)  # conversation -> leading prompt tokens cached
    system: bool = False  # holds the shared prefix
    waiting: list = field(default_factory=list)  # P: (request, tokens to compute) for its next steps
    admitting: deque = field(default_factory=deque)  # P: (request, tokens to compute) waiting for P's blocks
    held_tokens: int = 0  # P: the blocks (in tokens) its prompts hold until their KV has left
    queued: int = 0  # P: prompt tokens still to compute; D: its own prefills' tokens queued
    used: int = 0  # D: tokens reserved
    pinned: int = 0  # D: tokens reserved early, KV not there yet
    running: list = field(default_factory=list)  # D: decoding
    joining: list = field(default_factory=list)  # D: KV here, decoding from the next step
    local: list = field(default_factory=list)  # D: to prefill in its next step
    stepping: bool = False
    blocked_until: float = 0.0  # D, pull-inline: no step starts before the READs under way end
    wake: bool = False  # a kick is scheduled for blocked_until
    reading: int = 0  # D, pull-inline over the link model: READs queued or under way (no step runs)


class Simulation:
    def __init__(self, workload: Workload, profile: Profile, mode: SimMode, n_p: int, n_d: int,
                 prefix_cache: bool = True, pin_fraction: float = 0.5):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} ({' | '.join(MODES)})")
        if n_d < 1 or (mode != "local" and n_p < 1):
            raise ValueError(f"{mode} needs at least one {'instance' if mode == 'local' else 'P and one D'}")
        self.prof, self.c, self.mode = profile, profile.costs, mode
        self.cache, self.pin_fraction = prefix_cache, pin_fraction
        self.ps = [Instance() for _ in range(0 if mode == "local" else n_p)]
        self.ds = [Instance() for _ in range(n_p + n_d if mode == "local" else n_d)]  # local: every instance does both
        self.now = 0.0
        self.events: list = []
        self._seq = itertools.count()
        self.waiting: deque[tuple[Req, Callable[[Req], None]]] = deque()  # (request, what to do once a D holds it)
        self.done: list[Req] = []
        # D -> the link every transfer into it shares (profile.link_window set); DEVICE -> the one
        # device every instance's steps share (profile.one_device)
        self.links: dict[Hashable, Link] = {}
        self.prefills = 0  # prefills computing now (profile.staged_holds: each transfer link is held meanwhile)
        if profile.one_device:
            self.links[DEVICE] = Link(LinkSpec(float(US_PER_MS)))
        self._link_version: dict[Hashable, int] = {}
        self._posts = itertools.count()
        self._on_end: dict[Hashable, Callable[[], None]] = {}  # post id -> what its end does
        self.convs = workload.conversations()
        for turns in self.convs:
            self.at(turns[0].start_s * 1e3, self.arrive, Req(turns[0]))

    # -- the event loop ------------------------------------------------------------------
    def at(self, t_ms: float, fn, *args) -> None:
        heapq.heappush(self.events, (t_ms, next(self._seq), fn, args))

    def run(self) -> list[Req]:
        while self.events:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(*args)
        return self.done

    # -- prefix caches -----------------------------------------------------------------
    def hit(self, inst: Instance, t: Turn, unit: int) -> int:
        if not self.cache:
            return 0
        held = max(inst.held.get(t.conv, 0), t.shared if inst.system else 0, t.cached)
        return min(held, t.prompt - 1) // unit * unit

    def keep(self, inst: Instance, t: Turn, tokens: int) -> None:
        inst.system = True
        inst.held[t.conv] = max(inst.held.get(t.conv, 0), tokens)

    # -- placement (router.policy's prices) --------------------------------------------------
    def p_load(self, i: int) -> P.Load:
        return P.Load(f"p{i}", "prefill", block_size=self.prof.block_size, queued_tokens=self.ps[i].queued, order=i)

    def d_load(self, j: int) -> P.Load:
        d = self.ds[j]
        legs = len(d.running) + len(d.joining) + len(d.local)
        return P.Load(f"d{j}", "decode", block_size=self.prof.block_size, legs=legs, queued_tokens=d.queued, order=j)

    def ask(self, r: Req) -> P.Ask:
        bs = self.prof.block_size
        hits = {f"p{i}": self.hit(p, r.turn, bs) for i, p in enumerate(self.ps)}
        hits.update({f"d{j}": self.hit(d, r.turn, bs) for j, d in enumerate(self.ds)})
        return P.Ask(r.turn.prompt, hits, self.c, self.mode == "conditional")

    def pick_p(self, a: P.Ask) -> int:
        return min(range(len(self.ps)), key=lambda i: (P.prefill_wait_ms(self.p_load(i), a), i))

    def pick_d(self, r: Req, a: P.Ask, pin: bool) -> Optional[int]:
        cap = self.prof.d_capacity_tokens
        fits = [j for j, d in enumerate(self.ds) if d.used + r.need <= cap
                and (not pin or d.pinned + r.need <= self.pin_fraction * cap)]
        if not fits:
            return None
        return min(fits, key=lambda j: (-a.hits.get(f"d{j}", 0), self.ds[j].used, j))

    def reserve(self, r: Req, j: int, pin: bool) -> None:
        r.d, d = j, self.ds[j]
        d.used += r.need
        r.d_hit = self.hit(d, r.turn, self.prof.block_size)
        if pin:
            r.pinned, d.pinned = True, d.pinned + r.need

    def arrive(self, r: Req) -> None:
        r.arrival = self.now
        a = self.ask(r)
        if self.mode == "local":
            return self.wait_for_d(r, a, False, self.prefill_on_d)
        p = self.pick_p(a)
        if self.mode == "conditional":
            j = self.pick_d(r, a, pin=False)
            if j is not None and P.choose_path(self.p_load(p), self.d_load(j), a):
                self.reserve(r, j, pin=False)
                return self.prefill_on_d(r)
        if self.mode in ("push", "push-layer", "conditional"):
            j = self.pick_d(r, a, pin=True)
            if j is not None:
                self.reserve(r, j, pin=True)
                r.path = "push"
            else:
                r.path = "late"
        else:
            r.path = "pull"
        self.prefill_on_p(r, p, a)

    def wait_for_d(self, r: Req, a: P.Ask, pin: bool, then: Callable[[Req], None]) -> None:
        j = self.pick_d(r, a, pin) if not self.waiting else None
        if j is None:
            self.waiting.append((r, then))
            return
        self.reserve(r, j, pin)
        then(r)

    def drain(self) -> None:
        while self.waiting:
            r, then = self.waiting[0]
            j = self.pick_d(r, self.ask(r), pin=False)
            if j is None:
                return
            self.waiting.popleft()
            self.reserve(r, j, pin=False)
            then(r)

    # -- P -----------------------------------------------------------------------------
    def prefill_on_p(self, r: Req, i: int, a: P.Ask) -> None:
        p = self.ps[i]
        r.p, r.p_hit = i, a.hits[f"p{i}"]
        computed = r.turn.prompt - r.p_hit
        p.queued += computed
        if r.turn.prefill_span_ms is not None:  # a replayed run: P's prefill as it ran
            began, ended = r.turn.prefill_span_ms
            return self.prefill_step([(r, computed)], self.now + began, ended - began)
        p.admitting.append((r, computed))
        self.admit_p(i)

    def admit_p(self, i: int) -> None:
        """P takes the prompts waiting for its blocks, in arrival order, while they fit (one that
        needs more than P holds goes alone), and starts its next step."""
        p, bs = self.ps[i], self.prof.block_size
        while p.admitting:
            r, computed = p.admitting[0]
            need = P.blocks_for(r.turn.prompt, bs) * bs
            if p.held_tokens and p.held_tokens + need > self.prof.p_capacity_tokens:
                break
            p.admitting.popleft()
            r.p_held, p.held_tokens = need, p.held_tokens + need
            p.waiting.append((r, computed))
        self.kick_p(i)

    def kv_left_p(self, r: Req) -> None:
        """The prompt's KV has left P: its blocks are free for the prompts waiting there."""
        if r.p is None or not r.p_held:
            return
        self.ps[r.p].held_tokens -= r.p_held
        r.p_held = 0
        self.admit_p(r.p)

    def kick_p(self, i: int) -> None:
        """P's next step, if P is idle: the prompts waiting that fit (``prefill_step.next_step``)."""
        p = self.ps[i]
        if p.stepping or not p.waiting:
            return
        k = next_step([n for _, n in p.waiting], self.prof.max_batch_tokens, self.prof.max_num_seqs)
        batch, p.waiting = p.waiting[:k], p.waiting[k:]
        ms = self.c.prefill_ms(sum(n for _, n in batch), sum(r.p_hit for r, _ in batch))
        p.stepping = True
        if DEVICE not in self.links:
            self.prefill_step(batch, self.now, ms)
            return self.at(self.now + ms, self.p_stepped, i)
        self.p_share(i, batch, ms, self.now, 0)

    def p_share(self, i: int, batch: list[tuple[Req, int]], ms: float, start: float, g: int) -> None:
        """On the shared device: P's step computes in shares, one a layer group where push-layer
        streams (each stored when its share ends), at the device's pace."""
        streams = self.prof.link_window is not None and self.mode == "push-layer"
        n = self.prof.layer_groups if streams else 1
        for r, _ in batch:
            if streams and r.path == "push":
                if g == 0:
                    r.blocks = P.blocks_for(r.turn.prompt - r.d_hit, self.prof.block_size)
                else:
                    self.group_stored(r)
        if g == 0:
            self.prefill_computes(True)
        if g < n:
            (a, den), (b, _) = self.prof.stored_share(g), self.prof.stored_share(g + 1)
            share = ms * (b - a) / den if streams else ms
            return self.compute(f"p{i}", share, lambda: self.p_share(i, batch, ms, start, g + 1))
        self.prefill_computes(False)
        for r, computed in batch:
            r.prefill_ms = self.now - start
            self.prefilled(r, computed)
        self.p_stepped(i)

    def p_stepped(self, i: int) -> None:
        self.ps[i].stepping = False
        self.kick_p(i)

    def compute(self, who: str, ms: float, on_end: Callable[[], None]) -> None:
        """``ms`` of an instance's lone compute on the one device: every instance computing at once
        gets an equal share of it (it time-slices between them), so each takes longer."""
        pid = next(self._posts)
        self._on_end[pid] = on_end
        device = self.links[DEVICE]
        device.lane(who)
        device.offer(self.now, who, LinkPost(pid, who, max(1, round(ms * US_PER_MS))))
        self.link_wake(DEVICE)

    def prefill_computes(self, begins: bool) -> None:
        """A prefill begins or ends on the device; with ``profile.staged_holds`` every transfer link
        is held while any computes (``plan/link.py``, "Held")."""
        self.prefills += 1 if begins else -1
        if not self.prof.staged_holds:
            return
        for key, link in self.links.items():
            if key == DEVICE:
                continue
            (link.hold if begins else link.release)(self.now)
            self.link_wake(key)

    def prefill_step(self, batch: list[tuple[Req, int]], start: float, ms: float) -> None:
        """Every prompt of a step ends with it; push-layer's groups are stored at its shares."""
        self.at(start, self.prefill_computes, True)
        self.at(start + ms, self.prefill_computes, False)
        for r, computed in batch:
            r.prefill_ms = ms
            self.at(start + ms, self.prefilled, r, computed)
            if self.prof.link_window is not None and self.mode == "push-layer" and r.path == "push":
                r.blocks = P.blocks_for(r.turn.prompt - r.d_hit, self.prof.block_size)
                n = self.prof.layer_groups
                for g in range(n):  # group g stored after its share of the step
                    num, den = self.prof.stored_share(g + 1)
                    self.at(start + ms * num / den, self.group_stored, r)

    def prefilled(self, r: Req, computed: int) -> None:
        r.prefill_end = self.now
        p = self.ps[_set(r.p)]
        p.queued -= computed
        self.keep(p, r.turn, r.turn.prompt)
        if r.d is None:  # pull, or push's late allocation: D after P
            self.wait_for_d(r, self.ask(r), False, self.handoff)
        else:
            self.handoff(r)

    def handoff(self, r: Req) -> None:
        if self.prof.link_window is not None:
            return self.handoff_on_link(r)
        blocks = P.blocks_for(r.turn.prompt - r.d_hit, self.prof.block_size)
        move = self.c.handoff_ms(blocks)
        if self.mode == "push-layer" and r.path == "push":  # the groups left while P computed
            per = self.c.handoff_ms_per_block * blocks
            before, whole = self.prof.stored_share(self.prof.layer_groups - 1)  # the last group leaves last
            move = self.c.handoff_ms_fixed + max(per * (whole - before) / whole, per - r.prefill_ms)
        if r.path != "push":
            move += self.prof.relay_ms
        if self.mode == "pull-inline":  # D's engine waits for the READ, after the relay
            d = self.ds[_set(r.d)]
            d.blocked_until = max(d.blocked_until, self.now + self.prof.relay_ms) + move - self.prof.relay_ms
        self.at(self.now + move + r.turn.land_ms, self.kv_landed, r)

    # -- the link model (profile.link_window set) ------------------------------------------
    def link(self, r: Req) -> tuple[int, Link]:
        key = _set(r.d)
        if key not in self.links:
            self.links[key] = Link(LinkSpec(1.0 / self.c.handoff_ms_per_block, self.prof.link_overlap_share))
            if self.prof.staged_holds:  # made while prefills compute: held for them too
                self.links[key].now, self.links[key].held = self.now, self.prefills
        return key, self.links[key]

    def handoff_on_link(self, r: Req) -> None:
        if self.mode == "push-layer" and r.path == "push":
            return  # its parts are on their way (group_stored)
        r.blocks = P.blocks_for(r.turn.prompt - r.d_hit, self.prof.block_size)
        if r.path == "push":
            return self.offer(r, "write", r.blocks, lambda: self.landing(r))
        # pull's READ, or push's late allocation (a READ too), once D has P's answer through the router
        self.at(self.now + self.prof.relay_ms, self.post_after_relay, r)

    def post_after_relay(self, r: Req) -> None:
        inline = self.mode == "pull-inline"
        if inline:
            self.ds[_set(r.d)].reading += 1

        def done() -> None:
            if inline:
                self.ds[_set(r.d)].reading -= 1
                self.kick(_set(r.d))
            self.landing(r)

        # push's late allocation too is D's READ (the KV bytes P holds, as pull's), on D's lane: the
        # GPU runs show a late request's rendezvous "pull", its READ beside P's WRITEs
        self.offer(r, "read", r.blocks, done)

    def landing(self, r: Req) -> None:
        """The last bytes moved: D has the KV once the transfer's fixed cost (its notice) is paid."""
        self.kv_left_p(r)
        self.at(self.now + self.c.handoff_ms_fixed + r.turn.land_ms, self.kv_landed, r)

    def group_stored(self, r: Req) -> None:
        r.groups_stored += 1
        self.next_part(r)

    def next_part(self, r: Req) -> None:
        """push-layer: a request's next part carries every group stored and not yet offered, offered
        as soon as fewer than PARTS_AHEAD of its parts are queued or on the link (else once one of
        them lands; once the last group is stored, the rest at once), as P's rendezvous asks them:
        it waits in P's link queue while the one before it is on the wire. The KV has landed once
        every group's part has (the last WRITE, which follows them all, is its notice:
        ``landing``'s fixed cost)."""
        n = self.prof.layer_groups
        ahead = PARTS_AHEAD + (self.prof.rest_at_end and r.groups_stored == n)  # the prefill ended: the rest at once
        if r.parts_on_link >= ahead or r.parts_posted >= r.groups_stored:
            return
        (a, den), (b, _) = self.prof.stored_share(r.parts_posted), self.prof.stored_share(r.groups_stored)
        size = r.blocks * b // den - r.blocks * a // den
        r.parts_posted = r.groups_stored
        r.parts_on_link += 1

        def part_done() -> None:
            r.parts_on_link -= 1
            if r.parts_posted == n and not r.parts_on_link:
                self.landing(r)
            else:
                self.next_part(r)

        self.offer(r, "write", size, part_done, left=r.blocks - r.blocks * a // den)

    def offer(self, r: Req, lane: str, units: int, on_end: Callable[[], None], left: Optional[int] = None) -> None:
        key, link = self.link(r)
        # lanes per P on D's link, on that P's stream (see the top): P's writer queues its WRITEs per
        # D; D's READs from that P go one at a time, after what P posted before them. Pull inline's
        # READs go one at a time whatever their P: D's engine waits for each before it admits more
        stream = f"p{_set(r.p)}"
        if lane == "write":
            lane = f"write-{stream}"
            window = self.prof.link_window if self.prof.read_window is None else self.prof.read_window
            link.lane(lane, Window(window or 0), self.prof.link_order, stream)
        elif self.mode == "pull-inline":
            link.lane(lane, Window(1))
        else:  # D's writer queues its READs from each P under the deployment's window, as P its WRITEs
            lane = f"read-{stream}"
            window = self.prof.link_window if self.prof.read_window is None else self.prof.read_window
            link.lane(lane, Window(window or 0), self.prof.link_order, stream)
        r.first_offer = self.now if r.first_offer is None else r.first_offer
        pid = next(self._posts)
        self._on_end[pid] = on_end
        link.offer(self.now, lane, LinkPost(pid, id(r), units, units if left is None else left, r.first_offer,
                                            r.first_offer))
        self.link_wake(key)

    def link_wake(self, key: Hashable) -> None:
        """(Re)schedule the link's next end; an earlier schedule goes stale (its version)."""
        v = self._link_version[key] = self._link_version.get(key, 0) + 1
        t = self.links[key].next_end()
        if t is not None:
            self.at(t, self.link_ended, key, v)

    def link_ended(self, key: Hashable, version: int) -> None:
        if self._link_version.get(key) != version:
            return
        done, _ = self.links[key].ended(self.now)
        self.link_wake(key)
        for pid in done:
            self._on_end.pop(pid)()

    # -- D ------------------------------------------------------------------------------
    def kv_landed(self, r: Req) -> None:
        self.kv_left_p(r)  # without the link model: P frees the blocks as D has them
        d = self.ds[_set(r.d)]
        if r.pinned:
            d.pinned -= r.need
            r.pinned = False
        r.first = r.last = self.now
        r.tokens = 1
        if r.tokens >= r.turn.output:
            return self.finish(r)
        d.joining.append(r)
        self.kick(_set(r.d))

    def prefill_on_d(self, r: Req) -> None:
        r.path = r.path or ("local" if self.mode == "local" else "decode-local")
        d = self.ds[_set(r.d)]
        d.local.append(r)
        d.queued += r.turn.prompt - r.d_hit
        self.kick(_set(r.d))

    def kick(self, j: int) -> None:
        d = self.ds[j]
        if d.stepping or d.reading or not (d.running or d.joining or d.local):
            return
        if self.now < d.blocked_until:
            if not d.wake:
                d.wake = True
                self.at(d.blocked_until, self.woken, j)
            return
        d.running += d.joining
        d.joining = []
        batch, local = list(d.running), d.local
        d.local = []
        ms = self.c.step_ms(len(batch), sum(x.turn.prompt + x.tokens for x in batch) / len(batch)) if batch else 0.0
        for x in local:
            x.prefill_ms = self.c.local_prefill_ms(x.turn.prompt - x.d_hit, x.d_hit)
            d.queued -= x.turn.prompt - x.d_hit
            ms += x.prefill_ms
        d.stepping = True
        if DEVICE in self.links:
            return self.compute(f"d{j}", ms, lambda: self.stepped(j, batch, local))
        self.at(self.now + ms, self.stepped, j, batch, local)

    def woken(self, j: int) -> None:
        self.ds[j].wake = False
        self.kick(j)

    def stepped(self, j: int, batch: list, local: list) -> None:
        d = self.ds[j]
        for x in batch:
            x.tokens += 1
            x.last = self.now
            if x.tokens >= x.turn.output:
                d.running.remove(x)
                self.finish(x)
        for x in local:
            x.first = x.last = self.now
            x.tokens = 1
            if x.tokens >= x.turn.output:
                self.finish(x)
            else:
                d.running.append(x)
        d.stepping = False  # only now: a finish above may place a waiting request here (kick)
        self.kick(j)

    def finish(self, r: Req) -> None:
        d = self.ds[_set(r.d)]
        d.used -= r.need
        self.keep(d, r.turn, r.turn.prompt + r.turn.output - 1)
        self.done.append(r)
        turns = self.convs[r.turn.conv]
        if r.turn.index < len(turns):
            nxt = turns[r.turn.index]
            self.at(self.now + nxt.think_s * 1e3, self.arrive, Req(nxt))
        self.drain()


def simulate(workload: Workload, profile: Profile, mode: SimMode, n_p: int, n_d: int, *,
             prefix_cache: bool = True, pin_fraction: float = 0.5) -> list[Req]:
    return Simulation(workload, profile, mode, n_p, n_d, prefix_cache, pin_fraction).run()


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's, as the chat bench's tables)."""
    return float(np.percentile(xs, q)) if xs else float("nan")


def summary(reqs: list[Req], turns: str = "all") -> dict:
    """p50 / p99 of TTFT and TPOT (ms) of the turns chosen: "all", "1" or ">=2"."""
    pick = [r for r in reqs if turns == "all" or (turns == "1" and r.turn.index == 1)
            or (turns == ">=2" and r.turn.index >= 2)]
    ttft = [r.ttft_ms for r in pick]
    tpot = [r.tpot_ms for r in pick if r.tpot_ms is not None]
    paths: dict[str, int] = {}
    for r in pick:
        paths[r.path] = paths.get(r.path, 0) + 1
    return {"requests": len(pick), "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99), "paths": paths}
