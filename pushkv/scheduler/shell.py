"""The scheduler process's actor: the sockets around a sans-I/O ``SchedulerCore``.

It binds the router's ROUTER socket and connects one DEALER per worker and writer rank,
decodes what arrives, hands it to the core as ``(message, Peer, now, wall)`` and sends what
the core put in its outbox, in order. Nothing here decides anything about a request.

A grammar the core asks for (``CompileGrammar``) compiles on ``CompileThreads`` (``scheduler/grammar.py``),
never on this loop; its eventfd sits in the poller, so the loop wakes as a compile ends and hands it
to the core (``core.compiled``). One the core no longer asks for (``CancelCompile``: its last request left) is
dropped if it has not started.

Started with ``faults`` (tests), it passes the outbox through ``FaultFilter`` and hands D's core
the stalls a test armed; started without, it holds no fault check.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import zmq

from pushkv import envs, limits
from pushkv import messages as m
from pushkv.actor import Actor, Channel
from pushkv.faults import Faults, kill_self
from pushkv.scheduler.core import SchedulerCore
from pushkv.scheduler.decode import DecodeScheduler
from pushkv.scheduler.fault_filter import FaultFilter
from pushkv.scheduler.grammar import CompileThreads, XgrammarCompile
from pushkv.scheduler.kv_events_pub import Publisher as KVEventsPublisher
from pushkv.scheduler.outbox import CancelCompile, CompileGrammar, Effect, Kill, Peer, Send, Trace
from pushkv.security import API_KEY_ENV

log = logging.getLogger(__name__)


class SchedulerShell(Actor):
    def __init__(self, core: SchedulerCore, faults: Optional[Faults] = None,
                 compile: Optional[Callable[[m.Structured], Any]] = None):
        cfg = core.cfg
        super().__init__(core.name, cfg.control_endpoint, cfg.trace_endpoint, cfg.secret_file,
                         limits.msg_cap_bytes(cfg), counters=core.counters)
        self.core = core
        self.front: Optional[Channel] = None
        self.worker_chs: list[Channel] = []
        self.writer_chs: list[Channel] = []
        self._peer_of: dict[Channel, Peer] = {}  # worker and writer channels: the rank they reach
        self._metrics_server: Any = None
        self.kv_events: Optional[KVEventsPublisher] = None  # --kv-events-config
        # structured output's compiles, off the loop (tests may hand in their own compile)
        self.compiles = CompileThreads(compile or XgrammarCompile(cfg.model))
        # chosen once: without faults the core's entry and its outbox are the bare ones (no per-message check)
        self.faults = faults
        self._entry: Callable[..., None] = self._into_core
        self._take_effects: Callable[[], list[Effect]] = core.take_outbox
        if faults is not None:
            fault_filter = FaultFilter(faults, core.role)
            self._entry = self._into_core_with_faults
            self._take_effects = lambda: fault_filter(core.take_outbox())

    def setup(self) -> None:
        inst = self.core.inst
        # what reaches us from outside: the router's Generate, at most the largest legal one (x2)
        cap = limits.generate_cap_bytes(self.core.cfg)
        front = self.socket(zmq.ROUTER, inst.sched_endpoint, bind=True, max_msg_bytes=cap)
        self.front = self.add_channel(front, m.DEC_ROUTER_TO_SCHED, "router", routed=True)
        for peer, ep in zip(self.core.workers, inst.worker_endpoints):
            sock = self.socket(zmq.DEALER, ep, bind=False)
            self.worker_chs.append(self._link(sock, m.DEC_WORKER_TO_SCHED, f"{inst.name}-worker", peer))
        for peer, ep in zip(self.core.writers, inst.writer_endpoints):
            sock = self.socket(zmq.DEALER, ep, bind=False)
            self.writer_chs.append(self._link(sock, m.DEC_WRITER_TO_SCHED, f"{inst.name}-writer", peer))
        self.add_fd(self.compiles.fd, self._grammars_compiled)
        self._serve_metrics()
        if self.core.cfg.kv_events.on:
            if self.core.alloc.enabled:
                self.core.alloc.journal = []
                self.kv_events = KVEventsPublisher(self, self.core.cfg, inst)
            else:
                log.info("%s: --kv-events-config asks for KV events, but this instance caches no prefix: none",
                         self.name)

    def _serve_metrics(self) -> None:
        """/metrics for the scrapers that read each model server (llm-d, Prometheus), on prometheus_client's
        HTTP server thread; it reads only the core's published snapshot and thread-safe collectors."""
        from pushkv.scheduler import metrics_http

        inst, host = self.core.inst, self.core.cfg.metrics_host()
        if not inst.metrics_port:
            return  # an unplanned config (tests of the core alone): nothing to serve on
        key = ""
        if self.core.cfg.metrics_auth:
            key = envs.get(API_KEY_ENV)
            if not key:
                raise RuntimeError(f"metrics_auth is on but {API_KEY_ENV} is not set: /metrics would be open")
        self.core.publish_metrics()
        self._metrics_server = metrics_http.serve(inst.metrics_port, host, self.core.metrics.registry, key)
        log.info("%s: /metrics on http://%s:%d/metrics%s", self.name, host, inst.metrics_port,
                 " (API key required)" if key else "")

    def _link(self, sock: zmq.Socket, decoder: Any, name: str, peer: Peer) -> Channel:
        ch = self.add_channel(sock, decoder, f"{name}-{peer.rank}")
        ch.index = peer.rank
        self._peer_of[ch] = peer
        return ch

    def in_flight(self) -> int:
        """Every request the core holds, whatever its state: a P's stays until its writers say its KV was written
        (push) or read (pull), a D's until it ends; its host's drain (--shutdown-timeout) waits for none."""
        return len(self.core.reqs)

    def teardown(self) -> None:
        self.core.shutdown(self.stop_reason)
        self._flush()
        if self.kv_events is not None:
            if self.kv_events.replay is not None:
                self.remove_fd(self.kv_events.replay)  # type: ignore[arg-type]
            self.kv_events.close()
        self.remove_fd(self.compiles.fd)
        self.compiles.close()  # a compile under way is not waited for (its thread is a daemon)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()

    # -- into the core ------------------------------------------------------------------
    def _handler(self, typ: type) -> Optional[Callable[..., Any]]:
        own = super()._handler(typ)  # the supervisor's Shutdown and Ping
        if own is not None:
            return own
        return self._entry if self.core.handles(typ) else None

    def _into_core_with_faults(self, msg: Any, identity: Optional[bytes] = None) -> None:
        if isinstance(msg, m.Generate):
            self._injected_stall(time.monotonic())
        self._into_core(msg, identity)

    def _into_core(self, msg: Any, identity: Optional[bytes] = None) -> None:
        ch = self.current
        assert ch is not None
        frm = Peer.router(identity or b"") if ch is self.front else self._peer_of[ch]
        try:
            self.core.handle(msg, frm, time.monotonic(), time.time())
        finally:  # what the core asked for before a handler failed still leaves
            self._flush()

    def on_bad_frame(self, ch: Channel, identity: Optional[bytes], reason: str, payload: bytes = b"") -> None:
        if ch is self.front and identity is not None:
            self.core.refuse_undecodable(Peer.router(identity), reason, payload)
            self._flush()

    def _grammars_compiled(self) -> None:
        for done in self.compiles.take():
            try:
                self.core.compiled(done, time.monotonic(), time.time())
            except Exception:  # as a failing handler: the loop goes on
                self.counters["handler_error"] += 1
                log.exception("%s: taking the compiled grammar failed", self.name)
            finally:
                self._flush()

    def tick(self, now: float) -> None:
        try:
            self.core.tick(now, time.time())
        finally:
            self._flush()

    def _injected_stall(self, now: float) -> None:
        """Tests: a ``delay`` armed at D's ``admit`` stalls D's admission and steps from the next
        request on (taken as it arrives, before the core sees it)."""
        if isinstance(self.core, DecodeScheduler) and self.faults is not None:
            stall = self.faults.delay("admit")
            if stall:
                self.core.stall_admission(now + stall)

    # -- out of the core ------------------------------------------------------------------
    def _flush(self) -> None:
        self.core.publish_metrics()
        if self.kv_events is not None:
            self.kv_events.publish(self.core.alloc.take_journal())
        for effect in self._take_effects():
            if isinstance(effect, Send):
                self._send_to(effect.to, effect.msg)
            elif isinstance(effect, Trace):
                self.trace_event(effect.kind, effect.transfer_id)
            elif isinstance(effect, CompileGrammar):
                self.compiles.submit(effect.spec)
            elif isinstance(effect, CancelCompile):
                self.compiles.cancel(effect.spec)
            elif isinstance(effect, Kill):
                kill_self()

    def _send_to(self, to: Peer, msg: m.Msg) -> None:
        if to.kind == "router":
            assert self.front is not None
            self.send(self.front, msg, to.identity)
        elif to.kind == "worker":
            self.send(self.worker_chs[to.rank], msg)
        else:
            self.send(self.writer_chs[to.rank], msg)
