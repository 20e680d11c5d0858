"""One request's life in the router, as a pure state machine (no asyncio, no zmq, no clock).

``Request.on(msg, now, leg)`` takes one input and returns the actions it calls for; the
asyncio shell (``flow.RequestRun``) feeds it what the schedulers send, what the balancer
answers and the deadline's ticks, and carries the actions out. ``now`` is the router's
monotonic clock; the timeline's wall times are ``now`` plus an offset fixed at arrival.

Inputs, one handler each (``Request.HANDLERS``, keyed by type):

- ``Start``; the balancer's answers ``Placed`` / ``Queued`` / ``Rejected`` and, for a late D leg,
  ``DecodePlaced`` / ``DecodeQueued``; ``SendFailed`` when a link refused a ``Generate``.
- the schedulers' ``TokensGenerated``, ``PrefillFinished``, ``RequestFailed`` (``leg`` says whose).
- ``Cancel`` (abort endpoint, shutdown, an instance down), ``Tick`` (the armed deadline is due),
  ``Stopped`` (a stop string ended the choice), ``Close`` (the handler is done: release, abort what is open).

Actions: ``Send`` (a ``Generate`` or an ``Abort`` to a leg's instance), ``Tokens`` / ``Finished`` /
``Failed`` for the client (exactly one of the last two, once), ``Place`` / ``PlaceDecode`` (ask the
balancer; its answer comes back as an input), ``PrefillDone`` / ``KVArrived`` / ``Release`` (tell
it), ``Arm`` / ``Disarm`` (the one deadline).

Legs per path:

- local: ``Generate(leg="local")``; tokens from the local scheduler.
- push: P leg (``max_tokens=1``) and D leg (``source=P``) together; tokens from D; D done first, the
  request waits ``PREFILL_REPORT_GRACE_S`` for P's ``PrefillFinished`` (informative).
- pull, and push's late allocation: P leg first; its ``PrefillFinished.pull`` is relayed in D's leg.
- decode-local (conditional disaggregation): one D leg with ``prefill_here``; D prefills and decodes.
"""
from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional, Union

import msgspec

from pushkv import messages as m
from pushkv.config import Role
from pushkv.router import policy as P
from pushkv.router.balance import DecodePlaced, Placed
from pushkv.router.metrics import RequestRecord

log = logging.getLogger(__name__)

# Every leg this router sends is generation 0: nothing reissues a request today (no preemption,
# no retry). Schedulers and writers still match the two halves by (transfer id, generation) and
# let a higher generation supersede a lower one, so a retry would send generation + 1.
GENERATION = 0
PREFILL_REPORT_GRACE_S = 1.0  # push: D done, wait this long for P's timeline
ROUTER = "router"  # the leg of inputs the router makes itself


# ---------------------------------------------------------------------------
# Inputs the router makes (the schedulers' messages are the others)
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    """Send the legs, or ask the balancer where to."""


@dataclass(frozen=True)
class Queued:
    """The balancer holds the request until a D can hold it (``Placed`` comes later)."""


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

    leg: str
    error: str
    unsent: tuple[str, ...] = ()


@dataclass(frozen=True)
class Cancel:
    """From outside the request: the abort endpoint (499), shutdown or an instance down (503)."""

    status: int
    reason: str


@dataclass(frozen=True)
class Tick:
    """The armed deadline may be due; ``now`` says whether it is."""


@dataclass(frozen=True)
class Stopped:
    """The client side found a stop string: the choice is complete now (``Close`` follows)."""


@dataclass(frozen=True)
class Close:
    """The handler is done with the request, whatever the reason: release it, abort open legs."""

    reason: str


# ---------------------------------------------------------------------------
# Actions
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Send:
    leg: str
    engine_id: str
    msg: Union[m.Generate, m.Abort]


@dataclass(frozen=True)
class Tokens:
    token_ids: tuple[int, ...]
    logprobs: tuple[m.TokenLogprob, ...] = ()  # one per token id when the request asked


