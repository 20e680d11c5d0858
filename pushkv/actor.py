"""One actor base for every pushkv process.

A loop with explicit phases (setup / run / teardown), a zmq poller, typed
dispatch by message type (``on_<TypeName>``), a ``tick(now)`` with the clock
passed in, and an adaptive poll timeout so an idle process sleeps instead of
spinning. Signals only set a flag. An unknown or undecodable frame is logged
and counted; the loop continues.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter
from typing import Any, Callable, Optional

import msgspec
import zmq

from pushkv import limits, security
from pushkv import messages as m
from pushkv.dispatch import handler_for
from pushkv.framing import Drops, Shape, recv_bounded
from pushkv.security import secure_bind, secure_connect
from pushkv.trace import TracePublisher

log = logging.getLogger(__name__)

IDLE_POLL_MS = 100  # nothing pending: wake this often for deadlines


class Channel:
    """A socket with its decoder and the peer name used in logs and traces."""

    def __init__(self, sock: zmq.Socket, decoder: msgspec.msgpack.Decoder, peer: str, routed: bool):
        self.index = 0  # e.g. the TP rank of the peer
        self.sock = sock
        self.decoder = decoder
        self.peer = peer
        self.routed = routed  # ROUTER socket: first frame is the sender identity
        self.shape = Shape.of(sock)  # the most frames and bytes one message may have (pushkv.framing)


class Actor:
    """Base of every process loop. Subclasses add channels in ``setup``."""

    def __init__(self, name: str, control_endpoint: str = "", trace_endpoint: str = "", secret_file: str = "",
                 max_msg_bytes: int = limits.CONTROL_MSG_BYTES, counters: Optional[Counter[str]] = None):
        self.name = name
        # the largest message a socket of ours accepts unless it names its own (pushkv.limits): ZMQ
        # drops a larger one and disconnects its sender before anything of it is decoded
        self.max_msg_bytes = max_msg_bytes
        self.ctx: zmq.Context = zmq.Context.instance()
        self.poller = zmq.Poller()
        self.channels: dict[zmq.Socket, Channel] = {}
        # a sans-I/O core's counters when it has one: the actor's own (bad frames, CURVE) join them
        self.counters: Counter[str] = counters if counters is not None else Counter()
        # CURVE on network endpoints; peers refused are counted in self.counters
        self.security = security.load(secret_file, self.counters)
        self.stopping = False
        self.stop_reason = ""  # from the supervisor's Shutdown, for what we tell clients
        self.started_mono = time.monotonic()
        self._control_endpoint = control_endpoint
        self._control: Optional[zmq.Socket] = None
        self._trace_endpoint = trace_endpoint
        self._trace: Optional[TracePublisher] = None
        self._handlers: dict[type, Callable[..., Any]] = {}
        self._extra_fds: dict[int, Callable[[], None]] = {}
        self.current: Optional[Channel] = None  # channel of the message being handled
        self._drops = Drops(name, self.counters)  # messages past their channel's shape

    # -- lifecycle hooks -------------------------------------------------
    def setup(self) -> None:
        """Bind/connect sockets, allocate resources."""

    def ready_msg(self) -> m.Ready:
        """What this process tells the supervisor once set up (a writer adds its pool)."""
        return m.Ready(name=self.name, pid=os.getpid())

    def tick(self, now: float) -> None:
        """Deadlines and polling of non-socket event sources."""

    def poll_timeout_ms(self) -> int:
        return IDLE_POLL_MS

    def teardown(self) -> None:
        """Release resources; refuse pending work explicitly."""

    # -- sockets ------------------------------------------------------------
    def add_channel(self, sock: zmq.Socket, decoder, peer: str, routed: bool = False) -> Channel:
        ch = Channel(sock, decoder, peer, routed)
        self.channels[sock] = ch
        self.poller.register(sock, zmq.POLLIN)
        return ch

    def add_fd(self, fd: int, on_ready: Callable[[], None]) -> None:
        self._extra_fds[fd] = on_ready
        self.poller.register(fd, zmq.POLLIN)

    def remove_fd(self, fd: int) -> None:
        if self._extra_fds.pop(fd, None) is not None:
            self.poller.unregister(fd)

    def add_socket(self, sock: zmq.Socket, on_ready: Callable[[], None]) -> None:
        """A socket read by its owner, not as a channel of messages (the KV events' replay): ``on_ready`` when it
        has something; ``remove_fd(sock)`` takes it out."""
        self.add_fd(sock, on_ready)  # type: ignore[arg-type]  # the poller takes a socket where it takes an fd

    def socket(self, kind: int, endpoint: str, bind: bool, max_msg_bytes: int = 0) -> zmq.Socket:
        """Every socket of every actor is made here: linger 0, a message-size cap (``max_msg_bytes``,
        else the actor's), CURVE on a network endpoint."""
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes or self.max_msg_bytes)
        if bind:
            secure_bind(sock, endpoint, self.security)
        else:
            secure_connect(sock, endpoint, self.security)
        return sock

    def send(self, ch: Channel, msg: m.Msg, identity: Optional[bytes] = None) -> None:
        data = m.encode(msg)
        self.trace_msg("send", ch.peer, msg, data)  # stamped before the send: never after the peer's recv
        if identity is not None:
            ch.sock.send_multipart([identity, data])
        else:
            ch.sock.send(data)

    # -- tracing ------------------------------------------------------------
    def trace_msg(self, direction: str, peer: str, msg: Any, data: bytes = b"") -> None:
        if self._trace is not None:
            self._trace.msg(direction, peer, msg, data)

    def trace_event(self, kind: str, transfer_id: str = "", detail: str = "") -> None:
        """A local event (not a message), e.g. 'prefill_start'."""
        if self._trace is not None:
            self._trace.event(kind, transfer_id, detail)

    # -- dispatch -----------------------------------------------------------
    def _handler(self, typ: type) -> Optional[Callable[..., Any]]:
        return handler_for(self, self._handlers, typ)

    def _drain(self, ch: Channel) -> None:
        while True:
            if ch.sock.closed:  # a handler closed its own channel (a refused or failed handshake link)
                return
            try:
                frames, why, n, nbytes = recv_bounded(ch.sock, ch.shape, zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames is None:
                self._drops.drop(ch.peer, why, n, nbytes, ch.shape)
                continue
            identity = frames[0] if ch.routed and len(frames) > 1 else None
            payload = frames[-1]
            try:
                msg = ch.decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.counters["bad_frame"] += 1
                log.error("%s: undecodable frame from %s (%d bytes): %s", self.name, ch.peer, len(payload), e)
                self.on_bad_frame(ch, identity, str(e), payload)
                continue
            self.trace_msg("recv", ch.peer, msg, payload)
            handler = self._handler(type(msg))
            if handler is None:
                self.counters["unexpected_msg"] += 1
                log.error("%s: unexpected %s from %s", self.name, type(msg).__name__, ch.peer)
                continue
            self.current = ch
            try:
                handler(msg, identity) if ch.routed else handler(msg)
            except Exception:  # a failing handler must not kill the loop
                self.counters["handler_error"] += 1
                log.exception("%s: handler for %s failed", self.name, type(msg).__name__)
                self.on_handler_error(ch, identity, msg)

    def on_bad_frame(self, ch: Channel, identity: Optional[bytes], reason: str, payload: bytes = b"") -> None:
        """Override to answer the sender of an undecodable frame."""

    def on_handler_error(self, ch: Channel, identity: Optional[bytes], msg: Any) -> None:
        """Override to answer the sender whose message made a handler raise."""

    # -- the loop -----------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        self.stopping = True

    def _announce_ready(self) -> None:
        if self._trace_endpoint:
            self._trace = TracePublisher(self.name, self._trace_endpoint, self.ctx, self.counters, self.security)
        if not self._control_endpoint:
            return
        self._control = self.ctx.socket(zmq.DEALER)
        self._control.setsockopt(zmq.LINGER, 0)
        self._control.setsockopt(zmq.MAXMSGSIZE, limits.CONTROL_MSG_BYTES)
        secure_connect(self._control, self._control_endpoint, self.security)
        self._control.send(m.encode(self.ready_msg()))
        self.add_channel(self._control, m.DEC_CONTROL, "supervisor")

    def on_Shutdown(self, msg: m.Shutdown) -> None:
        log.info("%s: shutdown requested (%s)", self.name, msg.reason)
        self.stop_reason = msg.reason
        self.stopping = True

    def on_Ping(self, msg: m.Ping) -> None:
        if self._control is not None:
            pong = m.Pong(name=self.name, pid=os.getpid(), uptime_s=time.monotonic() - self.started_mono,
                          in_flight=self.in_flight(), ping_seq=msg.seq)
            self._control.send(m.encode(pong))

    def in_flight(self) -> int:
        """What the Pong says this process holds in flight (a scheduler overrides it: its requests); -1, none."""
        return -1

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self.setup()
            self._announce_ready()
            while not self.stopping:
                self.poll_once(self.poll_timeout_ms())
        finally:
            try:
                self.teardown()
            finally:
                self.close_sockets()

    def poll_once(self, timeout_ms: int) -> None:
        """One turn of the loop: handle what arrives within ``timeout_ms``, then the tick."""
        events = dict(self.poller.poll(timeout_ms))
        for sock_or_fd in events:
            ch = self.channels.get(sock_or_fd)  # type: ignore[arg-type]
            if ch is not None:
                self._drain(ch)
            elif sock_or_fd in self._extra_fds:
                self._extra_fds[sock_or_fd]()
        self.tick(time.monotonic())

    def close_sockets(self) -> None:
        """Close every socket (``run`` does on its way out)."""
        for sock in list(self.channels):
            sock.close(0)
        if self._trace is not None:
            self._trace.close(0)
