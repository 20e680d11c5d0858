"""Which P and which D serve a request: pure, no sockets, no clock.

The router keeps one ``Load`` per instance, its own accounting of the legs it
sent (it is every scheduler's only client, so its count is what the instance
holds or will hold), and asks:

- ``place(...)`` at arrival: a ``Verdict``: **push** (both legs now; D reserves
  while P computes), **late** (P now, D's leg once P has finished: late
  allocation, pull-style), **decode-local** (D prefills it itself: nothing moves;
  only with ``conditional``), **wait** (at the router, until a D can hold the
  request), or **refuse** (HTTP status and a reason);
- ``pick_decode(...)`` when a late request's prefill has finished: a D that can
  hold it now, or None (the D leg waits at the router).

P is the live prefill instance that would finish the prefill first: its queued
prefill tokens plus what of this prompt it lacks (``Ask.hits``: the prompt tokens
the router's prefix index says each instance holds), priced by the cost model. D
is the live decode instance that can take the request's blocks at admission now
(``Ask.hold_tokens``: its prompt and the first token's slot; D takes the output's
blocks as it decodes and preempts when it runs short, so a D that could never hold
prompt + ``max_tokens`` alone is the only one refused) where it costs least: the
handoff of what of the prompt D lacks, plus its decode in a batch one larger and the
delay it adds to D's running sequences (``decode_cost_ms``); then the one with the
most free blocks left.

Conditional disaggregation (``choose_path``): with P and D chosen, D prefills the
request itself when that costs less, in ms of the cost model, than P's prefill
and the handoff: D's queued local prefills and one running step, plus its prefill
of what D lacks, plus that prefill's delay to every sequence D is decoding
(they wait for it), against P's queue, P's prefill of what P lacks and the handoff
of the blocks D lacks. No fixed threshold: the prices are the deployment's own.

Push pins D blocks while P computes. ``pin_fraction`` caps the blocks of one D
reserved early and still waiting for their KV; a request past it (D short of
blocks) falls back to late allocation, so a P backlog cannot pin all of D. So does
a request whose prefill P would finish only after ``pin_wait_ms`` (its queue
priced by the cost model): D's registration would wait past P's and D's deadlines
for a prefill that has not started (under load, a 502 after a wasted prefill).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

from pushkv.config import Mode, Role
from pushkv.router.cost import Costs

PUSH, LATE, WAIT, REFUSE, DECODE_LOCAL = "push", "late", "wait", "refuse", "decode-local"


@dataclass
class Load:
    """One instance as the router sees it."""

    engine_id: str
    role: Role  # "prefill" | "decode"
    num_blocks: int = 0
    block_size: int = 16
    order: int = 0  # tie-break: the instance's index
    up: bool = True
    healthy: bool = True  # its processes answer their supervisor's pings (one host): a hung one is chosen last
    draining: bool = False  # its host stops (--shutdown-timeout): alive, its legs go on, but chosen for none
    queued_tokens: int = 0  # prompt tokens to compute of legs sent whose prefill has not finished (D: its own prefills)
    legs: int = 0  # legs sent and not ended
    committed: int = 0  # D: blocks its legs sent and not ended take at admission (their output's come as D decodes)
    pinned: int = 0  # D: blocks reserved early (push) whose KV has not arrived yet
    last_pick: int = 0  # when it was last chosen (a sequence number): ties go to the least recent

    @property
    def free(self) -> int:
        return self.num_blocks - self.committed


@dataclass
class Verdict:
    kind: str  # PUSH | LATE | DECODE_LOCAL | WAIT | REFUSE
    prefill: Optional[str] = None  # engine id (not DECODE_LOCAL)
    decode: Optional[str] = None  # engine id (PUSH, DECODE_LOCAL: LATE picks D after P)
    status: int = 0  # REFUSE: the HTTP status
    reason: str = ""  # REFUSE, LATE, WAIT: why
    notes: dict = field(default_factory=dict)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def placeable(load: Load) -> bool:
    """Whether a new request (or a late request's D leg) may be placed on the instance: up, and not draining (its
    host stopping with --shutdown-timeout serves what it holds and takes nothing new, even where it is the only
    one: a request is then refused, or waits, as where none is up)."""
    return load.up and not load.draining


def live(loads: Iterable[Load], role: Role) -> list[Load]:
    """The role's instances a request may be placed on (``placeable``); the healthy ones only, where any is (a hung
    worker's instance takes no new request while another can, and is still chosen where it is the only one)."""
    up = [l for l in loads if l.role == role and placeable(l)]
    return [l for l in up if l.healthy] or up


