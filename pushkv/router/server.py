"""The router process: aiohttp site, scheduler links, supervisor control.

Phases: ``start`` (links, site, Ready to the supervisor) -> serve until a
stop is requested (signal, ``Shutdown``) -> ``stop`` (refuse new requests,
let in-flight ones finish for up to ``--shutdown-timeout``, fail the rest with
503, abort their legs, free the port, close sockets).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Literal, Mapping, Optional

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from pushkv import __version__, envs, limits, otlp, security, tls, uds
from pushkv import messages as m
from pushkv.config import DeploymentConfig, Role
from pushkv.discovery.base import Watcher
from pushkv.discovery.local import LocalWatcher
from pushkv.discovery.records import InstanceDown, InstanceHealth, InstanceRecord, InstanceUp
from pushkv.framing import Drops, Shape, arecv_bounded
from pushkv.model import hub
from pushkv.router import api, auth, cors, edge, generate, otlp_spans, output, responses, text, tokenize
from pushkv.router import chat as chat_mod
from pushkv.router.balance import Balancer, drained_reason, prefix_caching
from pushkv.router.flow import RequestRun
from pushkv.router.links import SchedulerLink
from pushkv.router.loras import Loras
from pushkv.router.metrics import RouterMetrics
from pushkv.router.tasks import cancel_and_wait
from pushkv.security import secure_connect
from pushkv.seeds import derive_seed
from pushkv.trace import TracePublisher

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # in-flight handlers get this long to send their 503
# push pins D only for a prefill P is predicted to finish within this share of the wait for it
# (the rest is the cost model's margin of error)
PIN_WAIT_SHARE = 0.5
STATS_TIMEOUT_S = 0.5  # /metrics: how long to wait for each scheduler's Stats
JOIN_ANSWER_S = 5.0  # an instance found in the registry answers its first GetStats within this, or the log says so
CLIENT_ABORT_STATUS = 499  # nginx's "client closed request"
# the generation routes, each read by its own parser (Router._parser)
Route = Literal["completion", "chat", "invocation", "responses"]
PARSE_THREADS = 4  # requests parsed at once off the event loop (tokenizing and grammars run in native code)


def structured_warm() -> bool:
    """xgrammar loaded and a grammar built once, where it is installed (the structured extra); False where not."""
    try:
        from pushkv.grammars import grammar_of
        from pushkv.messages import Structured

        grammar_of(Structured("regex", "a"))
        return True
    except ImportError:
        return False


class Router:
    def __init__(self, cfg: DeploymentConfig, tokenizer: Optional[text.Tokenizer] = None,
                 watcher: Optional[Watcher] = None, api_key: Optional[str] = None):
        self.cfg = cfg
        self.watcher = watcher  # where P and D instances come from (default: the planned config)
        self.api_key = envs.PUSHKV_API_KEY if api_key is None else api_key
        if tokenizer is None:  # --skip-tokenizer-init: none loaded (prompts come as token ids, outputs have no text)
            tokenizer = text.NoTokenizer() if cfg.skip_tokenizer_init else text.load_tokenizer(cfg.model)
        self.tokenizer = tokenizer
        self.limits = api.Limits(
            vocab_size=cfg.model.vocab_size,
            max_model_len=cfg.max_model_len or cfg.model.max_position,
            eos_token_ids=cfg.model.all_eos_ids,
            defaults=cfg.model.sampling_defaults,
            main_eos_id=getattr(tokenizer, "config_eos_id", -1),
            force_usage=cfg.force_include_usage, token_ids=cfg.return_tokens_as_token_ids,
        )
        # what a request's "model" may name: the model's names, then each LoRA adapter's (vLLM's --lora-modules)
        self.loras = Loras(cfg, self._served_changed)  # LoRA adapters: the launch's, and those loaded since
        self._joins: set[asyncio.Task] = set()  # instances joining, taking the LoRA changes since the launch
        self.served = cfg.served_names() + self.loras.names
        self.load = 0  # HTTP generation requests in flight (vLLM's server load, GET /load)
        # /v1/responses answers kept for previous_response_id and GET /v1/responses/ID (router/responses.py)
        kept = envs.PUSHKV_RESPONSES_STORE
        self.responses_store: Optional[responses.Store] = responses.Store(kept) if kept > 0 else None
        # background responses generating now (their tasks), and the event logs of the streamed ones (the latest
        # PUSHKV_RESPONSES_STORE, for GET ?stream=true; router/responses.py)
        self.background: dict[str, asyncio.Task] = {}
        self.background_logs: "OrderedDict[str, responses.BackgroundLog]" = OrderedDict()
        # a request's parse (chat template, tokenizing, a structured-output grammar's check) runs here, not on the
        # event loop, so a long prompt or a large JSON schema holds no other request's stream
        self._parse_pool = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="router-parse")
        self.structured_ready = False  # xgrammar loaded (PUSHKV_WARM_GRAMMARS, after start; /health says it)
        self._warm_task: Optional[asyncio.Task] = None
        self._refresh_task: Optional[asyncio.Task] = None  # --enable-ssl-refresh
        self._local_site: Optional[web.UnixSite] = None  # router.sock in the run dir
        # this router's epoch: a restarted router's is newer, and the schedulers abort the legs of
        # the one before (messages.RouterEpoch)
        self.epoch = time.time_ns()
        # where this router serves: its restart serves there too; a router elsewhere (a second replica, a rolling
        # update's new pod) is another router, whose epoch must not abort our requests
        # (--advertise first: a router pod binds 0.0.0.0, as every other replica does)
        self.place = cfg.uds or f"{cfg.advertise or cfg.host}:{cfg.port}"
        self.metrics = RouterMetrics(cfg.mode, cfg.pull_read)
        self.security = security.load(cfg.secret_file)  # CURVE to tcp:// schedulers
        caching = prefix_caching(cfg)
        t = cfg.timeouts  # a pinned D waits this long for the WRITE, and P for its own prefill
        self.balancer = Balancer(cfg.mode, cfg.push_pin_fraction, cfg.router_queue, self.metrics,
                                 prefix_cache=caching["prefill"], decode_cache=caching["decode"],
                                 conditional=cfg.conditional_disagg,
                                 pin_wait_ms=PIN_WAIT_SHARE * 1000 * min(t.registration_wait_s, t.write_wait_s))
        self.metrics.watch_balancer(self.balancer)
        self.ctx: Optional[zmq.asyncio.Context] = None
        self.local_link: Optional[SchedulerLink] = None
        self.tracer: Optional[TracePublisher] = None
        self.otlp: Optional[otlp.Exporter] = None  # --otlp-traces-endpoint
        self.runs: dict[str, RequestRun] = {}
        self.stopping = False
        self.drain_s = cfg.shutdown_timeout_s  # --shutdown-timeout: how long the stop lets requests in flight finish
        self.url = ""
        self.started_mono = time.monotonic()
        self.started_wall = time.time()
        self.chat_template: Optional[chat_mod.ChatTemplate] = None  # loaded on the first chat request
        self._template_read = False  # (a checkpoint with no template is read once too)
        self._runner: Optional[web.AppRunner] = None
        self._control: Optional[zmq.asyncio.Socket] = None
        self._control_task: Optional[asyncio.Task] = None
        self._events_task: Optional[asyncio.Task] = None
        self._stop_requested: Optional[asyncio.Event] = None
        self._stopped: Optional[asyncio.Event] = None
        self._handlers_idle: Optional[asyncio.Event] = None  # no run open and no request's body being read or parsed
        self._reading = 0  # requests whose body is being read or parsed (not runs yet): the stop waits for them too

    # -- lifecycle ------------------------------------------------------
    def app(self) -> web.Application:
        refused = self.metrics.auth_refused.inc
        c = self.cfg
        policy = cors.Policy(c.cors_origins, c.cors_methods, c.cors_headers, c.cors_credentials)
        # a browser's preflight is answered before the API key's check, as vLLM's CORS middleware answers it
        app = web.Application(middlewares=[cors.middleware(policy), _json_errors,
                                           auth.middleware(self.api_key, refused, self.cfg.metrics_auth, c.root_path)],
                              client_max_size=limits.http_body_bytes(self.cfg))
        app.on_response_prepare.append(cors.on_prepare(policy))
        routes = [
            ("POST", "/v1/completions", self.handle_completions),
            ("POST", "/v1/chat/completions", self.handle_chat),
            ("POST", "/v1/responses", self.handle_responses),
            ("GET", "/v1/responses/{response_id}", self.handle_response_get),
            ("DELETE", "/v1/responses/{response_id}", self.handle_response_delete),
            ("POST", "/v1/responses/{response_id}/cancel", self.handle_response_cancel),
            ("GET", "/v1/models", self.handle_models),
            ("GET", "/health", self.handle_health),
            ("GET", "/metrics", self.handle_metrics),
            ("POST", "/v1/abort/{request_id}", self.handle_abort),
            # vLLM's server's own: tokenize and detokenize as the router does, its version, and SageMaker's ping
            ("POST", "/tokenize", self.handle_tokenize),
            ("POST", "/detokenize", self.handle_detokenize),
            ("GET", "/version", self.handle_version),
            ("GET", "/ping", self.handle_ping),
            ("POST", "/ping", self.handle_ping),
            ("POST", "/invocations", self.handle_invocations),
            ("GET", "/load", self.handle_load),
            ("POST", "/reset_prefix_cache", self.handle_reset_prefix_cache),
        ]
        if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:  # as vLLM's: these paths are served only when asked for
            routes += [("POST", "/v1/load_lora_adapter", self.handle_load_lora),
                       ("POST", "/v1/unload_lora_adapter", self.handle_unload_lora)]
        # behind a proxy that serves the API under a prefix (vLLM's --root-path): each route also under it, for a
        # proxy that passes the prefix on, as vLLM's server takes both
        for root in ("", c.root_path) if c.root_path else ("",):
            for method, path, handler in routes:
                app.router.add_route(method, root + path, handler)
        return app

    @property
    def links(self) -> dict[str, SchedulerLink]:
        """Every scheduler link, by engine id."""
        if self.local_link is not None:
            return {self.cfg.local.engine_id or "local": self.local_link}
        return dict(self.balancer.links)

    def _make_link(self, rec: InstanceRecord) -> SchedulerLink:
        if not rec.sched_endpoint:
            raise ValueError(f"{rec.role} instance {rec.engine_id} has no sched_endpoint")
        name = next((i.name for i in self.cfg.role_instances(rec.role) if i.engine_id == rec.engine_id), rec.role)
        link = SchedulerLink(self.ctx, rec.role, rec.sched_endpoint, self._route, self.metrics, self.tracer,
                             engine_id=rec.engine_id, name=name, security=self.security)
        link.start(self.epoch, self.place)
        return link

    async def start(self) -> None:
        self._stop_requested = asyncio.Event()
        self._stopped = asyncio.Event()
        self._handlers_idle = asyncio.Event()
        self._handlers_idle.set()
        self.ctx = zmq.asyncio.Context()
        # every socket of ours (scheduler links, control, the local watcher's SUB) caps what it
        # accepts at the deployment's largest legal message (pushkv.limits)
        self.ctx.setsockopt(zmq.MAXMSGSIZE, limits.msg_cap_bytes(self.cfg))
        if self.cfg.trace_endpoint:
            self.tracer = TracePublisher("router", self.cfg.trace_endpoint, security=self.security)
        if self.cfg.otlp_traces_endpoint:
            self.otlp = otlp.Exporter(self.cfg.otlp_traces_endpoint, self.served[0] if self.served else "pushkv")
        if self.cfg.mode == "local":
            endpoint = self.cfg.local.sched_endpoint
            if not endpoint:
                raise ValueError("local instance has no sched_endpoint")
            self.local_link = SchedulerLink(self.ctx, "local", endpoint, self._route, self.metrics, self.tracer,
                                            engine_id=self.cfg.local.engine_id, security=self.security)
            self.local_link.start(self.epoch, self.place)
            if self.cfg.model.lora.enabled and self.cfg.events_endpoint and self.watcher is None:
                # the local instance back after a restart takes the LoRA changes since the launch
                self.watcher = LocalWatcher(self.cfg, self.ctx, self.security, local=True)
        else:
            if self.watcher is None:
                self.watcher = LocalWatcher(self.cfg, self.ctx, self.security)
            for rec in self.watcher.snapshot():
                self.balancer.add(rec, self._make_link)
        # the client-disconnect path relies on aiohttp cancelling the handler
        # the HTTP edge (router/edge.py): the keep-alive timer bounds a request's headers too
        fds_before, fds = edge.raise_fd_limit()
        cap = edge.connection_cap(self.cfg.router_max_connections, fds)
        edge.quiet_noisy_loggers()
        self._runner = web.AppRunner(
            self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S,
            keepalive_timeout=self.cfg.router_header_timeout_s)
        await self._runner.setup()
        # the listen backlog holds a burst of connections up to the in-flight bound (which answers
        # the rest 429): at aiohttp's 128, 400 clients connecting at once got 53 connection resets
        # (the kernel clips it at net.core.somaxconn)
        site = edge.CappedSite(self._runner, self.cfg.host, self.cfg.port, cap,
                               self.metrics.connections_refused.inc,
                               backlog=max(edge.BACKLOG, self.cfg.router_max_in_flight),
                               ssl_context=(ssl_ctx := tls.server_context(self.cfg)), path=self.cfg.uds)
        await site.start()
        await self._serve_run_dir()
        if self.cfg.ssl_refresh and ssl_ctx is not None:
            self._refresh_task = asyncio.get_running_loop().create_task(self._refresh_tls(tls.Refresher(self.cfg,
                                                                                                      ssl_ctx)))
        log.info("HTTP edge: open-file limit %d (was %d), at most %d connections, headers within %.0fs, "
                 "a body within %.0fs", fds, fds_before, cap, self.cfg.router_header_timeout_s,
                 self.cfg.router_body_timeout_s)
        self.url = tls.router_url(self.cfg, 0 if self.cfg.uds else self._runner.addresses[0][1])
        log.info("router (%s mode) listening on %s%s", self.cfg.mode, self.url,
                 " (API key required on /v1/*)" if self.api_key else "")
        if self.watcher is not None:
            self._events_task = asyncio.get_running_loop().create_task(self._discovery_loop())
        if self.cfg.control_endpoint:
            await self._announce_ready()
        if envs.PUSHKV_WARM_GRAMMARS:  # xgrammar (about 1.5 s to load) on a parse thread, so that no structured-output
            # request's check waits for it; a request that comes first waits for it there, as it would have anyway
            self._warm_task = asyncio.get_running_loop().create_task(self._warm_grammars())

    async def _warm_grammars(self) -> None:
        self.structured_ready = await self._off_loop(structured_warm)

    async def _discovery_loop(self) -> None:
        """Instances come and go through the watcher. One that goes down is chosen no more,
        and the requests with a leg on it fail at once (instead of at their timeout)."""
        try:
            async for ev in self.watcher.events():
                if isinstance(ev, InstanceUp) and self.local_link is not None:  # local mode: no balancer
                    if self.loras.catch_up():
                        self._bring_in(ev.record.engine_id)
                elif isinstance(ev, InstanceUp) and ev.record.draining:
                    self._instance_draining(ev.record)
                elif isinstance(ev, InstanceUp):
                    known = self.balancer.loads.get(ev.record.engine_id)
                    came_back = known is not None and not known.up  # read before add() marks it up
                    if known is None or not known.up:
                        catch_up = bool(self.loras.catch_up())  # LoRA adapters loaded or unloaded since the launch
                        # another host's: chosen once its scheduler answers over the link (a host with another
                        # --secret-file refuses our CURVE handshake without a word, and every request placed on
                        # it would wait out its transfer's bounds)
                        answer_first = bool(self.cfg.registry)
                        self.balancer.add(ev.record, self._make_link, fresh=bool(self.cfg.registry),
                                          joining=catch_up or answer_first)
                        if catch_up or answer_first:
                            self._bring_in(ev.record.engine_id, answer_first)
                    if came_back and self.cfg.registry:
                        # back in the registry = restarted (its host drops its work when its lease
                        # lapses): peers forget the old incarnation and handshake afresh
                        self._tell_peers(ev.record.engine_id, ev.record.role, "rejoined (a new incarnation)")
                elif isinstance(ev, InstanceDown):
                    self._instance_down(ev)
                elif isinstance(ev, InstanceHealth) and self.local_link is None:
                    if self.balancer.health(ev.engine_id, ev.healthy) is not None:
                        (log.info if ev.healthy else log.warning)(
                            "%s instance %s %s: %s", ev.role, ev.engine_id,
                            "healthy again" if ev.healthy else "unhealthy, chosen only where no other is", ev.reason)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("discovery watcher failed")

    def _bring_in(self, engine_id: str, answer_first: bool = False) -> None:
        """A joining instance takes the LoRA changes since the launch, then is chosen (router/loras.py). In local mode
        (no balancer) the one instance, back after a restart: a request naming one of the changes before it has taken
        them is refused by the instance as not served (404). ``answer_first``: not before its scheduler has answered
        a GetStats over the link (``_answers``)."""
        if self.local_link is not None:
            link, ready, joining = self.local_link, (lambda: True), (lambda: True)
        else:
            join, link = self.balancer.joining[engine_id], self.balancer.links[engine_id]

            def ready() -> bool:
                return self.balancer.ready(engine_id, join)

            def joining() -> bool:
                return self.balancer.joining.get(engine_id) == join

        async def bring() -> None:
            if answer_first and not await self._answers(engine_id, link, joining):
                return
            why = await self.loras.bring_in(engine_id, link, ready, joining)
            if why:
                log.error("instance %s did not take the LoRA changes since the launch (not chosen until it joins "
                          "again; in local mode its requests through them are refused): %s", engine_id, why)

        task = asyncio.get_running_loop().create_task(bring())
        self._joins.add(task)
        task.add_done_callback(self._joins.discard)

    async def _answers(self, engine_id: str, link, joining: Callable[[], bool]) -> bool:
        """Whether the joining instance's scheduler answers a GetStats over ``link`` before it leaves the join (False:
        it went down, or joined again). One that does not answer within JOIN_ANSWER_S is named in the log once, and
        asked again until it answers: a host that holds another --secret-file (its scheduler logs and counts each
        refusal as curve_refused), or whose address does not reach back from here, is never chosen."""
        loop = asyncio.get_running_loop()
        said = False
        while joining():
            t0 = loop.time()
            if await link.get_stats(JOIN_ANSWER_S) is not None:
                if said:
                    log.info("instance %s answers now", engine_id)
                return True
            if not joining():
                break
            if not said:
                rec = self.balancer.records.get(engine_id)
                log.error("%s instance %s does not answer on %s within %.0f s: not chosen until it does (a host with "
                          "another --secret-file refuses our CURVE handshake: its log counts curve_refused; or its "
                          "address does not reach back from here)", link.role, engine_id,
                          rec.sched_endpoint if rec is not None else "?", JOIN_ANSWER_S)
                said = True
            await asyncio.sleep(max(0.0, JOIN_ANSWER_S - (loop.time() - t0)))  # a full send queue fails at once
        return False

    def _instance_draining(self, rec: InstanceRecord) -> None:
        """The instance's host stops with --shutdown-timeout: chosen for nothing new from now; the requests with a leg
        on it go on (its host stops once they have ended, or at its timeout, and leaves the registry then).

        One this router never linked (it started while the host drains) is linked all the same, and never chosen: its
        scheduler hears our epoch and drops the requests a router before us at this place left running (their
        clients went with it), where the drain would wait them out, decoding for no one, up to its timeout; and its
        leaving tells the other role's instances, as any loss does."""
        if unknown := rec.engine_id not in self.balancer.loads:
            self.balancer.add(rec, self._make_link, fresh=True, draining=True)
        if unknown or self.balancer.draining(rec) is None:
            return
        held = len([run for run in self.runs.values() if run.req.holds(rec.role, rec.engine_id)])
        log.info("%s instance %s draining (its host stops, --shutdown-timeout): chosen for no new request; %d "
                 "request(s) with a leg on it go on", rec.role, rec.engine_id, held)

    def _instance_down(self, ev: InstanceDown) -> None:
        load = self.balancer.loads.get(ev.engine_id)
        was_draining = load is not None and load.up and load.draining
        if self.balancer.down(ev.engine_id) is None:
            return
        role, reason = ev.role, drained_reason(ev.reason) if was_draining else ev.reason
        hit = [run for run in self.runs.values() if run.req.holds(role, ev.engine_id)]
        (log.info if was_draining and not hit else log.error)(
            "%s instance %s down (%s): failing %d request(s) with a leg on it", role, ev.engine_id, reason, len(hit))
        self.metrics.instance_down(role, ev.engine_id, ev.reason, len(hit))
        for run in hit:
            run.inject_failure(503, f"{role} instance failed: {reason}; retry", "failed")
        if self.cfg.registry:  # across hosts no supervisor tells the survivors: we do
            self._tell_peers(ev.engine_id, role, reason)

    def _tell_peers(self, engine_id: str, role: Role, reason: str) -> None:
        """``PeerLost`` to every live instance of the other role (their writers end transfers
        with it at once; their blocks come back without waiting for a deadline)."""
        other = "decode" if role == "prefill" else "prefill"
        for eid in self.balancer.live(other):
            try:
                self.balancer.links[eid].send(m.PeerLost(engine_id, role, reason))
            except Exception as e:  # its own death is news of its own
                log.error("PeerLost to %s failed: %s", eid, e)

    async def _announce_ready(self) -> None:
        self._control = self.ctx.socket(zmq.DEALER)
        self._control.setsockopt(zmq.LINGER, 0)
        secure_connect(self._control, self.cfg.control_endpoint, self.security)
        self._control_shape, self._control_drops = Shape.of(self._control), Drops("router")
        ready = m.Ready(name="router", pid=os.getpid(), url=self.url)
        await self._control.send(m.encode(ready))
        self._control_task = asyncio.get_running_loop().create_task(self._control_loop())

    async def _control_loop(self) -> None:
        while True:
            frames, why, n, nbytes = await arecv_bounded(self._control, self._control_shape)
            if frames is None:
                self._control_drops.drop("supervisor", why, n, nbytes, self._control_shape)
                continue
            payload = frames[-1]
            try:
                msg = m.DEC_CONTROL.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.error("undecodable control frame: %s", e)
                continue
            if isinstance(msg, m.Shutdown):
                self.shutdown_asked(msg.reason)
            elif isinstance(msg, m.Ping):
                pong = m.Pong(name="router", pid=os.getpid(), uptime_s=time.monotonic() - self.started_mono,
                              ping_seq=msg.seq)
                await self._control.send(m.encode(pong))
            else:
                log.error("unexpected control message %s", type(msg).__name__)

    def shutdown_asked(self, reason: str) -> None:
        """The supervisor's ``Shutdown``. A restart (``pushkv`` control's ``restart router``) drains nothing: the
        supervisor kills a child it restarts at --stop-timeout, which a drain of --shutdown-timeout would outlast,
        and the streams in flight would then end with no answer at all; they end with 503 at once instead, as without
        the flag. The deployment's stop drains."""
        log.info("shutdown requested by supervisor (%s)", reason)
        if reason == "restart":
            self.drain_s = 0.0
        self.request_stop()

    def request_stop(self) -> None:
        """Signal-safe: only sets a flag that ``run_until_stopped`` acts on."""
        if self._stop_requested is not None:
            self._stop_requested.set()

    async def _serve_run_dir(self) -> None:
        """The same routes, plain HTTP, on ``router.sock`` in the run dir (0700: this user's processes only), for
        this host's own tools: ``pushkv status`` reads the router's health there whatever the public edge asks
        (HTTPS with client certificates, a Unix socket of its own, a root path). The API key still guards /v1/*."""
        path = uds.run_dir_socket(self.cfg.run_dir)
        if not path or len(path.encode()) > uds.MAX_PATH_BYTES:
            return
        if os.path.exists(path):
            os.unlink(path)  # a router of this run dir that died: the run dir is this deployment's alone
        self._local_site = web.UnixSite(self._runner, path)
        await self._local_site.start()
        os.chmod(path, 0o600)

    async def _refresh_tls(self, refresher: tls.Refresher) -> None:
        """--enable-ssl-refresh: the certificate files looked at every ``tls.REFRESH_S``, taken again as they
        change (a few stat calls a second; the load itself only on a change)."""
        while True:
            await asyncio.sleep(tls.REFRESH_S)
            refresher.check()

    async def run_until_stopped(self) -> None:
        await self._stop_requested.wait()
        await self.stop()

    async def stop(self) -> None:
        if self.stopping:
            await self._stopped.wait()
            return
        self.stopping = True  # from here new requests get 503 and /health 503: a balancer takes us out
        if self.drain_s > 0 and (self.runs or self._reading):  # --shutdown-timeout: vLLM's drain
            log.info("router draining: %d request(s) in flight have up to %.0f s to finish (--shutdown-timeout)",
                     len(self.runs), self.drain_s)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._handlers_idle.wait(), self.drain_s)
        log.info("router stopping: %d request(s) in flight", len(self.runs))
        for run in list(self.runs.values()):
            run.inject_failure(503, "router shutting down", "shutdown")
        try:
            await asyncio.wait_for(self._handlers_idle.wait(), SHUTDOWN_GRACE_S)
        except asyncio.TimeoutError:
            log.warning("%d request(s) still in flight at shutdown", len(self.runs))
        if self.background:  # their choices failed above: each ends, keeping its response failed
            await asyncio.wait(list(self.background.values()), timeout=SHUTDOWN_GRACE_S)
        if self._runner is not None:
            await self._runner.cleanup()  # closes the listening sockets
        if self._local_site is not None:
            with contextlib.suppress(OSError):
                os.unlink(uds.run_dir_socket(self.cfg.run_dir))
        self._parse_pool.shutdown(wait=False, cancel_futures=True)
        self.loras.close()  # unloads still waiting for their requests: the instances stop too
        await cancel_and_wait((self._control_task, self._events_task, self._warm_task, self._refresh_task,
                               *self._joins))
        if self.watcher is not None:
            await self.watcher.close()
        for link in self.links.values():
            await link.close()
        if self._control is not None:
            self._control.close(0)
        if self.tracer is not None:
            self.tracer.close()
        if self.otlp is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.otlp.close)
        self.ctx.term()
        self._stopped.set()
        log.info("router stopped")

    # -- routing ------------------------------------------------------------
    def _route(self, role: Role, msg: m.Msg) -> None:
        run = self.runs.get(getattr(msg, "transfer_id", ""))
        if run is None:
            self.metrics.unrouted.labels(role=role).inc()
            log.debug("%s from %s for no in-flight request transfer_id=%s",
                      type(msg).__name__, role, getattr(msg, "transfer_id", ""))
            return
        run.deliver(role, msg)

    # -- handlers -------------------------------------------------------------
    async def handle_health(self, request: web.Request) -> web.Response:
        ok = bool(self.links) and not self.stopping
        body = {"status": "ok" if ok else "unavailable", "mode": self.cfg.mode,
                "pull_read": self.cfg.pull_read, "push_stream": self.cfg.push_stream, "in_flight": len(self.runs),
                "queued": self.balancer.waiting,
                "instances": [{"engine_id": e, "role": l.role, "up": l.up, "healthy": l.healthy,
                               "draining": l.draining, "legs": l.legs,
                               "queued_prefill_tokens": l.queued_tokens, "blocks_committed": l.committed,
                               "blocks_pinned": l.pinned, "num_blocks": l.num_blocks}
                              for e, l in sorted(self.balancer.loads.items())],
                "conditional_disagg": self.cfg.conditional_disagg, "push_pin_fraction": self.cfg.push_pin_fraction,
                "structured_ready": self.structured_ready,
                "costs": self.balancer.cost.costs.as_dict() if self.local_link is None else {}}
        return web.json_response(body, status=200 if ok else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        # what only the instances know (blocks, transfers, leases, writers): asked now
        links = list(self.links.values())
        stats = await asyncio.gather(*(link.get_stats(STATS_TIMEOUT_S) for link in links))
        self.metrics.update_instances({(link.role, link.engine_id): st for link, st in zip(links, stats)})
        data, content_type = self.metrics.render()
        return web.Response(body=data, headers={"Content-Type": content_type})

    async def handle_reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's POST /reset_prefix_cache: every instance forgets its cached prefixes (running requests keep their
        blocks) and the router its map of them; 200 once every scheduler answered, else 503 naming those that did
        not. Behind --api-key where one is set."""
        links = list(self.links.values())
        answers = await asyncio.gather(*(link.reset_prefix_cache(STATS_TIMEOUT_S) for link in links))
        if self.local_link is None:
            self.balancer.reset_index()
        silent = [link.engine_id for link, st in zip(links, answers) if st is None]
        # vLLM 0.32's answer is {"success": bool}; each instance's cache after it comes beside it
        body = {"success": True,
                "reset": [{"engine_id": link.engine_id, "role": link.role, "cached_blocks": st.cached_blocks}
                          for link, st in zip(links, answers) if st is not None]}
        if silent:
            return _error(503, f"no answer from {', '.join(silent)}: their caches may be kept", "unavailable")
        return web.json_response(body)

    async def handle_abort(self, request: web.Request) -> web.Response:
        rid = request.match_info["request_id"]
        tid = output.transfer_id_of(rid)  # the response's id, the transfer id, or the client's own (as it sent it,
        hit = [run for t, run in self.runs.items()  # or the response's): never "", which a request without one has
               if tid and (t == tid or t.startswith(tid + "-")) or run.client_id and run.client_id in (rid, tid)]
        if not hit:
            return _error(404, f"no in-flight request {rid!r}", "not_found")
        for run in hit:
            run.inject_failure(CLIENT_ABORT_STATUS, "aborted via /v1/abort", "aborted")
        return web.json_response({"id": rid, "aborted": True})

    async def handle_models(self, request: web.Request) -> web.Response:
        names = self.cfg.served_model_name or (self.cfg.model.name,)
        created = int(self.started_wall)
        model = self.cfg.model  # root: the --model string, as vLLM's; a repo id's, not its snapshot in the Hub cache
        root = model.name if not model.checkpoint or hub.is_repo_id(model.name) else model.checkpoint
        cards: list[dict[str, Any]] = [{"id": name, "object": "model", "created": created, "owned_by": "pushkv",
                  "root": root, "parent": None,
                  "max_model_len": self.limits.max_model_len} for name in names]
        cards += self.loras.cards(created, self.limits.max_model_len, names[0])
        for card in cards:  # vLLM's ModelCard carries one ModelPermission, as OpenAI's did
            card["permission"] = [model_permission(card["id"], created)]
        return web.json_response({"object": "list", "data": cards})

    def _served_changed(self) -> None:
        self.served = self.cfg.served_names() + self.loras.names

    async def handle_load_lora(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"} (router/loras.py)."""
        body = await self._json_body(request)
        if isinstance(body, web.Response):
            return body
        return await self.loras.load(body, self.served, self._live_links(), self._off_loop)

    async def handle_unload_lora(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/unload_lora_adapter {"lora_name"} (router/loras.py)."""
        body = await self._json_body(request)
        if isinstance(body, web.Response):
            return body
        return await self.loras.unload(body, self._live_links, self._names_adapter)

    def _names_adapter(self, name: str) -> bool:
        """Whether a request in flight runs through the adapter ``name`` (its unload waits for them)."""
        return any(run.lora == name for run in self.runs.values())

    def _live_links(self) -> list[SchedulerLink]:
        """The links of the instances up now (one down, or joining, takes the changes as it joins); local mode's
        one instance."""
        if self.local_link is not None:
            return [self.local_link]
        return [lk for eid, lk in self.links.items() if self.balancer.loads[eid].up]

    async def _json_body(self, request: web.Request):
        """The request's JSON object, read within the body timeout as every other body is; else the error's answer."""
        try:
            return api.parse_json(await edge.read_body(request, self.cfg.router_body_timeout_s))
        except api.ApiError as e:
            return web.json_response(e.body(), status=e.status)

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def handle_responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API, as vLLM serves it, over the chat path (router/responses.py)."""
        return await self._generate(request, "responses")

    def _response_request(self, body: dict) -> api.CompletionParams:
        """A /v1/responses body's request: its chat request parsed as /v1/chat/completions parses one; kept when it
        ends where the router keeps responses and the request did not say ``store: false``."""
        store = self.responses_store
        conv = responses.conversation(body, store)
        params = self._parser("chat")(responses.chat_body(body, store, conv))
        keep = store is not None and body.get("store") is not False
        if body.get("background") and not keep:
            raise api.bad("background", "background: a background response is kept to be fetched, so it needs store "
                                        "(not store: false, and a router that keeps responses: PUSHKV_RESPONSES_STORE)")
        params.responses = {**responses.echo(body), "store": keep}
        if keep:
            params.keep_response = functools.partial(store.keep, conversation=conv)
        return params

    async def handle_response_get(self, request: web.Request) -> web.StreamResponse:
        """A kept response (``responses.Store``), or 404; with ``stream=true`` a streamed background response's
        events again, from the one after ``starting_after`` on."""
        rid = request.match_info["response_id"]
        got = self.responses_store.get(rid) if self.responses_store is not None else None
        if got is None:
            return _error(404, f"no response {rid!r} is kept", "invalid_request_error")
        if request.query.get("stream", "false").lower() != "true":
            return web.json_response(got)
        events = self.background_logs.get(rid)
        if events is None:
            return _error(400, f"stream: response {rid!r} was not made with background and stream, so it has no "
                               "events kept to stream again", "invalid_request_error")
        try:
            after = int(request.query.get("starting_after", "-1"))
        except ValueError:
            return _error(400, "starting_after: a sequence number (an integer)", "invalid_request_error")
        return await self._stream_log(request, events, after)

    async def _stream_log(self, request: web.Request, events: responses.BackgroundLog,
                          after: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            async for kind, body in events.follow(after):
                await resp.write(output.sse_event(kind, body))
            await resp.write_eof()
        except ConnectionError:  # the client went: the response generates on (it is a background one)
            pass
        return resp

    async def handle_response_cancel(self, request: web.Request) -> web.Response:
        """A background response still generating stopped (``cancelled``; its choices aborted and their blocks
        freed); a kept one that is not generating is a 400, an unknown one a 404."""
        rid = request.match_info["response_id"]
        got = self.responses_store.get(rid) if self.responses_store is not None else None
        if got is None:
            return _error(404, f"no response {rid!r} is kept", "invalid_request_error")
        task = self.background.get(rid)
        if task is None:
            return _error(400, f"response {rid!r} is {got['status']}: only a background response still generating "
                               "is cancelled", "invalid_request_error")
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        assert self.responses_store is not None
        return web.json_response(self.responses_store.get(rid) or got)

    async def handle_response_delete(self, request: web.Request) -> web.Response:
        """A kept response forgotten, or 404."""
        rid = request.match_info["response_id"]
        if self.responses_store is None or not self.responses_store.delete(rid):
            return _error(404, f"no response {rid!r} is kept", "invalid_request_error")
        return web.json_response({"id": rid, "object": "response", "deleted": True})

    async def handle_load(self, request: web.Request) -> web.Response:
        """vLLM's server load: the generation requests this router is serving now (each counted once, whatever its
        n); vLLM counts them with --enable-server-load-tracking, the router always."""
        return web.json_response({"server_load": self.load})

    async def handle_invocations(self, request: web.Request) -> web.StreamResponse:
        """SageMaker's inference route, as vLLM serves it: a body with messages is a chat completion, one with a
        prompt a completion (each then read as its own route reads it, on the parse threads like them)."""
        return await self._generate(request, "invocation")

    def _invocation(self, body: dict) -> api.CompletionParams:
        """An /invocations body's request: its route chosen by its fields."""
        if "messages" in body and self.cfg.skip_tokenizer_init:
            return _untemplated("messages", body)
        if "messages" in body:
            return self._parser("chat")(body)
        if "prompt" in body:
            return self._parser("completion")(body)
        raise api.bad("messages", "/invocations takes a chat completion (messages) or a completion (prompt)")

    def _parser(self, route: Route) -> Callable[[dict], api.CompletionParams]:
        """What reads a body of ``route`` into its request (on a parse thread)."""
        if self.cfg.skip_tokenizer_init and route in ("chat", "responses"):
            return functools.partial(_untemplated, "messages" if route == "chat" else "input")
        if route == "invocation":  # the body says which
            return self._invocation
        if route == "responses":
            return self._response_request
        if route == "completion":
            return functools.partial(api.parse_completion, tok=self.tokenizer, limits=self.limits)
        return functools.partial(chat_mod.parse_chat, tok=self.tokenizer, limits=self.limits,
                                 template=self._template(), reasoning_parser=self.cfg.reasoning_parser,
                                 tool_call_parser=self.cfg.tool_call_parser)

    def _reported(self, model: str) -> str:
        """The model a response names, as vLLM's: a LoRA adapter's name where the request asked for one, else the
        first --served-model-name, whichever of the served names (or none) the request gave."""
        return model if self.loras.of(model) else self.served[0]

    def _template(self) -> chat_mod.ChatTemplate:
        """The deployment's chat template, loaded on first use; a 400 as vLLM's where the tokenizer has none."""
        if not self._template_read:
            try:
                # the tokenizer's directory holds the template (--tokenizer, or --load-format dummy)
                self.chat_template = chat_mod.load_template(self.cfg.model.tokenizer or self.cfg.model.checkpoint,
                                                            self.cfg.chat_template)
            except (OSError, ValueError) as e:
                raise api.ApiError(500, f"no usable chat template: {e}", "server_error") from None
            self._template_read = True
        if self.chat_template is None:
            raise api.ApiError(400, chat_mod.NO_TEMPLATE)
        return self.chat_template

    async def handle_tokenize(self, request: web.Request) -> web.Response:
        return await self._answer(request, lambda body: tokenize.tokenize(body, self.tokenizer, self.limits,
                                                                           self._template))

    async def handle_detokenize(self, request: web.Request) -> web.Response:
        return await self._answer(request, lambda body: tokenize.detokenize(body, self.tokenizer, self.limits))

    async def _answer(self, request: web.Request, answer: Callable[[dict], dict]) -> web.Response:
        """A JSON body's answer, computed here (nothing reaches an instance); its model checked as a request's."""
        if self.cfg.skip_tokenizer_init:
            return _error(400, f"{request.path}: the router has no tokenizer (--skip-tokenizer-init)",
                          "invalid_request_error")
        try:
            body = api.parse_json(await edge.read_body(request, self.cfg.router_body_timeout_s))
            api.check_model(body, self.served)
            return web.json_response(await self._off_loop(answer, body))
        except api.ApiError as e:
            return web.json_response(e.body(), status=e.status)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the parse threads; its exception raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._parse_pool, functools.partial(fn, *args))

    async def handle_version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def handle_ping(self, request: web.Request) -> web.Response:
        """SageMaker's health check, as vLLM answers it: 200 while the router can serve, else 503."""
        ok = bool(self.links) and not self.stopping
        return web.Response(status=200 if ok else 503)

    async def _generate(self, request: web.Request, route: Route) -> web.StreamResponse:
        arrival = time.monotonic()
        if self.stopping:
            return generate.refusal(503, "router shutting down")
        # counted until it is a run (or refused): the stop waits for it, since once aiohttp's shutdown has begun it
        # reads no more of a connection's bytes, and a body still on its way would never come
        self._reading += 1
        self._handlers_idle.clear()
        try:
            body = await edge.read_body(request, self.cfg.router_body_timeout_s)
            params = await self._off_loop(api.parse_request, body, self.served, self._parser(route))
            if self.cfg.skip_tokenizer_init:
                api.check_untokenized(params)
            header = request.headers.get("X-Request-Id")  # over the body's request_id, as vLLM's
            if header is not None:
                params.client_id = api.client_id(header, "X-Request-Id")
        except api.ApiError as e:
            self.metrics.requests.labels(outcome="rejected").inc()
            return web.json_response(e.body(), status=e.status)
        finally:
            self._reading -= 1
            self._maybe_idle()
        if self.stopping:  # the stop began while its body was read or parsed: a new request, refused as one
            return generate.refusal(503, "router shutting down")
        try:  # its LoRA adapter unloaded while its body was parsed: not served (not the base model in its place)
            api.check_model({"model": params.model}, self.served)
        except api.ApiError as e:
            self.metrics.requests.labels(outcome="rejected").inc()
            return web.json_response(e.body(), status=e.status)
        refused = admission(len(self.runs), params.choices, self.cfg.router_max_in_flight)
        if refused:
            self.metrics.requests.labels(outcome="rejected").inc()
            resp = generate.refusal(429, refused)
            resp.headers["Retry-After"] = str(RETRY_AFTER_S)
            return resp
        runs = self._open(params, arrival)
        log.debug("request transfer_id=%s client_id=%s prompt=%d max_tokens=%d n=%d stream=%s route=%s",
                  runs[0].transfer_id, params.client_id or "-", len(params.prompt_token_ids), params.max_tokens,
                  params.choices, params.stream, route)
        if params.responses and params.responses.get("background"):
            return await self._background(request, params, runs)
        try:
            return await generate.serve(request, params, runs, self.tokenizer, self._reported(params.model))
        finally:
            self._end(request.headers, params, runs)

    def _end(self, headers: Mapping[str, str], params: api.CompletionParams, runs: list[RequestRun]) -> None:
        self._close(runs)
        if self.otlp is not None:
            self._export(headers, params, runs)

    async def _background(self, request: web.Request, params: api.CompletionParams,
                          runs: list[RequestRun]) -> web.StreamResponse:
        """A background response: placed now (a refusal is the answer, as for any request), then generated by a task
        of its own; the answer is the response, queued, or (streamed) its events as they come."""
        headers = dict(request.headers)
        refused = generate.start_all(runs)
        if refused is not None:
            self._end(headers, params, runs)
            return refused
        gen = generate.Generation(params, runs, self.tokenizer, self._reported(params.model))
        assert isinstance(gen.render, responses.ResponsesRenderer) and params.keep_response is not None
        rid = gen.request_id
        queued = responses.response(rid, gen.created, gen.model, gen.render.settings, [], "queued", None)
        params.keep_response(queued)
        events = responses.BackgroundLog() if params.stream else None
        if events is not None:
            self.background_logs[rid] = events
            while len(self.background_logs) > max(1, envs.PUSHKV_RESPONSES_STORE):
                self.background_logs.popitem(last=False)
        task = asyncio.create_task(self._generate_in_background(gen, headers, events), name=f"background-{rid}")
        self.background[rid] = task
        task.add_done_callback(lambda _: self.background.pop(rid, None))
        if events is not None:
            return await self._stream_log(request, events, -1)
        return web.json_response(queued)

    async def _generate_in_background(self, gen: generate.Generation, headers: Mapping[str, str],
                                      events: Optional[responses.BackgroundLog]) -> None:
        store, rid = self.responses_store, gen.request_id
        assert store is not None
        try:
            store.restatus(rid, "in_progress")
            if events is not None:
                async def add(kind: str, body: dict) -> None:
                    events.add(kind, body)

                fan = generate.Fanout(gen.runs)
                try:
                    await gen.typed_events(add, fan)
                finally:
                    await fan.close()
            else:
                await gen.background_answer()
        except asyncio.CancelledError:  # POST /v1/responses/ID/cancel
            store.restatus(rid, "cancelled")
            raise
        except Exception:
            log.exception("background response %s", rid)
            store.restatus(rid, "failed")
        finally:
            if events is not None:
                events.end()
            self._end(headers, gen.params, gen.runs)

    def _export(self, headers: Mapping[str, str], params: api.CompletionParams, runs: list[RequestRun]) -> None:
        """Each choice's spans to the OTLP collector (the SDK batches them on its own thread)."""
        assert self.otlp is not None
        now = time.monotonic()
        for run in runs:
            # the model the request ran through: its adapter, unloaded meanwhile or not (then no longer served)
            facts = otlp_spans.Facts(run.transfer_id, run.lora or self._reported(params.model), params.sampling,
                                     params.max_tokens, params.n, self.cfg.pull_read)
            try:
                self.otlp.emit(otlp_spans.request_spans(run.ledger, facts, now), headers)
            except Exception:  # a span the SDK refused never fails the request it describes
                log.exception("OTLP export of transfer_id=%s", run.transfer_id)

    def _open(self, params: api.CompletionParams, arrival: float) -> list[RequestRun]:
        """One run per choice (a batch's prompt p's c-th: choice p * n + c), each its own transfer id and sampling
        stream, in flight from now."""
        base = uuid.uuid4().hex
        runs = []
        lora = self.loras.of(params.model)
        for i in range(params.choices):
            ids = params.prompts()[i // params.n][0]
            tid = base if params.choices == 1 else f"{base}-{i}"
            # a batch's prompts are requests of their own, as vLLM's: with the client's seed, choice c of each prompt
            # samples from stream c (two equal prompts draw the same tokens); with the router's, each its own
            stream = i % params.n if params.seeded else i
            # max_tokens past this prompt's room is cut to it, per prompt, as vLLM's get_max_tokens cuts it
            max_tokens = min(params.max_tokens, self.limits.max_model_len - len(ids))
            sampling = msgspec.structs.replace(params.sampling, seed=derive_seed(params.sampling.seed, stream),
                                               min_tokens=min(params.sampling.min_tokens, max_tokens))
            run = RequestRun(self.cfg, self.balancer if self.local_link is None else None, tid,
                             ids, max_tokens, params.stop_token_ids, arrival,
                             self.metrics, sampling, local_link=self.local_link, cache_salt=params.cache_salt,
                             structured=params.structured, lora=lora, lora_root=self.loras.root(lora),
                             stop_strings=bool(params.stop), client_id=params.client_id)
            self.runs[tid] = run
            runs.append(run)
            if self.tracer is not None:
                own = f" client_id={params.client_id}" if params.client_id else ""
                self.tracer.event("http_request", tid, f"prompt={len(ids)} max_tokens={max_tokens}{own}")
        self._handlers_idle.clear()
        self.metrics.in_flight.inc()
        self.load += 1
        return runs

    def _close(self, runs: list[RequestRun]) -> None:
        """Whatever ended the request: abort what is open, release it (a choice still open ends
        as aborted: the client went away, or a sibling ended it), record it."""
        for run in runs:
            run.close()
            self.runs.pop(run.transfer_id, None)
            self.metrics.observe(run.ledger)
            if self.tracer is not None:
                self.tracer.event("http_done", run.transfer_id, run.ledger.outcome)
        self.metrics.in_flight.dec()
        self.load -= 1
        self.loras.request_ended()
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if not self.runs and not self._reading:
            self._handlers_idle.set()


def model_permission(model: str, created: int) -> dict:
    """vLLM's ModelPermission for a /v1/models card, its defaults as vLLM writes them."""
    return {"id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_URL, model).hex}", "object": "model_permission",
            "created": created, "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


def _untemplated(field: str, body: dict) -> api.CompletionParams:
    """A chat (or responses) request where the router has no tokenizer: refused by name."""
    raise api.bad(field, "chat needs the tokenizer and its chat template, which --skip-tokenizer-init skips: send "
                         "/v1/completions a prompt of token ids")


RETRY_AFTER_S = 1  # what a 429 past the in-flight bound tells the client to wait: choices end in about this


def admission(in_flight: int, n: int, bound: int) -> str:
    """Why a request of ``n`` choices is refused with ``in_flight`` being served ("" when it is not):
    past ``bound`` the router answers 429 at once, before any prefill is spent on it."""
    if in_flight + n > bound:
        return (f"too many requests in flight: {in_flight} choice(s) being served, {n} more asked, "
                f"bound {bound}; retry later")
    return ""


def _error(status: int, message: str, type_: str) -> web.Response:
    return web.json_response(api.error_body(message, type_, status), status=status)


@web.middleware
async def _json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own refusals (no such path, wrong method, body too large) in our
    JSON error shape, so a client parses every error the same way."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = _error(e.status, f"{e.text} ({request.method} {request.path})", api.error_type(e.status))
        if "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp


async def serve(cfg: DeploymentConfig) -> None:
    """Run a router until SIGINT/SIGTERM or the supervisor's Shutdown."""
    watcher = None
    if cfg.registry:  # several hosts: the instances are whatever etcd holds
        from pushkv.discovery.etcd import EtcdError, EtcdWatcher

        watcher = EtcdWatcher(cfg.registry)
        try:
            await watcher.start()  # bad credentials or no etcd: the router fails at start-up, in one line
        except EtcdError as e:
            await watcher.close()
            log.error("router: registry %s: %s", watcher.target.redacted(), e)
            raise SystemExit(1) from None
    router = Router(cfg, watcher=watcher)
    await router.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, router.request_stop)
    try:
        await router.run_until_stopped()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
