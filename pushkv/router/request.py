"""One request's life in the router, as a pure state machine (no asyncio, no zmq, no clock).

``Request.on(msg, now, leg)`` takes one input and returns the actions it calls for; the
asyncio shell (``flow.RequestRun``) feeds it what the schedulers send, what the balancer
answers and the deadline's ticks, and carries the actions out. ``now`` is the router's
monotonic clock; the timeline's wall times are ``now`` plus an offset fixed at arrival.

A request is what was asked (``Spec``, frozen), where its life stands (``phase``) and what it
established (``ledger.Ledger``: the legs, tokens, timings and the outcome). Only this module writes
the ledger, the outcome included; everyone else reads it. Which inputs each phase takes, and the
phases each may lead to, is the table ``TRANSITIONS``: any other input raises ``IllegalInput``
naming the phase and the input, and leaves the request as it was (h11's rule). Once the client has
its end (``DONE``) or the handler let go (``CLOSED``), late and duplicate inputs are dropped.

Inputs, one handler each (``Request.HANDLERS``, keyed by type):

- ``Start``; the balancer's answers ``Placed`` / ``Queued`` / ``Rejected`` and, for a late D leg,
  ``DecodePlaced`` / ``DecodeQueued``; ``SendFailed`` when a link refused a ``Generate``.
- the schedulers' ``TokensGenerated``, ``PrefillFinished``, ``RequestFailed`` (``leg`` says whose).
- ``Cancel`` (abort endpoint, shutdown, an instance down), ``Tick`` (the armed deadline is due),
  ``Stopped`` (a stop string ended the choice), ``Shown`` (the handler gave the client the choice's end), ``Close``
  (the handler is done: release, abort what is open).

Actions: ``Send`` (a ``Generate``, an ``Abort`` or a ``ChoiceEnded`` to a leg's instance), ``Tokens`` / ``Finished`` /
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
from dataclasses import dataclass
from typing import Callable, ClassVar, Literal, Optional

import msgspec

from pushkv import messages as m
from pushkv.floods import Kinds
from pushkv.kinds import FinishReason, Mode, Role
from pushkv.router import policy as P
from pushkv.router.ledger import Ledger, Outcome
from pushkv.router.request_msgs import (  # re-exported: the machine's callers name them R.<Input>
    Action,
    Arm,
    Cancel,
    Close,
    DecodePlaced,
    DecodeQueued,
    Disarm,
    Event,
    Failed,
    Finished,
    KVArrived,
    Place,
    Placed,
    PlaceDecode,
    PrefillDone,
    Queued,
    Rejected,
    Release,
    Send,
    SendFailed,
    Shown,
    Source,
    Start,
    Stopped,
    Tick,
    Tokens,
)

log = logging.getLogger(__name__)
# the per-request lines a burst repeats (refusals by status, late allocations, failed legs), in this router process:
# written as floods.py says, each with its count
LINES = Kinds()

__all__ = ["Start", "Placed", "Queued", "DecodePlaced", "DecodeQueued", "Rejected", "SendFailed", "Cancel",
           "Tick", "Stopped", "Shown", "Close", "Send", "Tokens", "Finished", "Failed", "Place", "PlaceDecode",
           "PrefillDone", "KVArrived", "Release", "Arm", "Disarm", "Event", "Action", "IllegalInput", "Phase",
           "Request", "Spec", "TRANSITIONS", "GENERATION", "PREFILL_REPORT_GRACE_S", "ROUTER", "Source"]

# Every leg this router sends is generation 0: nothing reissues a request today (a preempted request computes
# again inside its scheduler, under its generation; no retry). Schedulers and writers still match the two halves
# by (transfer id, generation) and let a higher generation supersede a lower one, so a retry would send
# generation + 1.
GENERATION = 0
PREFILL_REPORT_GRACE_S = 1.0  # push: D done, wait this long for P's timeline
ROUTER: Literal["router"] = "router"  # the leg of inputs the router makes itself


def _leg_finish(leg: Role, outcome: str) -> FinishReason:
    """How an open leg of a request that ends now ends on its instance (``Abort.finish``): where the client has its
    answer, an open token leg was ended by a stop string ("stop": its last token would have closed it otherwise);
    otherwise it was aborted (""). P's instance knows itself whether its leg's one token was out."""
    return "stop" if outcome == "ok" and leg != "prefill" else ""


def _sent_leg(leg: Source) -> Role:
    """The leg of a scheduler's message: one the request sent (``Request.on`` refuses the rest)."""
    if leg == ROUTER:
        raise IllegalInput("a scheduler's message from the router's own leg")
    return leg


