"""Workloads the planner simulates: what arrives, when, how long, and what it repeats.

Pure and seeded. Two kinds:

- ``Poisson``: independent requests at ``qps``, prompt lengths uniform in a range, a fixed
  output length, and ``reuse``: the share of every prompt that is a prefix all requests
  share (a system prompt), so any instance that has seen one holds it;
- ``Chat``: multi-turn conversations as ``pushkv bench --workload chat`` sends them: Poisson
  starts, a shared system prompt, 2-8 turns whose prompt is the previous turn's prompt and
  answer plus a new user message, a think pause between an answer and the next turn.

A workload yields ``Turn``s; a conversation's next turn is released by the simulator when the
previous one has finished (its arrival depends on the deployment's latency).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Union


@dataclass
class Turn:
    conv: int  # conversation (Poisson: the request's own index)
    index: int  # 1-based turn
    prompt: int  # tokens
    output: int  # tokens
    shared: int  # leading prompt tokens every conversation shares (system prompt / Poisson reuse)
    history: int  # leading prompt tokens that are the previous turn's prompt and answer
    start_s: float = 0.0  # conversation start (turn 1's arrival)
    think_s: float = 0.0  # pause after the previous turn's answer
    # replaying a measured run (Arrivals): P's prefill as it ran, its start and end in ms after the
    # arrival (None: P's queue and the profile's cost), and what D spent from the KV landing to the
    # first token leaving the router
    prefill_span_ms: Optional[tuple[float, float]] = None
    land_ms: float = 0.0
    # leading prompt tokens every instance already holds when the turn arrives (a replayed run whose
    # prompts share a prefix with an earlier run's: that much is neither computed nor moved)
    cached: int = 0


@dataclass(frozen=True)
class Poisson:
    qps: float
    requests: int
    prompt: tuple[int, int]  # min, max tokens (uniform)
    output: int
    reuse: float = 0.0  # share of each prompt all requests share
    seed: int = 0
    kind: str = "poisson"

    def conversations(self) -> list[list[Turn]]:
        r = random.Random(self.seed)
        t, out = 0.0, []
        for i in range(self.requests):
            t += r.expovariate(self.qps)
            n = r.randint(*self.prompt)
            out.append([Turn(i, 1, n, self.output, int(n * self.reuse), 0, start_s=t)])
        return out


@dataclass(frozen=True)
class Chat:
    rate: float  # conversations started per second
    conversations_n: int
    turns: tuple[int, int]
    system: int
    user: tuple[int, int]
    output: int
    think_s: float
    seed: int = 0
    kind: str = "chat"

    def conversations(self) -> list[list[Turn]]:
        r = random.Random(self.seed)
        t, out = 0.0, []
        for c in range(self.conversations_n):
            t += r.expovariate(self.rate)
            turns, prompt = [], self.system
            for k in range(1, r.randint(*self.turns) + 1):
                history = prompt + self.output if k > 1 else 0
                prompt = (history if k > 1 else self.system) + r.randint(*self.user)
                think = r.expovariate(1.0 / self.think_s) if self.think_s > 0 and k > 1 else 0.0
                turns.append(Turn(c, k, prompt, self.output, self.system, history, start_s=t, think_s=think))
            out.append(turns)
        return out


@dataclass(frozen=True)
class Recorded:
    """Conversations exactly as a bench sent them: each one's start, its user turns' lengths and
    the pause after each answer (what ``pushkv chat-sweep`` checks the planner against)."""

    system: int
    output: int
    starts: tuple[float, ...]
    users: tuple[tuple[int, ...], ...]
    thinks: tuple[tuple[float, ...], ...]
    kind: str = "recorded"

    def conversations(self) -> list[list[Turn]]:
        out = []
        for c, (t, users, thinks) in enumerate(zip(self.starts, self.users, self.thinks)):
            turns, prompt = [], self.system
            for k, user in enumerate(users, start=1):
                history = prompt + self.output if k > 1 else 0
                prompt = (history if k > 1 else self.system) + user
                turns.append(Turn(c, k, prompt, self.output, self.system, history, start_s=t,
                                  think_s=thinks[k - 2] if k > 1 else 0.0))
            out.append(turns)
        return out


@dataclass(frozen=True)
class Arrivals:
    """Independent requests exactly as a bench sent them: each one's arrival (s) and prompt length
    (what ``tools/link_plan.py`` checks the planner's link model against); optionally each one's
    prefill (its start and end, ms after its arrival) and D's time from the KV to the first token
    (ms) as that run measured them, so that only the link and its queues are predicted, and the
    leading tokens of each prompt that P and D already held when it arrived (``cached``)."""

    starts: tuple[float, ...]
    prompts: tuple[int, ...]
    output: int
    prefills_ms: tuple[tuple[float, float], ...] = ()
    lands_ms: tuple[float, ...] = ()
    cached: tuple[int, ...] = ()
    kind: str = "arrivals"

    def __post_init__(self) -> None:
        n = len(self.starts)
        if len(self.prompts) != n or any(len(x) not in (0, n) for x in (self.prefills_ms, self.lands_ms, self.cached)):
            raise ValueError(f"arrivals: {n} starts but {len(self.prompts)} prompts, {len(self.prefills_ms)} "
                             f"prefills, {len(self.lands_ms)} landings and {len(self.cached)} cached prefixes "
                             f"(give each per request, or none)")
        if any(not 0 <= a <= b for a, b in self.prefills_ms):
            raise ValueError("arrivals: a prefill is (start, end) in ms after its arrival, 0 <= start <= end")
        if any(not 0 <= c <= p for c, p in zip(self.cached, self.prompts)):
            raise ValueError("arrivals: a cached prefix is 0 to the prompt's length")

    def conversations(self) -> list[list[Turn]]:
        pre: tuple = self.prefills_ms or (None,) * len(self.starts)
        land = self.lands_ms or (0.0,) * len(self.starts)
        cached = self.cached or (0,) * len(self.starts)
        rows = enumerate(zip(self.starts, self.prompts, pre, land, cached))
        return [[Turn(i, 1, n, self.output, 0, 0, start_s=t, prefill_span_ms=p, land_ms=d, cached=c)]
                for i, (t, n, p, d, c) in rows]


Workload = Union[Poisson, Chat, Recorded, Arrivals]


def from_dict(d: dict) -> Workload:
    """A workload from JSON: {"kind": "poisson", "qps": 8, "requests": 200, "prompt": [16384, 16384],
    "output": 256, "reuse": 0}, {"kind": "chat", "rate": 4, "conversations": 16, "turns": [2, 4],
    "system": 1024, "user": [32, 128], "output": 32, "think_s": 0.2} or {"kind": "arrivals", "starts":
    [0.0, 0.31], "prompts": [1024, 4096], "output": 16, "prefills_ms": [[1, 90], [2, 400]] (optional)}."""
    d = dict(d)
    kind = d.pop("kind", "poisson")
    if kind == "poisson":
        return Poisson(float(d["qps"]), int(d["requests"]), tuple(d["prompt"]), int(d["output"]),
                       float(d.get("reuse", 0.0)), int(d.get("seed", 0)))
    if kind == "chat":
        return Chat(float(d["rate"]), int(d["conversations"]), tuple(d["turns"]), int(d["system"]),
                    tuple(d["user"]), int(d["output"]), float(d.get("think_s", 0.0)), int(d.get("seed", 0)))
    if kind == "arrivals":
        def floats(key: str) -> tuple[float, ...]:
            return tuple(float(x) for x in d.get(key, ()))

        spans = tuple((float(a), float(b)) for a, b in d.get("prefills_ms", ()))
        return Arrivals(floats("starts"), tuple(int(n) for n in d["prompts"]), int(d["output"]), spans,
                        floats("lands_ms"), tuple(int(c) for c in d.get("cached", ())))
    raise ValueError(f"unknown workload kind {kind!r} (poisson | chat | arrivals)")
