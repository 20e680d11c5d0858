"""Which P and which D serve a request: pure, no sockets, no clock.

The router keeps one ``Load`` per instance, its own accounting of the legs it
sent (it is every scheduler's only client, so its count is what the instance
holds or will hold), and asks:

- ``place(...)`` at arrival: a ``Verdict``: **push** (both legs now; D reserves
  while P computes), **late** (P now, D's leg once P has finished: late
  allocation, pull-style), **wait** (at the router, until a D can hold the
  request), or **refuse** (HTTP status and a reason);
- ``pick_decode(...)`` when a late request's prefill has finished: a D that can
  hold it now, or None (the D leg waits at the router).

P is the live prefill instance with the fewest queued prefill tokens; D the live
decode instance with the most free blocks that can hold the whole request
(prompt + ``max_tokens``: a D never preempts), then the fewest running. A D leg
is never sent to a D that cannot hold it.

Push pins D blocks while P computes. ``pin_fraction`` caps the blocks of one D
reserved early and still waiting for their KV; a request past it (D short of
blocks) falls back to late allocation, so a P backlog cannot pin all of D.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

PUSH, LATE, WAIT, REFUSE = "push", "late", "wait", "refuse"


@dataclass
class Load:
    """One instance as the router sees it."""

    engine_id: str
    role: str  # "prefill" | "decode"
    num_blocks: int = 0
    block_size: int = 16
    order: int = 0  # tie-break: the instance's index
    up: bool = True
    queued_tokens: int = 0  # P: prompt tokens of legs sent whose prefill has not finished
    legs: int = 0  # legs sent and not ended
    committed: int = 0  # D: blocks of legs sent and not ended (the D holds or will hold them)
    pinned: int = 0  # D: blocks reserved early (push) whose KV has not arrived yet
    last_pick: int = 0  # when it was last chosen (a sequence number): ties go to the least recent

    @property
    def free(self) -> int:
        return self.num_blocks - self.committed


@dataclass
class Verdict:
    kind: str  # PUSH | LATE | WAIT | REFUSE
    prefill: Optional[str] = None  # engine id
    decode: Optional[str] = None  # engine id (PUSH only: LATE picks D after P)
    status: int = 0  # REFUSE: the HTTP status
    reason: str = ""  # REFUSE, LATE, WAIT: why
    notes: dict = field(default_factory=dict)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def live(loads: Iterable[Load], role: str) -> list[Load]:
    return [l for l in loads if l.role == role and l.up]


def pick_prefill(loads: Iterable[Load]) -> Optional[Load]:
    """The live P with the fewest queued prefill tokens (then fewest legs, then the least
    recently chosen, then index)."""
    ps = live(loads, "prefill")
    return min(ps, key=lambda l: (l.queued_tokens, l.legs, l.last_pick, l.order)) if ps else None


def decode_need(load: Load, tokens: int) -> int:
    return blocks_for(tokens, load.block_size)


def pick_decode(loads: Iterable[Load], tokens: int) -> Optional[Load]:
    """The live D that can hold ``tokens`` (prompt + max_tokens) now with the most free
    blocks left (then fewest legs, then the least recently chosen, then index); None when
    none can."""
    fits = [l for l in live(loads, "decode") if l.free >= decode_need(l, tokens)]
    if not fits:
        return None
    return min(fits, key=lambda l: (-(l.free - decode_need(l, tokens)), l.legs, l.last_pick, l.order))


def place(loads: list[Load], tokens: int, *, mode: str, pin_fraction: float, waiting: int,
          queue_bound: int) -> Verdict:
    """A new request of ``tokens`` (prompt + max_tokens) with ``waiting`` requests already
    queued at the router (they go first: FIFO)."""
    p = pick_prefill(loads)
    ds = live(loads, "decode")
    if p is None or not ds:
        missing = "prefill" if p is None else "decode"
        return Verdict(REFUSE, status=503, reason=f"no live {missing} instance")
    biggest = max(ds, key=lambda l: l.num_blocks)
    need = decode_need(biggest, tokens)
    if need > biggest.num_blocks:
        return Verdict(REFUSE, status=413,
                       reason=f"request needs {need} KV blocks; the decode pool has {biggest.num_blocks}")
    d = pick_decode(loads, tokens) if waiting == 0 else None
    if d is None:
        if waiting >= queue_bound:
            return Verdict(REFUSE, status=429,
                           reason=f"router queue full: {waiting} request(s) waiting for decode blocks "
                                  f"(bound {queue_bound})")
        return Verdict(WAIT, reason="no decode instance can hold the request now")
    if mode != "push":
        return Verdict(LATE, prefill=p.engine_id, reason="pull")
    if d.pinned + decode_need(d, tokens) > pin_fraction * d.num_blocks:
        return Verdict(LATE, prefill=p.engine_id,
                       reason=f"decode short of blocks: {d.pinned} of {d.num_blocks} already wait for KV")
    return Verdict(PUSH, prefill=p.engine_id, decode=d.engine_id)


def place_waiting(loads: list[Load], tokens: int, *, mode: str, pin_fraction: float) -> Verdict:
    """The head of the router's queue, when room may have appeared: as ``place`` with an
    empty queue, but never refused for the queue (it is in it)."""
    return place(loads, tokens, mode=mode, pin_fraction=pin_fraction, waiting=0, queue_bound=1)