# ---------------------------------------------------------------------------
# Phases and their table
# ---------------------------------------------------------------------------
class Phase(enum.Enum):
    NEW = "new"
    PLACING = "placing"  # asked the balancer, its answer comes next
    QUEUED = "queued"  # waiting at the balancer for a first placement
    RUNNING = "running"  # legs out, the answer is coming
    DECODE_PLACING = "decode_placing"  # late: P is done, asked the balancer for a D
    DECODE_QUEUED = "decode_queued"  # late: waiting at the balancer for a D
    FINISHING = "finishing"  # push: D's last token came, P has not reported yet
    DONE = "done"  # Finished or Failed went out
    CLOSED = "closed"  # the handler let go: released, open legs aborted


class IllegalInput(ValueError):
    """An input the request's phase does not take; the request is unchanged."""


_F = frozenset
_LIVE = (Phase.NEW, Phase.PLACING, Phase.QUEUED, Phase.RUNNING, Phase.DECODE_PLACING, Phase.DECODE_QUEUED,
         Phase.FINISHING)
# phase -> input type -> the phases it may lead to; an input not listed for a phase is illegal there.
# Every live phase takes Cancel (-> DONE), Tick (stays, or DONE once due) and Close (-> CLOSED).
TRANSITIONS: dict[Phase, dict[type, frozenset[Phase]]] = {
    Phase.NEW: {Start: _F({Phase.PLACING, Phase.RUNNING})},
    Phase.PLACING: {Placed: _F({Phase.RUNNING}), Queued: _F({Phase.QUEUED}), Rejected: _F({Phase.DONE})},
    Phase.QUEUED: {Placed: _F({Phase.RUNNING})},
    Phase.RUNNING: {
        SendFailed: _F({Phase.DONE}),
        m.TokensGenerated: _F({Phase.RUNNING, Phase.FINISHING, Phase.DONE}),
        m.PrefillFinished: _F({Phase.RUNNING, Phase.DECODE_PLACING, Phase.DONE}),
        m.RequestFailed: _F({Phase.DONE}),
        Stopped: _F({Phase.DONE}),
    },
    # late, between P's end and D's leg: P's own token may still come, and P may fail (its lease)
    Phase.DECODE_PLACING: {DecodePlaced: _F({Phase.RUNNING}), DecodeQueued: _F({Phase.DECODE_QUEUED}),
                           m.TokensGenerated: _F({Phase.DECODE_PLACING}), m.RequestFailed: _F({Phase.DONE})},
    Phase.DECODE_QUEUED: {DecodePlaced: _F({Phase.RUNNING}), m.TokensGenerated: _F({Phase.DECODE_QUEUED}),
                          m.RequestFailed: _F({Phase.DONE})},
    # the client has every token: P's report, P's own token or failure, a stop string, the grace
    Phase.FINISHING: {m.TokensGenerated: _F({Phase.FINISHING}), m.PrefillFinished: _F({Phase.DONE}),
                      m.RequestFailed: _F({Phase.DONE}), Stopped: _F({Phase.DONE})},
    # the client has its end: a stop string on the last token, and the handler giving the end, still tell D
    Phase.DONE: {Close: _F({Phase.CLOSED}), Stopped: _F({Phase.DONE}), Shown: _F({Phase.DONE})},
    Phase.CLOSED: {},
}
for _p in _LIVE:
    TRANSITIONS[_p].update({Cancel: _F({Phase.DONE}), Tick: _F({_p, Phase.DONE}), Close: _F({Phase.CLOSED})})
