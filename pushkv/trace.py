"""The trace mirror: what a process sends and receives, stamped and published.

Every process (actors, the router) may own one ``TracePublisher``: a PUB
socket *connected* to the deployment's trace endpoint. The supervisor binds
that endpoint with a ``TraceForwarder`` (XSUB) and republishes everything on
the tap endpoint (XPUB), so any number of taps can attach and detach while
the deployment runs, and no process ever binds, waits or blocks: a PUB send
never blocks (over the high-water mark it drops and counts), and with no tap
attached no subscription reaches the publishers, which then discard their
events before they touch a socket.

Off by default: a process without a trace endpoint has no publisher and the
actor's ``trace_msg`` returns after one ``is None`` check.

Processes that are not pushkv's (the vLLM connector's, inside vLLM's own processes) have no
trace endpoint; ``stamp`` prints their per-transfer timestamps to stderr instead, with
PUSHKV_VLLM_TIMING=1 (``python -m tools.vllm_timing LOG...`` reads them back).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter
from functools import cache
from typing import Any, Optional

import zmq

from pushkv import envs
from pushkv import messages as m
from pushkv.security import Security, secure_bind, secure_connect

log = logging.getLogger(__name__)

HOST_ENV = "PUSHKV_HOST"  # set by the supervisor for its children: the host in every trace event
TRACE_SNDHWM = 100_000  # events queued per publisher before it drops (never blocks)
TAP_SNDHWM = 1_000_000  # events queued per attached tap in the forwarder


STAMP_PREFIX = "pushkv-timing "  # a stamp's line: PREFIX <event> <transfer id> <wall time>


@cache
def stamps_on() -> bool:
    """PUSHKV_VLLM_TIMING, read once per process (at the first stamp)."""
    return envs.PUSHKV_VLLM_TIMING


def stamp(event: str, transfer_id: str) -> None:
    """One per-transfer timestamp on stderr (the vLLM server's log) when stamps are on."""
    if stamps_on():
        line = f"{STAMP_PREFIX}{event} {transfer_id} {time.time():.6f}\n"
        # one write call with its newline: the server's worker and writer share the log, and print's text and
        # newline, written apart, let another process's stamp in between (two stamps on one line)
        sys.stderr.flush()
        try:
            os.write(sys.stderr.fileno(), line.encode())
        except (AttributeError, OSError, ValueError):  # a stderr with no descriptor (captured)
            sys.stderr.write(line)
            sys.stderr.flush()


class TracePublisher:
    """A process's PUB to the trace endpoint. Not thread-safe: one per thread."""

    def __init__(self, process: str, endpoint: str, ctx: Optional[zmq.Context] = None,
                 counters: Optional[Counter] = None, security: Optional[Security] = None):
        self.process = process
        # which host's clock t_mono is (tools/trace/merge.py aligns hosts); the supervisor sets it
        self.host = envs.PUSHKV_HOST
        self.counters = counters if counters is not None else Counter()
        self.sock = (ctx or zmq.Context.instance()).socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, TRACE_SNDHWM)
        secure_connect(self.sock, endpoint, security)

    def _send(self, ev: m.TraceEvent) -> None:
        try:
            self.sock.send(m.encode(ev), zmq.NOBLOCK)
        except zmq.Again:
            self.counters["trace_dropped"] += 1

    def msg(self, direction: str, peer: str, msg: Any, data: bytes = b"") -> None:
        """A message sent to / received from ``peer``; ``data`` is its encoded form."""
        self._send(m.TraceEvent(
            t_mono=time.monotonic(), t_wall=time.time(), process=self.process, direction=direction,
            peer=peer, kind=type(msg).__name__, transfer_id=getattr(msg, "transfer_id", ""),
            payload=data, host=self.host,
        ))

    def event(self, kind: str, transfer_id: str = "", detail: str = "") -> None:
        """A local event (not a message), e.g. ``prefill_start``; ``detail`` travels in ``peer``."""
        self._send(m.TraceEvent(
            t_mono=time.monotonic(), t_wall=time.time(), process=self.process, direction="event",
            peer=detail, kind=kind, transfer_id=transfer_id, host=self.host,
        ))

    def close(self, linger: int = 0) -> None:
        self.sock.close(linger)


class TraceForwarder:
    """XSUB bound at the publishers' endpoint -> XPUB bound at the taps' endpoint.

    Runs ``zmq.proxy_steerable`` on a thread (the copy loop is libzmq's, the
    GIL is released); subscriptions flow back from taps to publishers.
    Binding happens in ``start`` on the caller's thread so a bad endpoint
    fails there; ``stop`` terminates the proxy and closes the sockets.
    """

    def __init__(self, publish_endpoint: str, tap_endpoint: str, ctx: Optional[zmq.Context] = None,
                 security: Optional[Security] = None, max_msg_bytes: int = -1):
        self.security = security
        self.max_msg_bytes = max_msg_bytes  # of one event from a publisher (it carries a message); -1: no cap
        self.publish_endpoint = publish_endpoint
        self.tap_endpoint = tap_endpoint
        self.ctx = ctx or zmq.Context.instance()
        self._thread: Optional[threading.Thread] = None
        self._ctl_addr = f"inproc://pushkv-trace-forwarder-{id(self)}"
        self._ctl: Optional[zmq.Socket] = None

    def start(self) -> None:
        xsub = self.ctx.socket(zmq.XSUB)
        xpub = self.ctx.socket(zmq.XPUB)
        ctl_in = self.ctx.socket(zmq.PAIR)
        for s in (xsub, xpub, ctl_in):
            s.setsockopt(zmq.LINGER, 0)
        xpub.setsockopt(zmq.SNDHWM, TAP_SNDHWM)
        xsub.setsockopt(zmq.MAXMSGSIZE, self.max_msg_bytes)
        xpub.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # taps send subscriptions only
        try:
            secure_bind(xsub, self.publish_endpoint, self.security)
            secure_bind(xpub, self.tap_endpoint, self.security)
            ctl_in.bind(self._ctl_addr)
        except zmq.ZMQError:
            for s in (xsub, xpub, ctl_in):
                s.close(0)
            raise
        self._ctl = self.ctx.socket(zmq.PAIR)
        self._ctl.setsockopt(zmq.LINGER, 0)
        self._ctl.connect(self._ctl_addr)

        def run() -> None:
            try:
                zmq.proxy_steerable(xsub, xpub, None, ctl_in)
            except zmq.ZMQError as e:  # context terminated under us
                log.debug("trace forwarder ended: %s", e)
            finally:
                for s in (xsub, xpub, ctl_in):
                    s.close(0)

        self._thread = threading.Thread(target=run, name="trace-forwarder", daemon=True)
        self._thread.start()
        log.info("trace forwarder: publishers -> %s, taps <- %s", self.publish_endpoint, self.tap_endpoint)

    def stop(self, timeout_s: float = 2.0) -> None:
        if self._thread is None or self._ctl is None:
            return
        try:
            self._ctl.send(b"TERMINATE")
        finally:
            self._thread.join(timeout_s)
            self._ctl.close(0)
            self._thread = None
