"""What the protocol state machines ask their actor to do.

The machines return lists of these; the actor (writer) performs them. Frozen
dataclasses, compared by value in tests.

Ownership rule: P's blocks go back to P's allocator only through
:class:`FreeBlocks`, exactly once per accepted prefill half. :class:`Completed`
and :class:`Failed` report the outcome, at most once per (transfer id,
generation); neither implies a free.
"""
from __future__ import annotations

from dataclasses import dataclass

from pushkv.kinds import Rendezvous
from pushkv.messages import Register


class ProtocolError(Exception):
    """A local caller broke the protocol (event illegal in the current state).

    Raised before any state changes, so the machine stays as it was.
    """

    def __init__(self, state: str, event: str, transfer_id: str = "", generation: int = -1):
        self.state = state
        self.event = event
        self.transfer_id = transfer_id
        self.generation = generation
        super().__init__(
            f"event {event!r} is illegal in state {state!r} "
            f"(transfer_id={transfer_id} generation={generation})"
        )


@dataclass(frozen=True)
class PostWrite:
    """P: WRITE these finished blocks into every registered D rank, with a completion notif."""

    transfer_id: str
    generation: int
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    registrations: tuple[Register, ...]  # ascending d_rank
    # streaming push: this WRITE moves prompt tokens [token_start, token_start + num_tokens) of
    # block_ids (the request's whole block list); only the last carries the completion notif
    token_start: int = 0
    last: bool = True
    # layer-streamed push: ``(layer group, first token, end token)`` per group moved, when they
    # differ (then token_start/num_tokens span them all); () = every layer group alike
    spans: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class FreeBlocks:
    """These blocks can go back to their allocator: nothing can still be reading them."""

    transfer_id: str
    generation: int
    block_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class NotifyFailure:
    """P: tell these D ranks to give up on (transfer_id, generation)."""

    transfer_id: str
    generation: int
    registrations: tuple[Register, ...]
    reason: str


@dataclass(frozen=True)
class Completed:
    """P: the WRITE completed. ``order`` is "registration_first" | "prefill_first", "pull" (D's
    READ, under a lease), or "replica" for a rank with nothing to write."""

    transfer_id: str
    generation: int
    order: Rendezvous


@dataclass(frozen=True)
class Failed:
    """The transfer of (transfer_id, generation) failed; the request must fail."""

    transfer_id: str
    generation: int
    reason: str


@dataclass(frozen=True)
class Withdraw:
    """The transfer of (transfer_id, generation) ends, its outcome still to come: its WRITEs not
    yet on the link never go (each then reports failed), one already on it lands or fails."""

    transfer_id: str
    generation: int
    reason: str


@dataclass(frozen=True)
class Received:
    """D: every producer's WRITE landed; the request can decode."""

    transfer_id: str
    generation: int
    first_token: int
    nbytes: int
    num_descs: int


@dataclass(frozen=True)
class Count:
    """Bump counter ``name`` (metrics)."""

    name: str


Action = PostWrite | FreeBlocks | NotifyFailure | Completed | Failed | Withdraw | Received | Count