TRANSITIONS[Phase.NEW][Tick] = _F({Phase.NEW})  # nothing is armed before Start


@dataclass(frozen=True)
class Spec:
    """What was asked of the request, and what the deployment fixed for it: never changes."""

    mode: Mode  # the deployment's
    transfer_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    stop: tuple[int, ...]
    request_s: float  # the request's deadline, from its arrival
    sampling: Optional[m.SamplingParams] = None  # None: plain greedy, fewer bytes per step
    local_engine: str = "local"  # local mode: the instance's engine id
    wall_offset: float = 0.0  # wall clock minus monotonic clock
    cache_salt: str = ""  # vLLM's: its cached prefixes are shared only with the same salt's
    lora: str = ""  # the LoRA adapter its model names ("": the base model)
    structured: Optional[m.Structured] = None  # its output held to this grammar, on every leg that draws
    stop_strings: bool = False  # the client's text is searched for stop strings (the token leg's Generate says so)
    client_id: str = ""  # the client's own id (X-Request-Id, the body's request_id), on every log line of the request


class Request:
    """One choice of one HTTP request, from ``Start`` to ``Close``: a phase and a ledger."""

    def __init__(self, spec: Spec, arrival: float, arrival_wall: Optional[float] = None):
        self.spec = spec
        self.phase = Phase.NEW
        self.ledger = Ledger(arrival=arrival, prompt_tokens=len(spec.prompt), path=spec.mode,
                             late=spec.mode == "pull")
        self.ledger.timeline["router.arrival"] = arrival + spec.wall_offset if arrival_wall is None else arrival_wall
        # the machine's own working state, not facts: the one deadline, and (disaggregated) P's own
        # report: P drew the first token and computed the prompt, so the first token's logprob and the
        # prompt's come from P; D's first TokensGenerated waits in ``held`` for it when the request
        # asked for either
        self.deadline = math.inf
        self.p_report: Optional[m.TokensGenerated] = None
        self.held: list[m.TokensGenerated] = []
        self.cancelled = ""  # why the router cancelled it (the abort endpoint, a stop, an instance down)
        # the token leg ended by length while its text is searched for stop strings: its instance counts that end
        # once told how the client's choice ended (``_tell_end``)
        self.end_owed = False

    # -- what others read --------------------------------------------------------
    @property
    def transfer_id(self) -> str:
        return self.spec.transfer_id

    @property
    def ids(self) -> str:
        """The request's ids as a log line gives them: ``transfer_id=...``, and ``client_id=...`` where the client
        named it, so that the id a client was answered with (``cmpl-<its id>``) finds the request's lines."""
        tid = f"transfer_id={self.spec.transfer_id}"
        return f"{tid} client_id={self.spec.client_id}" if self.spec.client_id else tid

    @property
    def decode_tokens(self) -> int:
        """The most D may hold for the request (prompt + max_tokens: a larger one than D's pool is refused)."""
        return len(self.spec.prompt) + self.spec.max_tokens

    @property
    def token_leg(self) -> Role:  # the leg whose tokens the client gets
        return "local" if self.spec.mode == "local" else "decode"

    @property
    def over(self) -> bool:
        """The client has its end, or the handler let go: nothing is emitted any more."""
        return self.phase in (Phase.DONE, Phase.CLOSED)

    def holds(self, role: Role, engine_id: str) -> bool:
        """Whether an instance going down fails this request: it has a leg open there, or it is
        the P that holds the KV a late D still needs."""
        led = self.ledger
        if led.engines.get(role) != engine_id:
            return False
        return ((role in led.sent and role not in led.ended)
                or (role == "prefill" and led.late and led.emitted == 0))

    # -- the one entry ----------------------------------------------------------------
    def on(self, msg: object, now: float, leg: Source = ROUTER) -> list[Action]:
        """The actions ``msg`` (from ``leg``) calls for at ``now``. Once over, every input but a first
        ``Close`` is dropped (a late or duplicate message); before, an input the phase does not take,
        or a scheduler's message on a leg never sent, raises ``IllegalInput`` and changes nothing."""
        handler = self.HANDLERS.get(type(msg))
        if handler is None:
            log.error("unexpected %s from %s %s", type(msg).__name__, leg, self.ids)
            return []
        allowed = TRANSITIONS[self.phase].get(type(msg))
        if self.over and allowed is None:
            log.debug("%s from %s after the end %s", type(msg).__name__, leg, self.ids)
            return []
        if allowed is None:
            raise IllegalInput(f"{type(msg).__name__} in phase {self.phase.value} transfer_id={self.transfer_id}")
        if leg != ROUTER and leg not in self.ledger.sent:
            raise IllegalInput(f"{type(msg).__name__} from the {leg} leg, never sent, in phase {self.phase.value} "
                               f"transfer_id={self.transfer_id}")
        out = handler(self, msg, now, leg)
        assert self.phase in allowed, f"{type(msg).__name__} led to {self.phase.value}, not in the table"
        return out

    def _mark(self, stage: str, now: float) -> None:
        self.ledger.timeline.setdefault(stage, now + self.spec.wall_offset)

    def _merge(self, leg: Source, pairs) -> None:
        for stage, t in pairs:
            self.ledger.timeline.setdefault(f"{leg}.{stage}", float(t))

    # -- placing and sending --------------------------------------------------------------
    def _generate(self, leg: Role, max_tokens: int, **kw) -> m.Generate:
        s = self.spec
        return m.Generate(
            transfer_id=s.transfer_id, generation=GENERATION, leg=leg, prompt_token_ids=s.prompt,
            max_tokens=max_tokens, stop_token_ids=s.stop, arrival=self.ledger.timeline["router.arrival"],
            sampling=s.sampling, cache_salt=s.cache_salt, structured=s.structured, lora=s.lora,
            stop_strings=s.stop_strings and leg != "prefill", **kw,
        )

    def _send(self, leg: Role, engine_id: str, msg: m.Generate, now: float) -> Send:
        self.ledger.engines[leg] = engine_id
        self.ledger.sent.add(leg)
        self._mark(f"router.send_{leg}", now)
        log.debug("send %s leg to %s %s", leg, engine_id, self.ids)
        return Send(leg, engine_id, msg)

    def _on_start(self, msg: Start, now: float, leg: Source) -> list[Action]:
        self.deadline = self.ledger.arrival + self.spec.request_s
        arm: list[Action] = [Arm(self.deadline)]
        if self.spec.mode == "local":
            self.phase = Phase.RUNNING
            gen = self._generate("local", self.spec.max_tokens)
            return arm + [self._send("local", self.spec.local_engine, gen, now)]
        self.phase = Phase.PLACING
        return arm + [Place()]

    def _on_queued(self, msg: Queued, now: float, leg: Source) -> list[Action]:
        self.phase = Phase.QUEUED
        self._mark("router.queued", now)
        return []

    def _on_placed(self, msg: Placed, now: float, leg: Source) -> list[Action]:
        if self.phase is Phase.QUEUED:
            self._mark("router.placed", now)
        self.phase = Phase.RUNNING
        v, led, n = msg.verdict, self.ledger, self.spec.max_tokens
        p, d = v.prefill or "", v.decode or ""  # the verdict's kind says which it names
        if v.kind == P.DECODE_LOCAL:
            led.path = "decode-local"
            log.debug("decode-local %s: %s", self.ids, v.reason)
            return [self._send("decode", d, self._generate("decode", n, prefill_here=True), now)]
        if v.kind == P.LATE:
            led.late = True
            if self.spec.mode == "push":
                led.path = "late"
                self._mark("router.late_allocation", now)
                n = LINES.seen("late")
                if n:
                    log.info("late allocation %s: %s (%d so far)", self.ids, v.reason, n)
            return [self._send("prefill", p, self._generate("prefill", 1, late=self.spec.mode == "push"), now)]
        # both legs leave together: D reserves and registers while P computes
        return [self._send("prefill", p, self._generate("prefill", 1), now),
                self._send("decode", d, self._generate("decode", n, source=msg.source), now)]

    def _on_decode_queued(self, msg: DecodeQueued, now: float, leg: Source) -> list[Action]:
        self.phase = Phase.DECODE_QUEUED
        self._mark("router.decode_queued", now)  # no D can hold it now: it waits at the router, never at a full D
        return []

    def _on_decode_placed(self, msg: DecodePlaced, now: float, leg: Source) -> list[Action]:
        pull = self.ledger.pull
        assert pull is not None, "the table lets DecodePlaced in only once P's pull parameters came"
        self.phase = Phase.RUNNING
        gen = self._generate("decode", self.spec.max_tokens, source=pull.source, pull=pull)
        return [self._send("decode", msg.engine_id, gen, now)]

    # -- the end, every way it comes ------------------------------------------------------------
    def _finish(self) -> list[Action]:
        self.phase = Phase.DONE
        self.ledger.outcome = "ok"
        return [Finished(self.ledger.finish_reason), Disarm()]

    def _fail(self, status: int, reason: str, outcome: Outcome = "failed") -> list[Action]:
        """Every refusal and failure of the request ends here."""
        self.phase = Phase.DONE
        self.ledger.outcome = outcome
        return [Failed(status, reason, outcome), Disarm()]

    def _on_rejected(self, msg: Rejected, now: float, leg: Source) -> list[Action]:
        n = LINES.seen(("refused", msg.status))  # a client retrying hard while an instance restarts
        if n:
            log.info("refused %s status=%d: %s (refused with %d so far: %d)", self.ids,
                     msg.status, msg.reason, msg.status, n)
        return self._fail(msg.status, msg.reason, "rejected")

    def _on_send_failed(self, msg: SendFailed, now: float, leg: Source) -> list[Action]:
        self.ledger.sent.difference_update(msg.unsent)
        log.error("sending %s leg failed %s: %s", msg.leg, self.ids, msg.error)
        late_decode = msg.leg == "decode" and self.ledger.pull is not None
        return self._fail(503, f"{'decode ' if late_decode else ''}scheduler unreachable: {msg.error}")

    def _on_request_failed(self, msg: m.RequestFailed, now: float, leg: Source) -> list[Action]:
        self.ledger.ended.add(_sent_leg(leg))
        if self.phase is Phase.FINISHING:  # the client already has every token
            log.warning("leg %s failed after completion %s: %s", leg, self.ids, msg.reason)
            return self._finish()
        n = LINES.seen(("failed", leg, msg.status))  # an instance's death fails every request it had at once
        if n:
            log.info("leg %s failed %s status=%d: %s (%s legs failed with %d so far: %d)", leg,
                     self.ids, msg.status, msg.reason, leg, msg.status, n)
        return self._fail(msg.status, f"{leg}: {msg.reason}")

    def _on_cancel(self, msg: Cancel, now: float, leg: Source) -> list[Action]:
        if self.phase is Phase.FINISHING:
            return self._finish()
        n = LINES.seen(("cancelled", msg.outcome))  # a router stop or an instance's death cancels them all
        if n:
            log.info("cancelled %s status=%d: %s (%d %s so far)", self.ids, msg.status,
                     msg.reason, n, msg.outcome)
        self.cancelled = msg.reason
        return self._fail(msg.status, msg.reason, msg.outcome)

    def _on_tick(self, msg: Tick, now: float, leg: Source) -> list[Action]:
        if now < self.deadline:
            return []
        if self.phase is Phase.FINISHING:  # P never reported: the answer is complete without it
            return self._finish()
        return self._fail(504, f"request exceeded {self.spec.request_s:g} s", "timeout")

    def _on_stopped(self, msg: Stopped, now: float, leg: Source) -> list[Action]:
        if self.phase is Phase.DONE:  # on the last token, which ended the leg by length: vLLM counts it stop
            return self._tell_end("stop")
        self.ledger.outcome = "ok"
        self.ledger.finish = now
        self._mark("router.finish", now)
        self.phase = Phase.DONE
        return [Disarm()] + self._tell_end("stop")

    def _on_shown(self, msg: Shown, now: float, leg: Source) -> list[Action]:
        return self._tell_end(msg.finish)

    def _tell_end(self, finish: str) -> list[Action]:
        """The token leg's instance holds its end by length until told how the client's choice ended (vLLM's
        frontend counts a stop string matched on the last token as stop): told once, "stop" or "length"."""
        if not self.end_owed:
            return []
        self.end_owed = False
        tok = self.token_leg
        said: FinishReason = "stop" if finish == "stop" else "length"
        return [Send(tok, self.ledger.engines[tok], m.ChoiceEnded(self.transfer_id, GENERATION, said))]

    def _on_close(self, msg: Close, now: float, leg: Source) -> list[Action]:
        led = self.ledger
        if not led.outcome:  # it had not ended: the client went away, or a sibling choice ended it
            led.outcome = msg.outcome
        reason = msg.reason or self.cancelled or (
            "request complete" if led.outcome == "ok"  # only P (push) can still be open
            else "client disconnected" if led.outcome == "aborted" else f"request {led.outcome}")
        self.phase = Phase.CLOSED  # the client is gone or has its answer: nothing is emitted any more
        out: list[Action] = [Disarm()] + self._tell_end("length")  # (the client went before its end was given)
        if self.spec.mode != "local":
            out.append(Release())
        legs = led.sent - led.ended
        if led.late and led.pull is not None and not led.kv_seen:
            legs |= {"prefill"}  # P answered its leg, but still holds the KV no D took: free it now
        for open_leg in sorted(legs):
            out.append(Send(open_leg, led.engines[open_leg],
                            m.Abort(self.transfer_id, GENERATION, reason, _leg_finish(open_leg, led.outcome))))
        return out

    # -- what the legs report ------------------------------------------------------------------------
    def _on_prefill_finished(self, msg: m.PrefillFinished, now: float, leg: Source) -> list[Action]:
        led = self.ledger
        led.ended.add(_sent_leg(leg))
        self._mark("router.prefill_finished", now)
        self._merge(leg, msg.timeline)
        led.cached[leg] = msg.cached_tokens
        led.prefill_work = (msg.prefill_steps, msg.prefill_step_tokens, msg.prefill_step_context)
        if msg.kv is not None:
            led.kv[leg] = msg.kv
        out: list[Action] = [PrefillDone()]
        if self.phase is Phase.FINISHING:
            return out + self._finish()
        if led.late and "decode" not in led.sent and led.pull is None:
            if msg.pull is None:
                return out + self._fail(502, "prefill finished without pull parameters")
            led.pull = msg.pull
            self.phase = Phase.DECODE_PLACING
            out.append(PlaceDecode())
        return out

    def _needs_first_logprob(self, msg: m.TokensGenerated) -> bool:
        s = self.spec.sampling
        return (s is not None and s.logprobs >= 0 and "prefill" in self.ledger.sent
                and self.ledger.emitted == 0 and bool(msg.token_ids) and len(msg.logprobs) < len(msg.token_ids))

    def _needs_p_prompt(self, msg: m.TokensGenerated) -> bool:
        """D's first tokens of a request that asked prompt logprobs: P computed the prompt, they are P's."""
        s = self.spec.sampling
        return (s is not None and s.prompt_logprobs >= 0 and "prefill" in self.ledger.sent
                and self.ledger.emitted == 0 and bool(msg.token_ids))

    def _waits_for_p(self, msg: m.TokensGenerated) -> bool:
        return self.p_report is None and (self._needs_first_logprob(msg) or self._needs_p_prompt(msg))

    def _on_p_report(self, msg: m.TokensGenerated, now: float, leg: Source) -> list[Action]:
        """P's own sampled token: D re-emits it; we keep what only P computed (its logprob, the
        prompt's logprobs) and let D's tokens that waited for it go, in order."""
        self._merge(leg, msg.timeline)
        if self.p_report is not None or not (msg.logprobs or msg.prompt_logprobs is not None):
            return []
        self.p_report = msg
        held, self.held = self.held, []
        out: list[Action] = []
        for h in held:
            out += self.on(h, now, self.token_leg)
        return out

    def _on_tokens(self, msg: m.TokensGenerated, now: float, leg: Source) -> list[Action]:
        led = self.ledger
        if leg != self.token_leg:
            return self._on_p_report(msg, now, leg)
        if led.done:  # a duplicate of D's last message
            log.warning("tokens after the last from %s %s", leg, self.ids)
            return []
        if self.held or self._waits_for_p(msg):
            self.held.append(msg)  # in order, behind the first token
            return []
        out: list[Action] = []
        if not led.kv_seen and self.spec.mode != "local":  # D's first token: its KV is here
            led.kv_seen = True
            out.append(KVArrived())
        prompt = msg.prompt_logprobs
        if self._needs_p_prompt(msg):
            assert self.p_report is not None
            prompt = self.p_report.prompt_logprobs
        if self._needs_first_logprob(msg):
            assert self.p_report is not None
            if not self.p_report.logprobs:
                return out + self._fail(502, "the prefill instance sent no logprob for the first token")
            msg = msgspec.structs.replace(msg, logprobs=self.p_report.logprobs[:1] + msg.logprobs)
        s = self.spec.sampling
        if s is not None and s.prompt_logprobs >= 0 and led.emitted == 0 and msg.token_ids and prompt is None:
            return out + self._fail(502, "the instance that prefilled the prompt sent no prompt logprobs")
        led.output_ids.extend(msg.token_ids)
        if self.spec.mode == "local" and msg.token_ids and len(led.output_ids) == len(msg.token_ids):
            led.cached.setdefault(leg, msg.cached_tokens)  # the first's cache hits: a stop string may end it first
        if msg.token_ids:
            if led.first_token is None:
                self._mark("router.first_token", now)
            led.add_tokens(now, len(msg.token_ids))
        ends = self._last_tokens(msg, now, leg) if msg.finished else []
        if msg.token_ids:  # last: the Finished comes with them (push may wait for P's report: then they go alone)
            out.append(Tokens(tuple(msg.token_ids), tuple(msg.logprobs), prompt,
                              last=any(isinstance(a, Finished) for a in ends)))
        return out + ends

    def _last_tokens(self, msg: m.TokensGenerated, now: float, leg: Source) -> list[Action]:
        led = self.ledger
        led.ended.add(_sent_leg(leg))
        led.cached[leg] = msg.cached_tokens
        led.decode_work = (msg.decode_steps, msg.decode_seqs, msg.decode_context, msg.decode_prefill_tokens)
        self._merge(leg, msg.timeline)
        if msg.kv is not None:
            led.kv[leg] = msg.kv
        led.finish = now
        self._mark("router.finish", now)
        led.finish_reason = msg.finish_reason or "length"
        self.end_owed = led.finish_reason == "length" and self.spec.stop_strings
        if self.spec.mode != "push" or "prefill" not in led.sent or "prefill" in led.ended:
            return self._finish()
        # push: D finished before P reported; wait briefly for P's timeline
        self.phase = Phase.FINISHING
        self.deadline = min(self.deadline, now + PREFILL_REPORT_GRACE_S)
        return [Arm(self.deadline)]

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
    Shown: Request._on_shown,
    Close: Request._on_close,
})