@dataclass(frozen=True)
class Ask:
    """What placement knows of one request besides its size."""

    prompt_tokens: int = 0
    hits: dict = field(default_factory=dict)  # engine id -> prompt tokens it probably holds (usable hits)
    costs: Costs = Costs()
    conditional: bool = False  # may D prefill it itself (conditional disaggregation)?
    # asked prompt logprobs: whichever instance prefills it computes it whole (no hit saves compute there), while a
    # D that holds a prefix still takes it, so that much of the prompt need not move
    whole: bool = False
    # the tokens whose blocks D takes at admission (its prompt and the first token's slot: the output's come as it
    # decodes); 0: the whole request's (prompt + max_tokens)
    hold_tokens: int = 0

    def compute_hit(self, load: "Load") -> int:
        """The prompt tokens ``load`` would not compute again, were it to prefill the request."""
        return 0 if self.whole else min(self.hits.get(load.engine_id, 0), self.prompt_tokens)


NO_ASK = Ask()


def prefill_wait_ms(load: Load, ask: Ask) -> float:
    """When ``load`` would finish this prompt's prefill: its queue, then what of the prompt it lacks."""
    hit = ask.compute_hit(load)
    c = ask.costs
    return c.prefill_ms_per_token * load.queued_tokens + c.prefill_ms(ask.prompt_tokens - hit, hit)


def pick_prefill(loads: Iterable[Load], ask: Ask = NO_ASK) -> Optional[Load]:
    """The live P that would finish the prefill first (with no hits anywhere: the fewest queued
    prefill tokens), then fewest legs, then the least recently chosen, then index."""
    ps = live(loads, "prefill")
    return min(ps, key=lambda l: (prefill_wait_ms(l, ask), l.legs, l.last_pick, l.order)) if ps else None


def decode_need(load: Load, tokens: int, ask: Ask = NO_ASK) -> int:
    """The blocks the request takes on ``load`` at admission (``Ask.hold_tokens``, else all of ``tokens``)."""
    return blocks_for(min(ask.hold_tokens, tokens) if ask.hold_tokens else tokens, load.block_size)


def decode_cost_ms(load: Load, tokens: int, ask: Ask) -> float:
    """What serving the request on ``load`` costs, priced: the handoff of the blocks it lacks, and
    its decode there (``tokens - prompt`` steps of a batch one larger) plus the delay it adds to the
    sequences already there (each step of theirs one sequence larger while it runs)."""
    c = ask.costs
    n = ask.prompt_tokens
    hit = min(ask.hits.get(load.engine_id, 0), n)
    out = max(tokens - n, 1)
    grow = c.step_ms(load.legs + 1, tokens) - c.step_ms(load.legs, tokens)
    decode = out * (c.step_ms(load.legs + 1, tokens) + load.legs * grow)
    return c.handoff_ms(blocks_for(n - hit, load.block_size)) + decode


def pick_decode(loads: Iterable[Load], tokens: int, ask: Ask = NO_ASK) -> Optional[Load]:
    """The live D that can take the request of ``tokens`` (prompt + max_tokens) now (its blocks at admission,
    ``decode_need``) at the lowest ``decode_cost_ms`` (with no hits anywhere: the fewest running), then with the
    most free blocks left, then the least recently chosen, then index; None when none can."""
    fits = [l for l in live(loads, "decode") if l.free >= decode_need(l, tokens, ask)]
    if not fits:
        return None
    return min(fits, key=lambda l: (decode_cost_ms(l, tokens, ask), -(l.free - decode_need(l, tokens, ask)), l.legs,
                                    l.last_pick, l.order))


