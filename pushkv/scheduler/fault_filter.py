"""The scheduler's fault points for tests (``pushkv.faults``), as a filter on its core's effects.

The core holds no test hook: it never asks whether a point is armed. A shell started with faults
passes each batch of effects through ``FaultFilter``, which finds the effect that marks a point and,
if the test armed that point, puts a ``Kill`` right after it and drops what follows (the process
dies there; nothing after it leaves):

- ``after_alloc``: the request's blocks are reserved (the ``<role>_alloc`` stamp);
- ``prefill_done``: P's prefill ended, before the KV is handed over (P's ``prefill_end`` stamp);
- ``decoding``: a request's third token is sent, not its last (D and local: one token a message).

A shell without faults has no filter.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional, Protocol

from pushkv import messages as m
from pushkv.kinds import Role
from pushkv.scheduler.outbox import Effect, Kill, Send, Trace

DECODING_AT_TOKEN = 3
TRACKED_MAX = 4096  # requests whose tokens are counted (a failed one never sends its last)


class Armed(Protocol):
    def armed(self, name: str) -> bool: ...


class FaultFilter:
    def __init__(self, faults: Armed, role: Role):
        self.faults = faults
        self.stamps = {f"{role}_alloc": "after_alloc"}
        if role == "prefill":
            self.stamps["prefill_end"] = "prefill_done"
        self.counts_tokens = role != "prefill"  # P sends a first token only, outside the decode loop
        self.tokens: OrderedDict[tuple[str, int], int] = OrderedDict()

    def __call__(self, effects: Iterable[Effect]) -> list[Effect]:
        out: list[Effect] = []
        for effect in effects:
            out.append(effect)
            point = self._point(effect)
            if point is not None and self.faults.armed(point):
                out.append(Kill(point))
                break
        return out

    def _point(self, effect: Effect) -> Optional[str]:
        if isinstance(effect, Trace):
            return self.stamps.get(effect.kind)
        if self.counts_tokens and isinstance(effect, Send) and isinstance(effect.msg, m.TokensGenerated):
            key = (effect.msg.transfer_id, effect.msg.generation)
            if effect.msg.finished:
                self.tokens.pop(key, None)
                return None
            n = self.tokens.pop(key, 0) + 1
            self.tokens[key] = n
            while len(self.tokens) > TRACKED_MAX:
                self.tokens.popitem(last=False)
            return "decoding" if n == DECODING_AT_TOKEN else None
        return None
