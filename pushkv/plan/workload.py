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
from typing import Union


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
    (what ``tools/link_plan.py`` checks the planner's link model against)."""

    starts: tuple[float, ...]
    prompts: tuple[int, ...]
    output: int
    kind: str = "arrivals"

    def __post_init__(self) -> None:
        if len(self.starts) != len(self.prompts):
            raise ValueError(f"arrivals: {len(self.starts)} starts but {len(self.prompts)} prompts")

    def conversations(self) -> list[list[Turn]]:
        pairs = enumerate(zip(self.starts, self.prompts))
        return [[Turn(i, 1, n, self.output, 0, 0, start_s=t)] for i, (t, n) in pairs]


Workload = Union[Poisson, Chat, Recorded, Arrivals]


def from_dict(d: dict) -> Workload:
    """A workload from JSON: {"kind": "poisson", "qps": 8, "requests": 200, "prompt": [16384, 16384],
    "output": 256, "reuse": 0}, {"kind": "chat", "rate": 4, "conversations": 16, "turns": [2, 4],
    "system": 1024, "user": [32, 128], "output": 32, "think_s": 0.2} or {"kind": "arrivals", "starts":
    [0.0, 0.31], "prompts": [1024, 4096], "output": 16}."""
    d = dict(d)
    kind = d.pop("kind", "poisson")
    if kind == "poisson":
        return Poisson(float(d["qps"]), int(d["requests"]), tuple(d["prompt"]), int(d["output"]),
                       float(d.get("reuse", 0.0)), int(d.get("seed", 0)))
    if kind == "chat":
        return Chat(float(d["rate"]), int(d["conversations"]), tuple(d["turns"]), int(d["system"]),
                    tuple(d["user"]), int(d["output"]), float(d.get("think_s", 0.0)), int(d.get("seed", 0)))
    if kind == "arrivals":
        return Arrivals(tuple(float(t) for t in d["starts"]), tuple(int(n) for n in d["prompts"]), int(d["output"]))
    raise ValueError(f"unknown workload kind {kind!r} (poisson | chat | arrivals)")
