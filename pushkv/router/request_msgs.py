"""The request machine's vocabulary (``request.Request``): the inputs the router makes for it
(the schedulers' messages are its other inputs) and the actions it answers. Pure data."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from pushkv import messages as m
from pushkv.kinds import FinishReason, Role
from pushkv.router import policy as P
from pushkv.router.ledger import Outcome

Source = Role | Literal["router"]  # where a request's input comes from: a leg's scheduler, or the router


# ---------------------------------------------------------------------------
# Inputs the router makes (the schedulers' messages are the others)
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    """Send the legs, or ask the balancer where to."""


@dataclass(frozen=True)
class Placed:
    """The balancer's placement: go, with this verdict (PUSH, LATE or DECODE_LOCAL)."""

    verdict: P.Verdict
    source: Optional[m.PrefillSource] = None  # PUSH: where D's leg takes the KV from


@dataclass(frozen=True)
class Queued:
    """The balancer holds the request until a D can hold it (``Placed`` comes later)."""


@dataclass(frozen=True)
class DecodePlaced:
    """Late: the balancer's D for the request whose prefill is done."""

    engine_id: str


@dataclass(frozen=True)
class DecodeQueued:
    """Late: the prefill is done and no D can hold it yet (``DecodePlaced`` comes later)."""


@dataclass(frozen=True)
class Rejected:
    """The balancer refused to place it (429 queue full, 503 no instance, 413 too large)."""

    status: int
    reason: str


@dataclass(frozen=True)
class SendFailed:
    """A link refused a ``Generate``; ``unsent``: legs of the same batch never tried."""

    leg: Role
    error: str
    unsent: tuple[Role, ...] = ()


@dataclass(frozen=True)
class Cancel:
    """From outside the request: the abort endpoint (499, "aborted"), the router's shutdown (503, "shutdown") or
    an instance that held one of its legs down (503, "failed": the outcome /metrics counts)."""

    status: int
    reason: str
    outcome: Outcome = "aborted"


@dataclass(frozen=True)
class Tick:
    """The armed deadline may be due; ``now`` says whether it is."""


@dataclass(frozen=True)
class Stopped:
    """The client side found a stop string: the choice is complete now (``Close`` follows)."""


@dataclass(frozen=True)
class Shown:
    """The handler gave the client its choice's end (it applied the choice's ``Finished``): ``finish`` is how the
    choice ended there ("stop" where a stop string matched only as the text was flushed)."""

    finish: str


@dataclass(frozen=True)
class Close:
    """The handler is done with the request, whatever the reason: release it, abort open legs.

    A request that has not ended yet ends with ``outcome`` (the client went away, or a sibling
    choice was refused or failed); ``reason`` goes in the aborts (default: said from the outcome)."""

    reason: str = ""
    outcome: Outcome = "aborted"


# ---------------------------------------------------------------------------
# Actions
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Send:
    leg: Role
    engine_id: str
    msg: Union[m.Generate, m.Abort, m.ChoiceEnded]


@dataclass(frozen=True)
class Tokens:
    token_ids: tuple[int, ...]
    logprobs: tuple[m.TokenLogprob, ...] = ()  # one per token id when the request asked
    prompt_logprobs: Optional[m.PromptLogprobs] = None  # with the first tokens, when the request asked
    # the run's last tokens, its Finished right behind them (a stream gives them its finish_reason in one chunk, as
    # vLLM's); not where the Finished waits (push: D done before P's report), so they are not held for it
    last: bool = False


@dataclass(frozen=True)
class Finished:
    finish_reason: FinishReason


@dataclass(frozen=True)
class Failed:
    status: int
    reason: str
    outcome: Outcome = "failed"


@dataclass(frozen=True)
class Place:
    """Ask the balancer for a P and a D: answered by ``Placed``, ``Queued`` or ``Rejected``."""


@dataclass(frozen=True)
class PlaceDecode:
    """Late: ask the balancer for a D: answered by ``DecodePlaced`` or ``DecodeQueued``."""


@dataclass(frozen=True)
class PrefillDone:
    """Tell the balancer: P's work for it is over."""


@dataclass(frozen=True)
class KVArrived:
    """Tell the balancer: D's first token came, so its KV is there."""


@dataclass(frozen=True)
class Release:
    """Tell the balancer: the request holds nothing any more."""


@dataclass(frozen=True)
class Arm:
    at: float  # monotonic seconds: send a ``Tick`` then


@dataclass(frozen=True)
class Disarm:
    """No deadline any more."""


Event = Union[Tokens, Finished, Failed]  # what the client sees
Action = Union[Send, Tokens, Finished, Failed, Place, PlaceDecode, PrefillDone, KVArrived, Release, Arm, Disarm]
