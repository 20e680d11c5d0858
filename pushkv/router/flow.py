"""Scheduler links and the asyncio shell around each request's state machine.

A ``SchedulerLink`` is one DEALER connected to one scheduler's ROUTER, with a
receive task that hands every message to ``on_message(role, msg)``; the
router routes it by ``transfer_id`` to the request's queue. A ``RequestRun``
reads that queue and the request's deadline, feeds each input to its pure
``request.Request`` and carries out the actions it answers (sends, the
balancer's bookkeeping) until the client's last event, ``Finished`` or
``Failed``. What the legs are per path, and how a request ends, is in
``request.py``.

Which P and which D serve a request is the ``Balancer``'s choice (``balance.py``
over the pure ``policy.py``); a request no D can hold waits there until one can.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import AsyncIterator, Callable, ClassVar, Optional

import msgspec
import zmq
import zmq.asyncio

from pushkv import messages as m
from pushkv.config import DeploymentConfig
from pushkv.framing import Drops, Shape, arecv_bounded
from pushkv.router import request as R
from pushkv.router.balance import Balancer, DecodePlaced, Refused
from pushkv.router.metrics import RequestRecord, RouterMetrics
from pushkv.security import Security, secure_connect
from pushkv.trace import TracePublisher

log = logging.getLogger(__name__)


class SchedulerLink:
    """DEALER to one scheduler, plus its receive task."""

    def __init__(self, ctx: zmq.asyncio.Context, role: str, endpoint: str,
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
        self._shape = Shape.of(self.sock)  # a message past it is dropped whole (pushkv.framing)
        self._drops = Drops(f"router link to {role}")
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
            frames, why, n, nbytes = await arecv_bounded(self.sock, self._shape)
            if frames is None:
                self._metrics.sched_messages.labels(role=self.role, kind=f"dropped_{why}").inc()
                self._drops.drop(f"{self.role} scheduler", why, n, nbytes, self._shape)
                continue
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
# The asyncio shell around one request's state machine (request.py)
# ---------------------------------------------------------------------------
class RequestRun:
    """Feeds a ``request.Request`` what its legs, the balancer and its deadline say, and carries
    out what it answers: sends, the balancer's bookkeeping, and the client's events."""

    def __init__(self, cfg: DeploymentConfig, balancer: Optional[Balancer], transfer_id: str,
                 prompt_token_ids: list[int], max_tokens: int, stop_token_ids: tuple[int, ...],
                 record: RequestRecord, metrics: RouterMetrics, sampling: Optional[m.SamplingParams] = None,
                 local_link: Optional[SchedulerLink] = None):
        self.balancer = balancer
        self.local_link = local_link
        self.metrics = metrics
        wall = time.time()
        self.req = R.Request(
            mode=cfg.mode, transfer_id=transfer_id, prompt=tuple(prompt_token_ids), max_tokens=max_tokens,
            stop=stop_token_ids, record=record, request_s=cfg.timeouts.request_s,
            wall_offset=wall - time.monotonic(), arrival_wall=wall,
            sampling=sampling if sampling != m.SamplingParams() else None,
            local_engine=cfg.local.engine_id or "local",
        )
        self.queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self.links: dict[str, SchedulerLink] = {}  # leg -> the link its Generate went out on
        self.deadline = math.inf  # what the request armed
        self.started = False

    ACTIONS: ClassVar[dict[type, Callable[..., Optional[object]]]] = {}  # action type -> how it is done

    # -- what the balancer reads (balance.RequestRun) ---------------------------
    @property
    def transfer_id(self) -> str:
        return self.req.transfer_id

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.req.prompt

    @property
    def decode_tokens(self) -> int:
        return self.req.decode_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.req.output_ids

    @property
    def done(self) -> bool:
        return self.req.done

    @property
    def cached(self) -> dict[str, int]:
        return self.req.cached

    @property
    def timeline(self) -> dict[str, float]:
        return self.req.timeline

    @property
    def hash_cache(self) -> dict[int, list[int]]:
        return self.req.hash_cache

    @property
    def prefill_work(self) -> tuple[int, int, int]:
        return self.req.prefill_work

    @property
    def decode_work(self) -> tuple[int, int, int, int]:
        return self.req.decode_work

    @property
    def record(self) -> RequestRecord:
        return self.req.record

    # -- inputs from outside the handler ------------------------------------------
    def deliver(self, leg: str, msg: object) -> None:
        self.queue.put_nowait((leg, msg))

    def inject_failure(self, status: int, reason: str) -> None:
        """The abort endpoint, shutdown, an instance down."""
        self.queue.put_nowait((R.ROUTER, R.Cancel(status, reason)))

    # -- feeding the machine and carrying out what it says --------------------------
    def _feed(self, msg: object, leg: str = R.ROUTER) -> list[R.Event]:
        """One input, and every input its actions bring back (the balancer's answers, a refused
        send), at once: nothing awaits in here, so a cancellation never lands halfway."""
        events: list[R.Event] = []
        inputs: list[tuple[str, object]] = [(leg, msg)]
        while inputs:
            leg, msg = inputs.pop(0)
            actions = self.req.on(msg, time.monotonic(), leg)
            for i, a in enumerate(actions):
                answer = self._do(a, events)
                if isinstance(answer, R.SendFailed):  # the rest of this batch is moot
                    unsent = tuple(b.leg for b in actions[i + 1:] if isinstance(b, R.Send))
                    answer = R.SendFailed(answer.leg, answer.error, unsent)
                if answer is not None:
                    inputs.append((R.ROUTER, answer))
                if isinstance(answer, R.SendFailed):
                    break
        return events

    def _do(self, a: R.Action, events: list[R.Event]) -> Optional[object]:
        """Carry out one action; what it brings back (the balancer's answer, a refused send) is the
        request's next input."""
        if isinstance(a, (R.Tokens, R.Finished, R.Failed)):
            events.append(a)
            return None
        return self.ACTIONS[type(a)](self, a)

    @property
    def _balancer(self) -> Balancer:
        assert self.balancer is not None, "a disaggregated action in local mode"
        return self.balancer

    def _arm(self, a: R.Arm) -> None:
        self.deadline = a.at

    def _disarm(self, a: R.Disarm) -> None:
        self.deadline = math.inf

    def _place(self, a: R.Place) -> object:
        try:
            v = self._balancer.request(self)
        except Refused as e:
            return R.Rejected(e.status, e.reason)
        return R.Queued() if v is None else self._balancer.placed(v)

    def _place_decode(self, a: R.PlaceDecode) -> object:
        engine = self._balancer.request_decode(self)
        return R.DecodeQueued() if engine is None else DecodePlaced(engine)

    def _prefill_done(self, a: R.PrefillDone) -> None:
        self._balancer.prefill_done(self)

    def _kv_arrived(self, a: R.KVArrived) -> None:
        self._balancer.kv_arrived(self)

    def _release(self, a: R.Release) -> None:
        self._balancer.release(self)

    def _send(self, a: R.Send) -> Optional[R.SendFailed]:
        link = self.links.get(a.leg)
        try:
            if link is None:
                link = self.local_link if a.leg == "local" else self._balancer.links[a.engine_id]
                assert link is not None, f"no link for the {a.leg} leg"
                self.links[a.leg] = link
            link.send(a.msg)
        except Exception as e:
            if isinstance(a.msg, m.Generate):
                return R.SendFailed(a.leg, str(e))
            log.error("abort to %s failed transfer_id=%s: %s", a.leg, self.transfer_id, e)
            return None
        if isinstance(a.msg, m.Abort):
            self.metrics.aborts_sent.labels(role=a.leg).inc()
            log.info("abort %s leg transfer_id=%s: %s", a.leg, self.transfer_id, a.msg.reason)
        return None

    # -- the handler's side ---------------------------------------------------------------
    def start(self) -> Optional[R.Failed]:
        """Send the legs, or queue the request at the balancer; the refusal if it was refused
        (429 / 503 / 413) or a link refused the send."""
        if self.started:
            return None
        self.started = True
        return next((e for e in self._feed(R.Start()) if isinstance(e, R.Failed)), None)

    async def _next(self) -> tuple[str, object]:
        # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation
        # (client gone) that lands in the same iteration as a queue item
        remaining = self.deadline - time.monotonic()
        try:
            if remaining <= 0:
                return R.ROUTER, R.Tick()
            async with asyncio.timeout(None if math.isinf(remaining) else remaining):
                return await self.queue.get()
        except TimeoutError:
            return R.ROUTER, R.Tick()

    async def events(self) -> AsyncIterator[R.Event]:
        """Yield the request's events; ends after one Finished or Failed."""
        refusal = self.start()
        if refusal is not None:
            yield refusal
            return
        while not self.req.over:
            leg, msg = await self._next()
            for ev in self._feed(msg, leg):
                yield ev

    def stop_early(self, reason: str) -> None:
        """A stop string ended the choice: it is complete, its legs are aborted."""
        self._feed(R.Stopped())
        self.close(reason)

    def close(self, reason: str) -> None:
        """Abort every leg that was sent and has not ended (no await: safe while cancelled)."""
        self._feed(R.Close(reason))


RequestRun.ACTIONS = {
    R.Send: RequestRun._send, R.Arm: RequestRun._arm, R.Disarm: RequestRun._disarm,
    R.Place: RequestRun._place, R.PlaceDecode: RequestRun._place_decode,
    R.PrefillDone: RequestRun._prefill_done, R.KVArrived: RequestRun._kv_arrived, R.Release: RequestRun._release,
}
