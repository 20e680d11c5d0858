"""One DEALER connected to one scheduler's ROUTER, with a receive task that hands every
message to ``on_message(role, msg)``; the server routes it by ``transfer_id`` to the request's
run (``flow.RequestRun``). ``Stats`` answers stay here: ``get_stats`` waits for them.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional, cast

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pushkv import messages as m
from pushkv.framing import Drops, Shape, arecv_bounded
from pushkv.router.metrics import RouterMetrics
from pushkv.router.tasks import cancel_and_wait
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
        self._lora_waiters: dict[str, list[asyncio.Future]] = {}  # adapter name -> the router's LoadLora/UnloadLora
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_connect(self.sock, endpoint, security)
        self._shape = Shape.of(self.sock)  # a message past it is dropped whole (pushkv.framing)
        self._drops = Drops(f"router link to {role}")
        self._on_message = on_message
        self._metrics = metrics
        self._task: Optional[asyncio.Task] = None
        self._connects: Optional[asyncio.Task] = None  # says our epoch again on each new connection (``start``)
        self.last_stats: Optional[m.Stats] = None

    def start(self, epoch: int = 0, place: str = "") -> None:
        """Receive from now on; first tell the scheduler our epoch and where we serve (``messages.RouterEpoch``),
        so that it aborts what a router before us at this place left running."""
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._recv_loop(), name=f"recv-{self.role}")
        if epoch:
            # said again each time the link connects anew: a scheduler restarted at its address (fixed endpoints, no
            # registry to hand us a new link) would not know our place, and would count our connection as of every
            # place: another router restarting would make it abort our requests
            monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED)
            self._connects = loop.create_task(self._say_epoch_on_connect(monitor, m.RouterEpoch(epoch, place, True)),
                                              name=f"epoch-{self.role}")
            self._say_epoch(m.RouterEpoch(epoch, place))

    def _say_epoch(self, msg: m.RouterEpoch) -> None:
        try:
            self.send(msg)
        except zmq.ZMQError as e:  # unlikely (a fresh queue): the old router's legs then end at their bounds
            log.error("router epoch not sent to %s scheduler: %s", self.role, e)

    async def _say_epoch_on_connect(self, monitor: zmq.asyncio.Socket, msg: m.RouterEpoch) -> None:
        """Our epoch again on each connection, ahead of what we send after: the scheduler at the other end may be a
        new process. (The first connection may come before the monitor watches: it carries the epoch ``start``
        queued, and then this one too, which the scheduler takes as the same router's.)"""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_CONNECTED:
                    log.debug("%s scheduler link connected: our epoch said again", self.role)
                    await self._say_epoch_again(msg)
        finally:
            monitor.close(0)

    async def _say_epoch_again(self, msg: m.RouterEpoch) -> None:
        """``msg`` queued once there is room: what we queued while the scheduler was away may fill the queue up to
        its bound when it connects (a ``send`` then refuses it, and the scheduler never learns our place)."""
        try:
            await self.sock.send(self._encode(msg))
        except zmq.ZMQError as e:
            log.error("router epoch not said again to %s scheduler: %s", self.role, e)

    def send(self, msg: m.Msg) -> None:
        """Queue ``msg`` without awaiting, so no cancellation can land mid-send.

        Raises zmq.Again when the scheduler's queue is full (or unconnected).
        """
        data = self._encode(msg)
        # zmq.asyncio's send is typed as an Awaitable; at run time it is an asyncio Future
        fut = cast("asyncio.Future[object]", self.sock.send(data, flags=zmq.NOBLOCK))
        if fut.done():
            fut.result()
        else:  # queued behind another send: surface a late error in the log
            fut.add_done_callback(self._log_send_error)

    def _encode(self, msg: m.Msg) -> bytes:
        """``msg`` on the wire, traced as sent."""
        data = m.encode(msg)
        if self.tracer is not None:
            self.tracer.msg("send", self.peer, msg, data)
        return data

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
            if isinstance(msg, m.LoraChanged):
                waiting = self._lora_waiters.get(msg.name)
                if waiting:
                    fut = waiting.pop(0)
                    if not fut.done():
                        fut.set_result(msg)
                continue
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
        # one GetStats answers every waiting scrape
        return await self._next_stats(timeout_s, lambda first: m.GetStats() if first else None)

    async def reset_prefix_cache(self, timeout_s: float) -> Optional[m.Stats]:
        """Ask the scheduler to forget its cached prefixes; its Stats after, None if it does not answer in time.
        (Any Stats answers: the reset went before, so no request sent after this reaches a cache it had.)"""
        return await self._next_stats(timeout_s, lambda first: m.ResetPrefixCache())

    async def change_lora(self, msg: "m.LoadLora | m.UnloadLora", timeout_s: float) -> Optional[m.LoraChanged]:
        """Ask the scheduler to load or unload a LoRA adapter; its answer, None if it does not answer in time.
        (The router asks one change of a name at a time: router/loras.py.)"""
        fut = asyncio.get_running_loop().create_future()
        waiting = self._lora_waiters.setdefault(msg.name, [])
        waiting.append(fut)
        try:
            self.send(msg)
            return await asyncio.wait_for(fut, timeout_s)
        except (asyncio.TimeoutError, zmq.ZMQError):
            return None
        finally:
            if fut in waiting:
                waiting.remove(fut)
            if not waiting:
                self._lora_waiters.pop(msg.name, None)

    async def _next_stats(self, timeout_s: float, ask: Callable[[bool], Optional[m.Msg]]) -> Optional[m.Stats]:
        """Wait for the scheduler's next Stats, having sent ``ask(first)`` (first: no other waiter before this
        one; None: send nothing); None if it does not answer in time."""
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        try:
            msg = ask(len(self._stats_waiters) == 1)
            if msg is not None:
                self.send(msg)
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
        await cancel_and_wait((self._task, self._connects))
        if self._connects is not None:
            self.sock.disable_monitor()
        self.sock.close(0)