@dataclass(frozen=True)
class Finished:
    finish_reason: str


@dataclass(frozen=True)
class Failed:
    status: int
    reason: str
    outcome: str = "failed"  # the request record's outcome


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


class Phase(enum.Enum):
    NEW = "new"
    PLACING = "placing"  # asked the balancer, its answer comes next
    QUEUED = "queued"  # waiting at the balancer for a first placement
    RUNNING = "running"
    FINISHING = "finishing"  # push: D's last token came, P has not reported yet
    DONE = "done"  # Finished or Failed went out


@dataclass
class Request:
    """One choice of one HTTP request, from ``Start`` to ``Close``."""

    mode: str  # the deployment's: local | push | pull
    transfer_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    stop: tuple[int, ...]
    record: RequestRecord  # monotonic times and the outcome, filled in here
    request_s: float  # the request's deadline, from its arrival
    wall_offset: float = 0.0  # wall clock minus monotonic clock
    arrival_wall: Optional[float] = None  # when the router made it (wall); default: the record's arrival
    sampling: Optional[m.SamplingParams] = None  # None: plain greedy, fewer bytes per step
    local_engine: str = "local"  # local mode: the instance's engine id

    phase: Phase = Phase.NEW
    closed: bool = False
    path: str = ""  # push | late | pull | decode-local | local
    late: bool = False  # D's leg after P's (pull, or push's late allocation)
    pull: Optional[m.PullParams] = None  # late: P's answer, relayed in D's leg
    engines: dict[str, str] = field(default_factory=dict)  # leg -> engine id
    sent: set[str] = field(default_factory=set)  # legs whose Generate went out
    ended: set[str] = field(default_factory=set)  # legs that answered their last message
    deadline: float = math.inf
    finish_reason: str = ""
    kv_seen: bool = False
    # disaggregated: P drew the first token, so its logprob comes from P; D's first
    # TokensGenerated waits in ``held`` for it when the request asked for logprobs
    first_logprob: Optional[m.TokenLogprob] = None
    held: list[m.TokensGenerated] = field(default_factory=list)
    emitted: int = 0
    output_ids: list[int] = field(default_factory=list)  # what D streamed (the balancer indexes it)
    done: bool = False  # D's last token came
    timeline: dict[str, float] = field(default_factory=dict)
    kv: dict[str, m.KVTransferStats] = field(default_factory=dict)  # per leg, as its scheduler measured
    cached: dict[str, int] = field(default_factory=dict)  # leg -> prompt tokens from its prefix cache
    prefill_work: tuple[int, int, int] = (0, 0, 0)  # P's steps for it: steps, tokens, context
    decode_work: tuple[int, int, int, int] = (0, 0, 0, 0)  # D's: steps, seqs, context, prefill tokens
    hash_cache: dict[int, list[int]] = field(default_factory=dict)  # block size -> prompt block hashes

    def __post_init__(self) -> None:
        self.late = self.mode == "pull"
        self.path = self.mode
        if self.arrival_wall is None:
            self.arrival_wall = self.record.arrival + self.wall_offset
        self.timeline["router.arrival"] = self.arrival_wall

    # -- what others read --------------------------------------------------------
    @property
    def decode_tokens(self) -> int:
        """What D must hold for the whole request (no preemption)."""
        return len(self.prompt) + self.max_tokens

    @property
    def token_leg(self) -> str:  # the leg whose tokens the client gets
        return "local" if self.mode == "local" else "decode"

    @property
    def over(self) -> bool:
        return self.phase is Phase.DONE

    def holds(self, role: str, engine_id: str) -> bool:
        """Whether an instance going down fails this request: it has a leg open there, or it is
        the P that holds the KV a late D still needs."""
        if self.engines.get(role) != engine_id:
            return False
        return ((role in self.sent and role not in self.ended)
                or (role == "prefill" and self.late and self.emitted == 0))

    def mark(self, stage: str, now: float) -> None:
        self.timeline.setdefault(stage, now + self.wall_offset)

    # -- the one entry ----------------------------------------------------------------
    def on(self, msg: object, now: float, leg: str = ROUTER) -> list[Action]:
        """The actions ``msg`` (from ``leg``) calls for at ``now``. Nothing but ``Close`` acts on a
        request that is over (it emitted its end, or was closed): a late or duplicate message is dropped."""
        handler = self.HANDLERS.get(type(msg))
        if handler is None:
            log.error("unexpected %s from %s transfer_id=%s", type(msg).__name__, leg, self.transfer_id)
            return []
        if self.over and not isinstance(msg, Close):
            log.debug("%s from %s after the end transfer_id=%s", type(msg).__name__, leg, self.transfer_id)
            return []
        return handler(self, msg, now, leg)

    # -- placing and sending --------------------------------------------------------------
    def _generate(self, leg: Role, max_tokens: int, **kw) -> m.Generate:
        return m.Generate(
            transfer_id=self.transfer_id, generation=GENERATION, leg=leg, prompt_token_ids=self.prompt,
            max_tokens=max_tokens, stop_token_ids=self.stop, arrival=self.timeline["router.arrival"],
            sampling=self.sampling, **kw,
        )

    def _send(self, leg: str, engine_id: str, msg: m.Generate, now: float) -> Send:
        self.engines[leg] = engine_id
        self.sent.add(leg)
        self.mark(f"router.send_{leg}", now)
        log.debug("send %s leg to %s transfer_id=%s", leg, engine_id, self.transfer_id)
        return Send(leg, engine_id, msg)

    def _on_start(self, msg: Start, now: float, leg: str) -> list[Action]:
        if self.phase is not Phase.NEW:
            raise ValueError(f"Start in phase {self.phase.value} transfer_id={self.transfer_id}")
        self.deadline = self.record.arrival + self.request_s
        arm: list[Action] = [Arm(self.deadline)]
        if self.mode == "local":
            self.phase = Phase.RUNNING
            return arm + [self._send("local", self.local_engine, self._generate("local", self.max_tokens), now)]
        if self.mode not in ("push", "pull"):
            raise ValueError(f"unknown mode {self.mode!r}")
        self.phase = Phase.PLACING
        return arm + [Place()]

    def _on_queued(self, msg: Queued, now: float, leg: str) -> list[Action]:
        self.phase = Phase.QUEUED
        self.mark("router.queued", now)
        return []

    def _on_placed(self, msg: Placed, now: float, leg: str) -> list[Action]:
        if self.phase not in (Phase.PLACING, Phase.QUEUED):
            log.error("placed twice (phase %s) transfer_id=%s", self.phase.value, self.transfer_id)
            return []
        if self.phase is Phase.QUEUED:
            self.mark("router.placed", now)
        self.phase = Phase.RUNNING
        v = msg.verdict
        p, d = v.prefill or "", v.decode or ""  # the verdict's kind says which it names
        if v.kind == P.DECODE_LOCAL:
            self.path = v.kind
            log.debug("decode-local transfer_id=%s: %s", self.transfer_id, v.reason)
            return [self._send("decode", d, self._generate("decode", self.max_tokens, prefill_here=True), now)]
        if v.kind == P.LATE:
            self.late = True
            if self.mode == "push":
                self.path = "late"
                self.mark("router.late_allocation", now)
                log.info("late allocation transfer_id=%s: %s", self.transfer_id, v.reason)
            return [self._send("prefill", p, self._generate("prefill", 1, late=self.mode == "push"), now)]
        # both legs leave together: D reserves and registers while P computes
        return [self._send("prefill", p, self._generate("prefill", 1), now),
                self._send("decode", d, self._generate("decode", self.max_tokens, source=msg.source), now)]

    def _on_decode_queued(self, msg: DecodeQueued, now: float, leg: str) -> list[Action]:
        self.mark("router.decode_queued", now)  # no D can hold it now: it waits at the router, never at a full D
        return []

    def _on_decode_placed(self, msg: DecodePlaced, now: float, leg: str) -> list[Action]:
        assert self.pull is not None, "a D placed for a late request before its prefill finished"
        gen = self._generate("decode", self.max_tokens, source=self.pull.source, pull=self.pull)
        return [self._send("decode", msg.engine_id, gen, now)]

    # -- the end, every way it comes ------------------------------------------------------------
    def _finish(self) -> list[Action]:
        self.phase = Phase.DONE
        self.record.outcome = "ok"
        return [Finished(self.finish_reason), Disarm()]

    def _fail(self, status: int, reason: str, outcome: str = "failed") -> list[Action]:
        """Every refusal and failure of the request ends here."""
        self.phase = Phase.DONE
        self.record.outcome = outcome
        return [Failed(status, reason, outcome), Disarm()]

    def _on_rejected(self, msg: Rejected, now: float, leg: str) -> list[Action]:
        log.info("refused transfer_id=%s status=%d: %s", self.transfer_id, msg.status, msg.reason)
        return self._fail(msg.status, msg.reason, "rejected")

    def _on_send_failed(self, msg: SendFailed, now: float, leg: str) -> list[Action]:
        self.sent.difference_update(msg.unsent)
        log.error("sending %s leg failed transfer_id=%s: %s", msg.leg, self.transfer_id, msg.error)
        late_decode = msg.leg == "decode" and self.pull is not None
        return self._fail(503, f"{'decode ' if late_decode else ''}scheduler unreachable: {msg.error}")

    def _on_request_failed(self, msg: m.RequestFailed, now: float, leg: str) -> list[Action]:
        self.ended.add(leg)
        if self.phase is Phase.FINISHING:  # the client already has every token
            log.warning("leg %s failed after completion transfer_id=%s: %s", leg, self.transfer_id, msg.reason)
            return self._finish()
        log.info("leg %s failed transfer_id=%s status=%d: %s", leg, self.transfer_id, msg.status, msg.reason)
        return self._fail(msg.status, f"{leg}: {msg.reason}")

    def _on_cancel(self, msg: Cancel, now: float, leg: str) -> list[Action]:
        if self.phase is Phase.FINISHING:
            return self._finish()
        log.info("cancelled transfer_id=%s status=%d: %s", self.transfer_id, msg.status, msg.reason)
        return self._fail(msg.status, msg.reason, "shutdown" if msg.status == 503 else "aborted")

    def _on_tick(self, msg: Tick, now: float, leg: str) -> list[Action]:
        if now < self.deadline:
            return []
        if self.phase is Phase.FINISHING:  # P never reported: the answer is complete without it
            return self._finish()
        return self._fail(504, f"request exceeded {self.request_s:g} s", "timeout")

    def _on_close(self, msg: Close, now: float, leg: str) -> list[Action]:
        if self.closed:
            return []
        self.closed = True
        self.phase = Phase.DONE  # the client is gone or has its answer: nothing is emitted any more
        out: list[Action] = [Disarm()]
        if self.mode != "local":
            out.append(Release())
        for open_leg in sorted(self.sent - self.ended):
            out.append(Send(open_leg, self.engines[open_leg], m.Abort(self.transfer_id, GENERATION, msg.reason)))
        return out

    # -- what the legs report ------------------------------------------------------------------------
    def merge(self, leg: str, pairs) -> None:
        for stage, t in pairs:
            self.timeline.setdefault(f"{leg}.{stage}", float(t))

    def _on_prefill_finished(self, msg: m.PrefillFinished, now: float, leg: str) -> list[Action]:
        self.ended.add(leg)
        self.mark("router.prefill_finished", now)
        self.merge(leg, msg.timeline)
        self.cached[leg] = msg.cached_tokens
        self.prefill_work = (msg.prefill_steps, msg.prefill_step_tokens, msg.prefill_step_context)
        if msg.kv is not None:
            self.kv[leg] = msg.kv
        out: list[Action] = [PrefillDone()]
        if self.phase is Phase.FINISHING:
            return out + self._finish()
        if self.late and "decode" not in self.sent and self.pull is None:
            if msg.pull is None:
                return out + self._fail(502, "prefill finished without pull parameters")
            self.pull = msg.pull
            out.append(PlaceDecode())
        return out

    def _needs_first_logprob(self, msg: m.TokensGenerated) -> bool:
        return (self.sampling is not None and self.sampling.logprobs >= 0 and "prefill" in self.sent
                and self.emitted == 0 and bool(msg.token_ids) and len(msg.logprobs) < len(msg.token_ids))

    def _on_tokens(self, msg: m.TokensGenerated, now: float, leg: str) -> list[Action]:
        if leg != self.token_leg:  # P's own sampled token: D re-emits it, we keep its logprob
            self.merge(leg, msg.timeline)
            if not (msg.logprobs and self.first_logprob is None):
                return []
            self.first_logprob = msg.logprobs[0]
            held, self.held = self.held, []
            out: list[Action] = []
            for h in held:  # D's tokens that waited for it, in order
                out += self.on(h, now, self.token_leg)
            return out
        if self.done:  # a duplicate of D's last message
            log.warning("tokens after the last from %s transfer_id=%s", leg, self.transfer_id)
            return []
        if self.held or (self._needs_first_logprob(msg) and self.first_logprob is None):
            self.held.append(msg)  # in order, behind the first token
            return []
        out = []
        if not self.kv_seen and self.mode != "local":  # D's first token: its KV is here
            self.kv_seen = True
            out.append(KVArrived())
        if self._needs_first_logprob(msg):
            assert self.first_logprob is not None
            msg = msgspec.structs.replace(msg, logprobs=(self.first_logprob,) + msg.logprobs)
        self.emitted += len(msg.token_ids)
        self.output_ids.extend(msg.token_ids)
        if msg.token_ids:
            if self.record.first_token is None:
                self.mark("router.first_token", now)
            self.record.add_tokens(now, len(msg.token_ids))
            out.append(Tokens(tuple(msg.token_ids), tuple(msg.logprobs)))
        if msg.finished:
            out += self._last_tokens(msg, now, leg)
        return out

    def _last_tokens(self, msg: m.TokensGenerated, now: float, leg: str) -> list[Action]:
        self.ended.add(leg)
        self.done = True
        self.cached[leg] = msg.cached_tokens
        self.decode_work = (msg.decode_steps, msg.decode_seqs, msg.decode_context, msg.decode_prefill_tokens)
        self.merge(leg, msg.timeline)
        if msg.kv is not None:
            self.kv[leg] = msg.kv
        self.record.finish = now
        self.mark("router.finish", now)
        self.finish_reason = msg.finish_reason or "length"
        if self.mode != "push" or "prefill" not in self.sent or "prefill" in self.ended:
            return self._finish()
        # push: D finished before P reported; wait briefly for P's timeline
        self.phase = Phase.FINISHING
        self.deadline = min(self.deadline, now + PREFILL_REPORT_GRACE_S)
        return [Arm(self.deadline)]

    def _on_stopped(self, msg: Stopped, now: float, leg: str) -> list[Action]:
        self.record.outcome = "ok"
        self.record.finish = now
        self.mark("router.finish", now)
        self.phase = Phase.DONE
        return [Disarm()]

    HANDLERS: ClassVar[dict[type, Callable[..., list[Action]]]] = {}  # input type -> its handler


Request.HANDLERS.update({
    Start: Request._on_start,
    Placed: Request._on_placed,
    Queued: Request._on_queued,
    Rejected: Request._on_rejected,
    DecodePlaced: Request._on_decode_placed,
    DecodeQueued: Request._on_decode_queued,
    SendFailed: Request._on_send_failed,
    m.TokensGenerated: Request._on_tokens,
    m.PrefillFinished: Request._on_prefill_finished,
    m.RequestFailed: Request._on_request_failed,
    Cancel: Request._on_cancel,
    Tick: Request._on_tick,
    Stopped: Request._on_stopped,
    Close: Request._on_close,
})
