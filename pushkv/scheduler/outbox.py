"""What the scheduler core asks its shell to do, in the order it asked (sans-I/O).

The core never sends: each entry point appends effects to ``SchedulerCore.outbox`` and the shell
(``pushkv.scheduler.shell``) drains them in order. A ``Peer`` names both ends of the
scheduler's channels: where a message came from, and where one goes.
"""
from __future__ import annotations

from typing import Literal, NamedTuple, Union

from pushkv import messages as m

PeerKind = Literal["router", "worker", "writer"]


class Peer(NamedTuple):
    """The router (by the ROUTER-socket identity of the one that asked), or a worker or writer rank."""

    kind: PeerKind
    rank: int = 0  # worker / writer: its TP rank
    identity: bytes = b""  # router: the identity frame a reply is routed by

    @classmethod
    def router(cls, identity: bytes) -> "Peer":
        return cls("router", identity=identity)

    def __str__(self) -> str:
        return "router" if self.kind == "router" else f"{self.kind}-{self.rank}"


class Send(NamedTuple):
    """Send ``msg`` to ``to``."""

    to: Peer
    msg: m.Msg


class Trace(NamedTuple):
    """A request-scoped event for the trace (``--trace``), e.g. ``prefill_start``."""

    kind: str
    transfer_id: str


class Kill(NamedTuple):
    """A test's fault point was armed here: once what precedes it is sent, the process dies
    (``pushkv.faults``); nothing after it leaves."""

    point: str


class CompileGrammar(NamedTuple):
    """Compile ``spec``'s grammar off the loop (``grammar.CompileThreads``) and hand its end to the core
    (``SchedulerCore.compiled``); the requests that asked for it wait meanwhile."""

    spec: m.Structured


class CancelCompile(NamedTuple):
    """The last request waiting for ``spec``'s compile has gone: a compile of it still queued on the threads is
    dropped (one under way ends, and its grammar is kept for the next request of the spec)."""

    spec: m.Structured


Effect = Union[Send, Trace, Kill, CompileGrammar, CancelCompile]
