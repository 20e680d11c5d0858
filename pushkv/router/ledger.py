"""What one request's life in the router established: its facts, as the request machine
(``request.Request``) writes them and everyone else reads them (pure, no I/O).

The machine alone writes a ``Ledger``; the shell, the balancer, the HTTP side and the metrics only
read it. Times are the router's monotonic clock, except ``timeline`` (wall seconds, per stage, merged
from every leg) which the response's ``pushkv`` extension and the stage histograms show.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping, Optional

from pushkv import messages as m
from pushkv.kinds import FinishReason, Role

# How a request ended, as /metrics counts it ("" while it runs).
Outcome = Literal["ok", "failed", "aborted", "timeout", "rejected", "shutdown"]
# Which legs served it: push (P and D together), late (push, D after P), pull, decode-local, local.
Path = Literal["push", "late", "pull", "decode-local", "local"]


@dataclass
class Ledger:
    """The facts of one request, from arrival to its end."""

    arrival: float  # monotonic
    prompt_tokens: int = 0
    outcome: Outcome | Literal[""] = ""
    path: Path = "local"
    late: bool = False  # D's leg after P's (pull, or push's late allocation)
    pull: Optional[m.PullParams] = None  # late: P's answer, relayed in D's leg
    # the legs
    engines: dict[Role, str] = field(default_factory=dict)  # leg -> engine id
    sent: set[Role] = field(default_factory=set)  # legs whose Generate went out
    ended: set[Role] = field(default_factory=set)  # legs that answered their last message
    # the tokens
    first_token: Optional[float] = None
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (time, n tokens), as the client got them
    output_ids: list[int] = field(default_factory=list)  # what D streamed (the balancer indexes it)
    kv_seen: bool = False  # D's first message came: its KV is there (or D computed it)
    finish: Optional[float] = None  # the last token, or the stop string that ended the choice
    finish_reason: FinishReason = ""  # D's, once its last token came
    # what the legs reported
    timeline: dict[str, float] = field(default_factory=dict)  # <leg>.<stage> -> wall seconds
    kv: dict[str, m.KVTransferStats] = field(default_factory=dict)  # per leg, as its scheduler measured
    cached: dict[str, int] = field(default_factory=dict)  # leg -> prompt tokens from its prefix cache
    prefill_work: tuple[int, int, int] = (0, 0, 0)  # P's steps for it: steps, tokens, context
    decode_work: tuple[int, int, int, int] = (0, 0, 0, 0)  # D's: steps, seqs, context, prefill tokens

    @property
    def completion_tokens(self) -> int:
        return sum(n for _, n in self.token_times)

    @property
    def emitted(self) -> int:
        """Tokens the client has been given."""
        return self.completion_tokens

    @property
    def done(self) -> bool:
        """D's last token came (the answer is whole)."""
        return bool(self.finish_reason)

    def add_tokens(self, t: float, n: int) -> None:
        if n <= 0:
            return
        if self.first_token is None:
            self.first_token = t
        self.token_times.append((t, n))


def posted_kv(kv: Mapping[str, m.KVTransferStats], path: str,
              pull_read: str = "") -> tuple[Optional[m.KVTransferStats], bool]:
    """A request's KV transfer as the router reports it (its /metrics, its OTLP span): the stats of the leg that
    posted it (P's WRITE in push, the early allocation's or the late one's; D's READ in pull), else any leg's (the
    bytes and descriptors it counted); and whether their ``transfer_s`` times the transfer. Not in pull with
    ``--pull-read write``: P posts that WRITE after its leg has ended, and D, which only counted what landed,
    reports 0 s."""
    poster = "prefill" if path in ("push", "late") else "decode"
    measured = kv.get(poster)
    if measured is None:
        return next(iter(kv.values()), None), False
    return measured, not (path == "pull" and pull_read == "write")