@dataclass(frozen=True)
class PathCosts:
    """Both ways of serving one request on a chosen P and D, in ms of the cost model."""

    split_ms: float  # P's queue + P's prefill of what P lacks + the handoff of what D lacks (the TTFT)
    local_ms: float  # D's queued prefills and a running step + D's prefill of what D lacks (the TTFT)
    local_delay_ms: float  # what D's prefill adds to the sequences D decodes meanwhile (all of them)

    @property
    def local_wins(self) -> bool:
        return self.local_ms + self.local_delay_ms < self.split_ms


def path_costs(p: Load, d: Load, ask: Ask, p_block_size: int) -> PathCosts:
    c = ask.costs
    n = ask.prompt_tokens
    d_hit = min(ask.hits.get(d.engine_id, 0), n)
    moved = blocks_for(n - d_hit, p_block_size)
    split = prefill_wait_ms(p, ask) + c.handoff_ms(moved)
    running = d.legs  # sequences D holds: decoding now, or about to
    d_computes = ask.compute_hit(d)
    d_prefill = c.local_prefill_ms(n - d_computes, d_computes)
    step = c.step_ms(running, n) if running else 0.0
    local = c.local_ms_per_token * d.queued_tokens + step + d_prefill
    return PathCosts(split, local, running * d_prefill)


def choose_path(p: Load, d: Load, ask: Ask) -> bool:
    """True: D prefills the request itself (see the module's doc)."""
    return ask.conditional and path_costs(p, d, ask, p.block_size).local_wins


def place(loads: list[Load], tokens: int, *, mode: Mode, pin_fraction: float, waiting: int,
          queue_bound: int, ask: Ask = NO_ASK, pin_wait_ms: float = math.inf) -> Verdict:
    """A new request of ``tokens`` (prompt + max_tokens) with ``waiting`` requests already
    queued at the router (they go first: FIFO)."""
    p = pick_prefill(loads, ask)
    ds = live(loads, "decode")
    if p is None or not ds:
        missing = "prefill" if p is None else "decode"
        return Verdict(REFUSE, status=503, reason=f"no live {missing} instance")
    biggest = max(ds, key=lambda l: l.num_blocks)
    need = decode_need(biggest, tokens)
    if need > biggest.num_blocks:
        return Verdict(REFUSE, status=413,
                       reason=f"request needs {need} KV blocks; the decode pool has {biggest.num_blocks}")
    d = pick_decode(loads, tokens, ask) if waiting == 0 else None
    if d is None:
        if waiting >= queue_bound:
            return Verdict(REFUSE, status=429,
                           reason=f"router queue full: {waiting} request(s) waiting for decode blocks "
                                  f"(bound {queue_bound})")
        return Verdict(WAIT, reason="no decode instance can hold the request now")
    if choose_path(p, d, ask):
        pc = path_costs(p, d, ask, p.block_size)
        return Verdict(DECODE_LOCAL, decode=d.engine_id,
                       reason=f"D prefills: {pc.local_ms:.1f} + {pc.local_delay_ms:.1f} ms against "
                              f"{pc.split_ms:.1f} ms on P and the handoff")
    if mode != "push":
        return Verdict(LATE, prefill=p.engine_id, reason="pull")
    if d.pinned + decode_need(d, tokens, ask) > pin_fraction * d.num_blocks:
        return Verdict(LATE, prefill=p.engine_id,
                       reason=f"decode short of blocks: {d.pinned} of {d.num_blocks} already wait for KV")
    wait = prefill_wait_ms(p, ask)
    if wait > pin_wait_ms:
        return Verdict(LATE, prefill=p.engine_id,
                       reason=f"prefill queue: P would finish in {wait:.0f} ms, past {pin_wait_ms:.0f} ms of "
                              f"pinning D")
    return Verdict(PUSH, prefill=p.engine_id, decode=d.engine_id)


def place_waiting(loads: list[Load], tokens: int, *, mode: Mode, pin_fraction: float,
                  ask: Ask = NO_ASK, pin_wait_ms: float = math.inf) -> Verdict:
    """The head of the router's queue, when room may have appeared: as ``place`` with an
    empty queue, but never refused for the queue (it is in it)."""
    return place(loads, tokens, mode=mode, pin_fraction=pin_fraction, waiting=0, queue_bound=1, ask=ask,
                 pin_wait_ms=pin_wait_ms)
