"""Scheduler links and the per-request leg orchestration.

A ``SchedulerLink`` is one DEALER connected to one scheduler's ROUTER, with a
receive task that hands every message to ``on_message(role, msg)``; the
router routes it by ``transfer_id`` to the request's queue. A ``RequestRun``
sends a request's legs and turns what comes back into ``Tokens`` /
``Finished`` / ``Failed`` events:

- local: ``Generate(leg="local")``; tokens from the local scheduler.
- push: P leg (``max_tokens=1``) and D leg (``source=P``) sent together;
  tokens from D; P answers ``PrefillFinished`` (informative).
- pull, and push's late allocation: P leg first; P's ``PrefillFinished.pull`` is
  relayed in the D leg; tokens from D.
- decode-local (conditional disaggregation): one D leg with ``prefill_here``; D
  prefills and decodes, nothing moves.

Which P and which D serve a request is the ``Balancer``'s choice (``balance.py``
over the pure ``policy.py``); a request no D can hold waits there until one can.

A failed leg fails the request; every leg sent and not yet ended gets an
``Abort`` when the run closes, whatever the reason (failure, timeout, client
gone, shutdown).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Union

import msgspec
import zmq
import zmq.asyncio

from pushkv import messages as m
from pushkv.config import DeploymentConfig, Role
from pushkv.router import policy as P
from pushkv.router.balance import Balancer, DecodePlaced, Placed, Refused
from pushkv.router.metrics import RequestRecord, RouterMetrics
from pushkv.security import Security, secure_connect
from pushkv.trace import TracePublisher

log = logging.getLogger(__name__)

# Every leg this router sends is generation 0: nothing reissues a request today
# (no preemption, no retry). Schedulers and writers still match the two halves by
# (transfer id, generation) and let a higher generation supersede a lower one, so a
# retry would send generation + 1 and never pair with a stale half.
GENERATION = 0
PREFILL_REPORT_GRACE_S = 1.0  # push: D done, wait this long for P's timeline


class SchedulerLink:
    """DEALER to one scheduler, plus its receive task."""

    def __init__(self, ctx: zmq.asyncio.Context, role: Role, endpoint: str,
                 on_message: Callable[[str, m.Msg], None], metrics: RouterMetrics,
                 tracer: Optional[TracePublisher] = None, engine_id: str = "", name: str = "",
                 security: Optional[Security] = None):
        self.role = role
        self.engine_id = engine_id
        self.peer = f"{name or role}-scheduler"  # in traces
        self.tracer = tracer
        self._stats_waiters: list[asyncio.Future] = []
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_connect(self.sock, endpoint, security)
        self._on_message = on_message
        self._metrics = metrics
        self._task: Optional[asyncio.Task] = None
        self.last_stats: Optional[m.Stats] = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._recv_loop(), name=f"recv-{self.role}")

    def send(self, msg: m.Msg) -> None:
        """Queue ``msg`` without awaiting, so no cancellation can land mid-send.

        Raises zmq.Again when the scheduler's queue is full (or unconnected).
        """
        data = m.encode(msg)
        if self.tracer is not None:
            self.tracer.msg("send", self.peer, msg, data)
        fut = self.sock.send(data, flags=zmq.NOBLOCK)
        if fut.done():
            fut.result()
        else:  # queued behind another send: surface a late error in the log
            fut.add_done_callback(self._log_send_error)

    def _log_send_error(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.error("send to %s scheduler failed: %s", self.role, fut.exception())

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            payload = frames[-1]  # tolerate an empty delimiter frame
            try:
                msg = m.DEC_SCHED_TO_ROUTER.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self._metrics.sched_messages.labels(role=self.role, kind="undecodable").inc()
                log.error("undecodable frame from %s scheduler (%d bytes): %s", self.role, len(payload), e)
                continue
            self._metrics.sched_messages.labels(role=self.role, kind=type(msg).__name__).inc()
            if self.tracer is not None:
                self.tracer.msg("recv", self.peer, msg, payload)
            if isinstance(msg, m.Stats):
                self.last_stats = msg
                waiters, self._stats_waiters = self._stats_waiters, []
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(msg)
                continue
            try:
                self._on_message(self.role, msg)
            except Exception:  # one bad message must not stop the link
                log.exception("routing %s from %s failed", type(msg).__name__, self.role)

    async def get_stats(self, timeout_s: float) -> Optional[m.Stats]:
        """Ask the scheduler for its Stats; None if it does not answer in time."""
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        try:
            if len(self._stats_waiters) == 1:  # one GetStats answers every waiting scrape
                self.send(m.GetStats())
            return await asyncio.wait_for(fut, timeout_s)
        except (asyncio.TimeoutError, zmq.ZMQError):
            return None
        finally:
            if fut in self._stats_waiters:
                self._stats_waiters.remove(fut)

    def retire(self) -> None:
        """Replaced by a link to a new endpoint: close in the background."""
        asyncio.get_running_loop().create_task(self.close())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self.sock.close(0)


# ---------------------------------------------------------------------------
# Events a run yields
# ---------------------------------------------------------------------------
@dataclass
class Tokens:
    token_ids: tuple[int, ...]
    logprobs: tuple[m.TokenLogprob, ...] = ()  # one per token id when the request asked


@dataclass
class Finished:
    finish_reason: str


@dataclass
class Failed:
    status: int
    reason: str
    outcome: str = "failed"


Event = Union[Tokens, Finished, Failed]
ROUTER = "router"  # pseudo-role of events the router injects (abort, shutdown)


class RequestRun:
    """One request's legs, from the first Generate to the last Abort."""

    def __init__(self, cfg: DeploymentConfig, balancer: Optional[Balancer], transfer_id: str,
                 prompt_token_ids: list[int], max_tokens: int, stop_token_ids: tuple[int, ...],
                 record: RequestRecord, metrics: RouterMetrics, sampling: Optional[m.SamplingParams] = None,
                 local_link: Optional[SchedulerLink] = None):
        self.cfg = cfg
        self.balancer = balancer
        self.local_link = local_link
        self.legs: dict[str, SchedulerLink] = {}  # leg -> the chosen instance's link
        self.engines: dict[str, str] = {}  # leg -> engine id
        self.late = cfg.mode == "pull"  # D's leg after P's (pull, or push's late allocation)
        self.pull: Optional[m.PullParams] = None  # late: P's answer, relayed in D's leg
        self.kv_seen = False
        self.started = False
        self.transfer_id = transfer_id
        self.prompt = tuple(prompt_token_ids)
        self.max_tokens = max_tokens
        self.stop = stop_token_ids
        self.record = record
        self.metrics = metrics
        self.queue: asyncio.Queue[tuple[str, m.Msg]] = asyncio.Queue()
        self.arrival_wall = time.time()
        self.timeline: dict[str, float] = {"router.arrival": self.arrival_wall}
        self.sent: set[str] = set()  # legs whose Generate went out
        self.ended: set[str] = set()  # legs that answered their last message
        self.token_leg = "local" if cfg.mode == "local" else "decode"
        self.kv: dict[str, m.KVTransferStats] = {}  # per leg, as the schedulers measured the transfer
        self.closed = False
        self.sampling = sampling if sampling != m.SamplingParams() else None  # None: plain greedy, fewer bytes per step
        # disaggregated: P drew the first token, so its logprob comes from P; D's first
        # TokensGenerated waits here for it when the request asked for logprobs
        self.first_logprob: Optional[m.TokenLogprob] = None
        self.held: list[tuple[str, m.Msg]] = []  # D's tokens waiting for P's first logprob
        self.replay: list[tuple[str, m.Msg]] = []  # ... and released, read before the queue
        self.emitted = 0
        self.output_ids: list[int] = []  # what D streamed (the balancer indexes D's prompt + answer)
        self.done = False  # D's last token came
        self.cached: dict[str, int] = {}  # leg -> prompt tokens its instance took from its prefix cache
        self.prefill_work: tuple[int, int, int] = (0, 0, 0)  # P's steps for it: steps, tokens, context
        self.decode_work: tuple[int, int, int, int] = (0, 0, 0, 0)  # D's: steps, seqs, context, prefill tokens
        self.hash_cache: dict[int, list[int]] = {}  # block size -> the prompt's block hashes (placement)
        self.path = cfg.mode  # push | late | pull | decode-local | local

    # -- inputs ---------------------------------------------------------
    def deliver(self, role: Role, msg: m.Msg) -> None:
        self.queue.put_nowait((role, msg))

    def inject_failure(self, status: int, reason: str) -> None:
        """From outside the run (abort endpoint, shutdown)."""
        self.queue.put_nowait((ROUTER, m.RequestFailed(self.transfer_id, GENERATION, reason, status)))

    # -- timeline ---------------------------------------------------------
    def mark(self, stage: str, t: Optional[float] = None) -> None:
        self.timeline.setdefault(stage, time.time() if t is None else t)

    def merge(self, leg: Role, pairs) -> None:
        for stage, t in pairs:
            self.timeline.setdefault(f"{leg}.{stage}", float(t))

    # -- legs ---------------------------------------------------------------
    def _generate(self, leg: Role, **kw) -> m.Generate:
        return m.Generate(
            transfer_id=self.transfer_id, generation=GENERATION, leg=leg,
            prompt_token_ids=self.prompt, stop_token_ids=self.stop,
            arrival=self.arrival_wall, sampling=self.sampling, **kw,
        )

    @property
    def decode_tokens(self) -> int:
        """What D must hold for the whole request (no preemption)."""
        return len(self.prompt) + self.max_tokens

    def _assign(self, leg: Role, engine_id: str) -> None:
        self.legs[leg] = self.balancer.links[engine_id]
        self.engines[leg] = engine_id

    def _send_leg(self, leg: Role, msg: m.Generate) -> None:
        self.sent.add(leg)
        self.mark(f"router.send_{leg}")
        log.debug("send %s leg to %s transfer_id=%s", leg, self.engines.get(leg, leg), self.transfer_id)
        self.legs[leg].send(msg)

    def start(self) -> None:
        """Send the legs, or queue the request at the balancer (``Placed`` comes later).
        Raises ``Refused`` (429 / 503 / 413) before anything was sent."""
        if not self.started:
            self.started = True
            self._start()

    def _start(self) -> None:
        mode = self.cfg.mode
        if mode == "local":
            self.legs["local"] = self.local_link
            self._send_leg("local", self._generate("local", max_tokens=self.max_tokens))
            return
        if mode not in ("push", "pull"):
            raise ValueError(f"unknown mode {mode!r}")
        verdict = self.balancer.request(self)  # Refused: 429 / 503 / 413 with a reason
        if verdict is None:
            self.mark("router.queued")
            return
        self._dispatch(verdict)

    def _dispatch(self, v: P.Verdict) -> None:
        if v.kind == P.DECODE_LOCAL:
            self.path = v.kind
            log.debug("decode-local transfer_id=%s: %s", self.transfer_id, v.reason)
            self._assign("decode", v.decode)
            self._send_leg("decode", self._generate("decode", max_tokens=self.max_tokens, prefill_here=True))
            return
        self._assign("prefill", v.prefill)
        if v.kind == P.LATE:
            self.late = True
            if self.cfg.mode == "push":
                self.path = "late"
                self.mark("router.late_allocation")
                log.info("late allocation transfer_id=%s: %s", self.transfer_id, v.reason)
            self._send_leg("prefill", self._generate("prefill", max_tokens=1, late=self.cfg.mode == "push"))
            return
        self._assign("decode", v.decode)
        prefill = self._generate("prefill", max_tokens=1)
        decode = self._generate("decode", max_tokens=self.max_tokens, source=self.balancer.source(v.prefill))
        # both legs leave together, no await between: D reserves and registers while P computes
        self._send_leg("prefill", prefill)
        self._send_leg("decode", decode)

    def _send_late_decode(self, engine_id: str) -> None:
        self._assign("decode", engine_id)
        self._send_leg("decode", self._generate("decode", max_tokens=self.max_tokens,
                                                source=self.pull.source, pull=self.pull))

    async def _next(self, deadline: float) -> Optional[tuple[str, m.Msg]]:
        # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation
        # (client gone) that lands in the same iteration as a queue item
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            if not hasattr(asyncio, "timeout"):  # Python 3.10
                return await asyncio.wait_for(self.queue.get(), remaining)
            async with asyncio.timeout(remaining):
                return await self.queue.get()
        except (TimeoutError, asyncio.TimeoutError):
            return None

    async def events(self) -> AsyncIterator[Event]:
        """Yield the request's events; ends after one Finished or Failed."""
        deadline = self.record.arrival + self.cfg.timeouts.request_s
        try:
            self.start()
        except Refused as e:
            log.info("refused transfer_id=%s status=%d: %s", self.transfer_id, e.status, e.reason)
            yield Failed(e.status, e.reason, "rejected")
            return
        except Exception as e:
            log.error("sending legs failed transfer_id=%s: %s", self.transfer_id, e)
            yield Failed(503, f"scheduler unreachable: {e}")
            return
        finish_reason = ""
        while True:
            if finish_reason:
                if self.cfg.mode != "push" or "prefill" not in self.sent or "prefill" in self.ended:
                    break
                # push: D finished before P reported; wait briefly for P's timeline
                deadline = min(deadline, time.monotonic() + PREFILL_REPORT_GRACE_S)
            item = self.replay.pop(0) if self.replay else await self._next(deadline)
            if item is None:
                if finish_reason:
                    break
                yield Failed(504, f"request exceeded {self.cfg.timeouts.request_s:g} s", "timeout")
                return
            role, msg = item
            if isinstance(msg, (Placed, DecodePlaced)):
                try:
                    if isinstance(msg, Placed):
                        self.mark("router.placed")
                        self._dispatch(msg.verdict)
                    else:
                        self._send_late_decode(msg.engine_id)
                except Exception as e:
                    yield Failed(503, f"scheduler unreachable: {e}")
                    return
                continue
            if isinstance(msg, m.RequestFailed):
                if role != ROUTER:
                    self.ended.add(role)
                if finish_reason:  # the client already has every token
                    log.warning("leg %s failed after completion transfer_id=%s: %s",
                                role, self.transfer_id, msg.reason)
                    break
                log.info("leg %s failed transfer_id=%s status=%d: %s",
                         role, self.transfer_id, msg.status, msg.reason)
                outcome = "failed" if role != ROUTER else ("shutdown" if msg.status == 503 else "aborted")
                yield Failed(msg.status, f"{role}: {msg.reason}" if role != ROUTER else msg.reason, outcome)
                return
            if isinstance(msg, m.PrefillFinished):
                self.ended.add(role)
                self.mark("router.prefill_finished")
                self.merge(role, msg.timeline)
                self.cached[role] = msg.cached_tokens
                self.prefill_work = (msg.prefill_steps, msg.prefill_step_tokens, msg.prefill_step_context)
                if self.balancer is not None:
                    self.balancer.prefill_done(self)
                if msg.kv is not None:
                    self.kv[role] = msg.kv
                if self.late and "decode" not in self.sent and self.pull is None:
                    if msg.pull is None:
                        yield Failed(502, "prefill finished without pull parameters")
                        return
                    self.pull = msg.pull
                    try:
                        engine = self.balancer.request_decode(self)
                        if engine is None:  # no D can hold it now: wait here, never at a full D
                            self.mark("router.decode_queued")
                        else:
                            self._send_late_decode(engine)
                    except Exception as e:
                        yield Failed(503, f"decode scheduler unreachable: {e}")
                        return
                continue
            if isinstance(msg, m.TokensGenerated):
                if role != self.token_leg:  # P's own sampled token: D re-emits it, we keep its logprob
                    self.merge(role, msg.timeline)
                    if msg.logprobs and self.first_logprob is None:
                        self.first_logprob = msg.logprobs[0]
                        self.replay, self.held = self.held, []
                    continue
                if self.held or (self._needs_first_logprob(msg) and self.first_logprob is None):
                    self.held.append((role, msg))  # in order, behind the first token
                    continue
                if not self.kv_seen and self.balancer is not None:  # D's first token: its KV is here
                    self.kv_seen = True
                    self.balancer.kv_arrived(self)
                if self._needs_first_logprob(msg):
                    msg = msgspec.structs.replace(msg, logprobs=(self.first_logprob,) + msg.logprobs)
                self.emitted += len(msg.token_ids)
                self.output_ids.extend(msg.token_ids)
                if msg.token_ids and self.record.first_token is None:
                    self.mark("router.first_token")
                if msg.token_ids:
                    self.record.add_tokens(time.monotonic(), len(msg.token_ids))
                    yield Tokens(tuple(msg.token_ids), tuple(msg.logprobs))
                if msg.finished:
                    self.ended.add(role)
                    self.done = True
                    self.cached[role] = msg.cached_tokens
                    self.decode_work = (msg.decode_steps, msg.decode_seqs, msg.decode_context,
                                        msg.decode_prefill_tokens)
                    self.merge(role, msg.timeline)
                    if msg.kv is not None:
                        self.kv[role] = msg.kv
                    self.record.finish = time.monotonic()
                    self.mark("router.finish")
                    finish_reason = msg.finish_reason or "length"
                continue
            log.error("unexpected %s from %s transfer_id=%s", type(msg).__name__, role, self.transfer_id)
        yield Finished(finish_reason)

    def _needs_first_logprob(self, msg: m.TokensGenerated) -> bool:
        return (self.sampling is not None and self.sampling.logprobs >= 0 and "prefill" in self.sent
                and self.emitted == 0 and bool(msg.token_ids) and len(msg.logprobs) < len(msg.token_ids))

    def close(self, reason: str) -> None:
        """Abort every leg that was sent and has not ended (no await: safe while cancelled)."""
        if self.closed:
            return
        self.closed = True
        if self.balancer is not None:
            self.balancer.release(self)
        for leg in sorted(self.sent - self.ended):
            try:
                self.legs[leg].send(m.Abort(self.transfer_id, GENERATION, reason))
                self.metrics.aborts_sent.labels(role=leg).inc()
                log.info("abort %s leg transfer_id=%s: %s", leg, self.transfer_id, reason)
            except Exception as e:
                log.error("abort to %s failed transfer_id=%s: %s", leg, self.transfer_id, e)
