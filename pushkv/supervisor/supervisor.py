"""The supervisor actor: start a deployment, watch it, stop it.

Phases: *starting* (spawn stage by stage, each child NEW -> STARTED -> READY,
a deadline per stage, a child's exit fails startup at once), *running*
(Ping/Pong health, restart or shut down on a child's death, control
commands), *stopping* (Shutdown, SIGTERM, one deadline, SIGKILL, reap, unlink
shared memory, delete the run dir). Child exits arrive as pidfds in the same
poller as the control socket.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TextIO

import zmq

from pushkv import limits, tls
from pushkv import messages as m
from pushkv.actor import Actor
from pushkv.config import DeploymentConfig, encode_config
from pushkv.kv.handle import POOL_ENV, handle_to_env
from pushkv.security import is_network
from pushkv.supervisor import commands as c
from pushkv.supervisor import host_drain, lifecycle, registry
from pushkv.supervisor.host_registry import HostRegistry
from pushkv.supervisor.plan import ProcessSpec, config_path, event_topic, process_specs
from pushkv.supervisor.table import (
    HEALTH_TIMEOUT_S,
    Event,
    IllegalTransition,
    ProcessTable,
    RestartPolicy,
    Row,
    State,
    describe_exit,
)
from pushkv.trace import HOST_ENV, TraceForwarder

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0  # each start stage but the workers'
LOAD_TIMEOUT_S = 1200.0  # the workers' stage: weights load (GiB from disk) and the engine warms
# what each start stage (plan.KIND_STAGE) waits for, and the flag that gives it longer
STAGES = {0: ("writers", "KV pools allocated and registered with NIXL", "--startup-timeout"),
          1: ("workers", "weights loaded, engine warmed", "--load-timeout"),
          2: ("schedulers", "linked to their workers and writers", "--startup-timeout"),
          3: ("router", "HTTP port bound, instances found", "--startup-timeout")}
STOP_TIMEOUT_S = 10.0
STOP_GRACE_FRACTION = 0.3  # of the stop deadline: time for children to obey Shutdown before SIGTERM
PING_INTERVAL_S = 2.0
ON_CHILD_EXIT = ("restart", "shutdown")
ENGINE_ROLES = ("prefill", "decode", "local")


@dataclass
class InstanceRestart:
    """One instance being restarted as a whole: its survivors stop, then its stages start in order."""

    stopping: set[str]  # processes asked to stop and not yet exited
    asked: float  # monotonic time the survivors were asked to stop
    stages: list[int]  # the instance's start stages, in order
    stage_idx: int = -1  # the stage being started; -1 while survivors stop
    # restarted because the registry lease was lost: start again only once the host is back in
    # contact with etcd (a process started while the host is cut off may find no network to use:
    # UCX picks its interfaces at start-up)
    wait_registry: bool = False

def stage_late(stage: int, timeout_s: float, waiting: Sequence[str]) -> str:
    """The failure of a start stage past its time: which stage, who is not ready, and the flag."""
    name, what, flag = STAGES.get(stage, (f"stage {stage}", "ready", "--startup-timeout"))
    return (f"startup failed: the {name} stage ({what}) is not ready after {timeout_s:.0f} s: {', '.join(waiting)}; "
            f"if it is only slow, give it longer with {flag} SECONDS (its log shows how far it got)")


def ready_what(cfg: DeploymentConfig, router_url: str) -> str:
    """What the ready line names: the router's URL where this host runs the router (one host, or
    ``--role router``); a P or D host of several runs none, so its role, address and instances."""
    if cfg.host_role in ("", "router"):
        return router_url
    insts = ", ".join(f"{i.name} ({i.engine_id})" for i in cfg.instances())
    return f"{cfg.host_role} host {cfg.advertise}, no router here: instances {insts}"


ArgvHook = Callable[[ProcessSpec], Sequence[str]]


class Supervisor(Actor):
    def __init__(
        self,
        cfg: DeploymentConfig,
        *,
        child_argv: Optional[ArgvHook] = None,
        on_child_exit: str = "restart",
        restart_policy: RestartPolicy = RestartPolicy(),
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        load_timeout_s: float = LOAD_TIMEOUT_S,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        ping_interval_s: float = PING_INTERVAL_S,
        health_timeout_s: float = HEALTH_TIMEOUT_S,
        registry_dir: Optional[str] = None,
        write_registry: bool = True,
        out: TextIO = sys.stdout,
        announcer=None,
    ):
        self._instance_restart: dict[str, InstanceRestart] = {}  # by instance name (prefill, prefill1, ...)
        if not cfg.run_dir or not cfg.control_endpoint:
            raise ValueError("Supervisor needs a planned config (see plan_deployment)")
        if on_child_exit not in ON_CHILD_EXIT:
            raise ValueError(f"on_child_exit must be one of {ON_CHILD_EXIT}, got {on_child_exit!r}")
        # No control endpoint for the base: this process *is* the control endpoint.
        super().__init__("supervisor", secret_file=cfg.secret_file)
        self.cfg = cfg
        self.specs = process_specs(cfg)
        self.table = ProcessTable(self.specs)
        self.child_argv = child_argv or (lambda spec: spec.argv)
        self.on_child_exit = on_child_exit
        self.policy = restart_policy
        self.startup_timeout_s = startup_timeout_s
        self.load_timeout_s = load_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.ping_interval_s = ping_interval_s
        self.health_timeout_s = health_timeout_s
        self.registry_dir = registry_dir
        self.write_registry = write_registry
        self.out = out
        # a P or D host of several runs no router: its record and status name none
        self.router_url = tls.router_url(cfg, cfg.port) if cfg.host_role in ("", "router") else ""
        self.phase = "new"  # new | starting | running | draining (--shutdown-timeout) | stopping | stopped
        self.exit_code = 0
        self.stop_signal = 0  # the signal that stopped us, if one did
        self._signals = 0  # stop signals received: a second one during the drain cuts it short
        self._signals_at_drain = 0
        self._stop_asked = False  # by a signal or `pushkv stop`: tick begins the stop
        self._drain_until = 0.0  # --shutdown-timeout: while the router drains, when the rest stops at the latest
        self._host_drain: Optional[host_drain.HostDrain] = None  # a P or D host's drain (--shutdown-timeout)
        self._ping_seq = 0  # the last Ping's seq (each Pong echoes its ping's)
        self._drain_dropped: set[str] = set()  # instances that lost a process while their host drained
        self.failure = ""
        self.procs: dict[str, subprocess.Popen] = {}
        self._pidfds: dict[str, int] = {}
        self._restart_requested: dict[str, float] = {}  # name -> when asked (monotonic)
        self._unhealthy: set[str] = set()
        self._stages = sorted({s.stage for s in self.specs})
        self._stage_idx = 0
        self._stage_deadline = 0.0  # the start stage being spawned must be ready by then
        self._next_ping = 0.0
        self._control_router: Optional[zmq.Socket] = None  # children (DEALER) and REQ clients
        self._events: Optional[zmq.Socket] = None
        self._trace_fwd: Optional[TraceForwarder] = None
        # several hosts: this host's instances go into the registry (pushkv.discovery.etcd.EtcdAnnouncer,
        # rejoin=False) once ready, and out of it while they restart
        self.host_registry = HostRegistry(cfg, announcer) if announcer is not None else None

    # ------------------------------------------------------------------
    # start phase
    # ------------------------------------------------------------------
    def setup(self) -> None:
        now = time.monotonic()
        os.makedirs(self.cfg.run_dir, mode=0o700)  # fresh: fails if it exists
        self.phase = "starting"  # from here on, teardown owns run_dir
        with open(config_path(self.cfg), "wb") as f:
            f.write(encode_config(self.cfg))
        self._control_router = self.socket(zmq.ROUTER, self.cfg.control_endpoint, bind=True)
        self.add_channel(self._control_router, m.DEC_SUPERVISOR_IN, "control", routed=True)
        self._events = self.socket(zmq.PUB, self.cfg.events_endpoint, bind=True)
        if self.cfg.trace_endpoint and self.cfg.trace_tap_endpoint:
            self._trace_fwd = TraceForwarder(self.cfg.trace_endpoint, self.cfg.trace_tap_endpoint, self.ctx,
                                            self.security, limits.msg_cap_bytes(self.cfg))
            self._trace_fwd.start()
        if self.write_registry:
            registry.write_record(registry.DeploymentRecord(
                deployment_id=self.cfg.deployment_id, pid=os.getpid(),
                control_endpoint=self.cfg.control_endpoint, events_endpoint=self.cfg.events_endpoint,
                router_url=self.router_url, run_dir=self.cfg.run_dir, mode=self.cfg.mode,
                started_wall=time.time(), trace_endpoint=self.cfg.trace_endpoint,
                trace_tap_endpoint=self.cfg.trace_tap_endpoint, shutdown_timeout_s=self.cfg.shutdown_timeout_s,
                trace_tap_secured=bool(self.security is not None and is_network(self.cfg.trace_tap_endpoint)),
            ), self.registry_dir)
        log.info("deployment %s (%s mode): %d processes, run dir %s", self.cfg.deployment_id,
                 self.cfg.mode, len(self.specs), self.cfg.run_dir)
        self._spawn_stage(now)

    def stage_timeout_s(self, stage: int) -> float:
        """Seconds a start stage has, from its first spawn: the workers' (loading weights) is
        --load-timeout, every other --startup-timeout."""
        return self.load_timeout_s if STAGES.get(stage, ("",) * 3)[2] == "--load-timeout" else self.startup_timeout_s

    def _spawn_stage(self, now: float) -> None:
        stage = self._stages[self._stage_idx]
        self._stage_deadline = now + self.stage_timeout_s(stage)
        for spec in self.specs:
            if spec.stage == stage and not self.stopping:
                self._spawn(spec.name, now)

    def _spawn(self, name: str, now: float) -> None:
        row = self.table[name]
        argv = list(self.child_argv(row.spec))
        env = lifecycle.child_env(name, self.cfg.deployment_id, kind=row.spec.kind,
                                  metrics_auth=self.cfg.metrics_auth)
        if self.cfg.advertise:  # the host in every trace event (tools/trace/merge.py aligns hosts' clocks)
            env[HOST_ENV] = self.cfg.advertise
        if row.spec.kind == "worker":  # map the pool its writer owns (named per writer incarnation)
            writer = self.table.get(f"{row.spec.instance_name}-writer-{row.spec.rank}")
            if writer is not None and writer.ready is not None and writer.ready.pool is not None:
                env[POOL_ENV] = handle_to_env(writer.ready.pool)
        try:
            proc = lifecycle.spawn(argv, env)
        except OSError as e:
            self._fail(f"{name}: could not start {argv[0]!r}: {e}")
            return
        self.procs[name] = proc
        restart = row.state is State.EXITED
        self.table.spawned(name, proc.pid, now, time.time())
        fd = os.pidfd_open(proc.pid)
        self._pidfds[name] = fd
        self.add_fd(fd, functools.partial(self._on_child_exit, name))
        log.info("%s %s (pid %d)", "restarted" if restart else "started", name, proc.pid)
        self._publish(name, "restart" if restart else "spawn", row)

    def _advance(self, now: float) -> None:
        """Starting phase: next stage once this one is ready; running once all are."""
        while self.phase == "starting" and self.table.all_ready(self._stages[self._stage_idx]):
            self._stage_idx += 1
            if self._stage_idx == len(self._stages):
                self._now_running(now)
            else:
                self._spawn_stage(now)

    def _now_running(self, now: float) -> None:
        self.phase = "running"
        self._next_ping = now + self.ping_interval_s
        what = ready_what(self.cfg, self.router_url)
        log.info("deployment %s ready: %s", self.cfg.deployment_id, what)
        self._publish("deployment", "ready", detail=what)
        for inst in self.cfg.instances():
            if self.host_registry is not None:
                self.host_registry.announce(inst.name)
        print(self.router_url if self.cfg.host_role in ("", "router") else
              "instances " + " ".join(i.engine_id for i in self.cfg.instances()), file=self.out, flush=True)
        print("READY", file=self.out, flush=True)

    # ------------------------------------------------------------------
    # messages on the control socket
    # ------------------------------------------------------------------
    def on_Ready(self, msg: m.Ready, identity: bytes) -> None:
        row = self.table.get(msg.name)
        if row is None:
            self.counters["unknown_ready"] += 1
            log.error("Ready from unknown process %r (pid %d)", msg.name, msg.pid)
            return
        if msg.pid != row.pid:
            log.warning("%s: Ready carries pid %d, spawned pid is %d", msg.name, msg.pid, row.pid)
        try:
            self.table.ready(msg.name, identity, msg, time.monotonic())
        except IllegalTransition as e:
            self.counters["late_ready"] += 1
            log.error("%s", e)
            return
        log.info("%s ready (pid %d)", msg.name, row.pid)
        self._publish(msg.name, "ready", row)
        self._advance(time.monotonic())
        self._advance_instance(row.spec.instance_name, time.monotonic())

    def on_Pong(self, msg: m.Pong, identity: bytes) -> None:
        row = self.table.get(msg.name)
        if row is None or row.identity != identity:
            self.counters["stray_pong"] += 1
            return
        self.table.pong(msg.name, time.monotonic())
        if self._host_drain is not None:
            self._host_drain.answer(msg.name, msg.in_flight, msg.ping_seq)
        if msg.name in self._unhealthy:
            self._unhealthy.discard(msg.name)
            log.info("%s answers pings again", msg.name)
            self._publish(msg.name, "healthy", row)

    def on_ControlCommand(self, msg: m.ControlCommand, identity: bytes) -> None:
        self._reply(identity, c.dispatch(self, msg, time.monotonic()))

    def on_bad_frame(self, ch, identity, reason, payload=b"") -> None:
        if identity is not None:  # a REQ client waits for an answer
            self._reply(identity, m.ControlReply(command="", status=c.ERROR, reason=f"bad request: {reason}"))

    def on_handler_error(self, ch, identity, msg) -> None:
        if isinstance(msg, m.ControlCommand) and identity is not None:
            self._reply(identity, m.ControlReply(command=msg.command, status=c.ERROR, reason="handler failed"))

    @property
    def _router_sock(self) -> zmq.Socket:
        """The control ROUTER, bound in start() before any child or client can speak."""
        if self._control_router is None:
            raise RuntimeError("the supervisor's control socket is not bound yet")
        return self._control_router

    def _reply(self, identity: bytes, reply: m.ControlReply) -> None:
        # REQ envelope: identity, empty delimiter, body
        self._router_sock.send_multipart([identity, b"", m.encode(reply)])

    # ------------------------------------------------------------------
    # CommandContext
    # ------------------------------------------------------------------
    def deployment_info(self) -> dict[str, str]:
        return {
            "deployment_id": self.cfg.deployment_id, "mode": self.cfg.mode, "phase": self.phase,
            "router_url": self.router_url, "run_dir": self.cfg.run_dir,
            "control_endpoint": self.cfg.control_endpoint, "events_endpoint": self.cfg.events_endpoint,
            "trace_endpoint": self.cfg.trace_endpoint, "trace_tap_endpoint": self.cfg.trace_tap_endpoint,
            "supervisor_pid": str(os.getpid()),
            "on_child_exit": self.on_child_exit,
            # one entry per P / D / local instance, JSON (the info map holds strings)
            "instances": json.dumps([
                {"name": i.name, "role": i.role, "index": i.index, "engine_id": i.engine_id, "tp": i.tp,
                 "device": i.device, "num_blocks": i.num_blocks, "block_size": i.block_size,
                 "metrics_url": f"http://{self.cfg.metrics_host()}:{i.metrics_port}/metrics"}
                for i in self.cfg.instances()]),
        }

    def run(self) -> None:
        """The actor's loop; a hang-up (the terminal or the ssh session of `pushkv up` gone) stops the deployment as
        SIGTERM does, cleaning up, where by default it killed the supervisor at once and left the children to die by
        SIGKILL and their pools, run dir and record behind. Under nohup (SIGHUP ignored) it stays ignored."""
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            signal.signal(signal.SIGHUP, self._on_signal)
        super().run()

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = signum  # tick begins the stop and says so: a handler only sets flags
        self._signals += 1

    def request_stop(self, reason: str) -> None:
        log.info("stop requested: %s", reason)
        self._stop_asked = True

    def _begin_stop(self, now: float) -> None:
        """The stop asked (signal, ``pushkv stop``): with --shutdown-timeout and a live router, the router alone
        first, which drains its requests while the instances serve them and everything else still runs (this loop
        answers ``pushkv status`` meanwhile: phase ``draining``); the rest once it has exited or the time is up."""
        router = self.table["router"] if "router" in self.table.rows else None
        if (self.phase == "running" and self.cfg.shutdown_timeout_s > 0 and router is None
                and self.host_registry is not None):
            self._begin_host_drain(self.host_registry, now)
        elif (self.phase == "running" and self.cfg.shutdown_timeout_s > 0 and router is not None
                and router.state in (State.STARTED, State.READY)):
            self.phase = "draining"
            self._drain_until = now + self.cfg.shutdown_timeout_s
            self._signals_at_drain = self._signals
            self._stop_child(router, "stop")
            self._publish("deployment", "draining", detail=f"{self.cfg.shutdown_timeout_s:g} s")
        else:
            self.stopping = True

    # ------------------------------------------------------------------
    # a P or D host's drain (several hosts, --shutdown-timeout): pushkv/supervisor/host_drain.py
    # ------------------------------------------------------------------
    def _begin_host_drain(self, reg: HostRegistry, now: float) -> None:
        """Mark this host's records draining in the registry (the routers choose its instances for nothing new
        and leave their requests alone) while every process keeps serving; ``tick`` stops the host once its
        schedulers hold nothing, at --shutdown-timeout, or at a second signal (this loop answers ``pushkv status``
        meanwhile: phase ``draining``)."""
        self.phase = "draining"
        self._signals_at_drain = self._signals
        self._host_drain = host_drain.HostDrain.start(now, self.cfg.shutdown_timeout_s)
        marked = reg.mark_draining()
        self._host_drain.seen_from(time.monotonic())  # the puts may have waited on etcd
        self._next_ping = now
        log.info("%s host draining: its instances (%s) take no new request; their requests in flight have up to "
                 "%g s to finish (--shutdown-timeout)", self.cfg.host_role, ", ".join(marked) or "none in the registry",
                 self.cfg.shutdown_timeout_s)
        self._publish("deployment", "draining", detail=f"{self.cfg.shutdown_timeout_s:g} s")

    def _drain_schedulers(self) -> set[str]:
        """The schedulers the host's drain waits for: those of the instances still whole and ready."""
        return {r.name for r in self.table.in_state(State.READY)
                if r.spec.kind == "scheduler" and r.spec.instance_name not in self._drain_dropped
                and r.spec.instance_name not in self._instance_restart}

    def _host_drain_tick(self, drain: host_drain.HostDrain, now: float) -> None:
        reg = self.host_registry
        if reg is not None and reg.tick(now):  # the lease lapsed: the routers failed our requests already
            log.error("registry lease lost while draining: stopping now")
            self.stopping = True
            return
        if reg is not None and not reg.marks_landed:  # etcd has not taken the mark yet: no router has seen it
            drain.seen_from(now)
        schedulers = self._drain_schedulers()
        why = drain.verdict(now, schedulers, self._signals > self._signals_at_drain)
        if why:
            self._signals_at_drain = self._signals
            held = drain.held(schedulers)
            if why == host_drain.DONE:
                log.info("drained: no request in flight on this host's instances; leaving the registry and stopping")
            elif why == host_drain.SIGNAL:
                log.info("%s again while draining: stopping now, %d request(s) in flight end with 503 at the router",
                         signal.Signals(self.stop_signal).name, held)
            else:
                log.warning("drain timed out after %g s (--shutdown-timeout): %d request(s) still in flight end with "
                            "503 at the router", self.cfg.shutdown_timeout_s, held)
            self.stopping = True
            return
        if now >= self._next_ping:
            self._next_ping = now + host_drain.PING_S
            self._ping_all(now)

    def _exit_while_host_drains(self, row: Row, pid: int, how: str) -> None:
        """A process died while its host drains: nothing is restarted; its instance leaves the registry now (the
        routers fail its requests, and tell the other role), and the drain no longer waits for it."""
        inst = row.spec.instance_name
        log.error("%s (pid %d) died while the host drains: %s; the %s instance leaves the registry now", row.name,
                  pid, how, inst)
        self._publish(row.name, "exit", row, detail=how)
        if row.spec.role in ENGINE_ROLES and inst not in self._drain_dropped:
            self._drain_dropped.add(inst)
            if self.host_registry is not None:
                self.host_registry.withdraw(inst)

    def request_restart(self, name: str, reason: str) -> Optional[str]:
        if self.phase != "running":
            return f"cannot restart during phase {self.phase}"
        row = self.table[name]
        if row.state not in (State.STARTED, State.READY):
            return f"{name} is {row.state.value}"
        log.info("restarting %s (pid %d): %s", name, row.pid, reason)
        self._restart_requested[name] = time.monotonic()
        self._stop_child(row)
        return None

    def _stop_child(self, row: Row, reason: str = "restart") -> None:
        """Ask politely; ``tick`` escalates to SIGTERM after the grace and SIGKILL at the deadline.

        Not Shutdown and SIGTERM together: a Python child that is already
        finalizing after Shutdown has default signal handlers again and would
        die by SIGTERM instead of exiting 0.
        """
        self.table.apply(row.name, Event.STOP)
        if row.identity is not None:
            self._router_sock.send_multipart([row.identity, m.encode(m.Shutdown(reason=reason))])
        else:
            lifecycle.signal_child(self.procs[row.name], signal.SIGTERM)

    # ------------------------------------------------------------------
    # child exits (pidfd readable)
    # ------------------------------------------------------------------
    def _on_child_exit(self, name: str) -> None:
        now = time.monotonic()
        proc = self.procs[name]
        code = proc.wait()  # already a zombie: returns at once
        self._unwatch(name)
        row = self.table[name]
        pid = row.pid
        self.table.exited(name, code)
        self._unhealthy.discard(name)
        how = describe_exit(code)
        if self.phase == "draining" and self._host_drain is not None:
            self._exit_while_host_drains(row, pid, how)
            return
        if self.phase == "draining":  # the stop is under way: nothing is restarted; the router gone, the rest stop
            log.info("%s (pid %d) exited while the router drains: %s", name, pid, how)
            self._publish(name, "exit", row, detail=how)
            if row.spec.kind == "router":
                self.stopping = True
            return
        if name in self._restart_requested:
            del self._restart_requested[name]
            log.info("%s (pid %d) stopped for restart: %s", name, pid, how)
            self._publish(name, "exit", row, detail=how)
            self._spawn(name, now)
            return
        role, inst = row.spec.role, row.spec.instance_name
        if inst in self._instance_restart and name in self._instance_restart[inst].stopping:
            self._instance_restart[inst].stopping.discard(name)
            log.info("%s (pid %d) stopped for the restart of the %s instance: %s", name, pid, inst, how)
            self._publish(name, "exit", row, detail=how)
            self._advance_instance(inst, now)
            return
        log.error("%s (pid %d) died: %s", name, pid, how)
        self._publish(name, "exit", row, detail=how)
        if self.phase == "starting":
            self._fail(f"startup failed: {name} (pid {pid}) exited during startup: {how}")
        elif self.on_child_exit == "shutdown":
            self._fail(f"{name} (pid {pid}) died ({how}); --on-child-exit shutdown")
        elif not self.policy.allows(row, now):
            self._fail(f"{name} (pid {pid}) died ({how}) after {self.policy.max_restarts} restarts "
                       f"within {self.policy.window_s:.0f} s; giving up")
        elif role in ENGINE_ROLES:
            self._restart_instance(inst, name, now, how)
        else:
            self._spawn(name, now)

    # ------------------------------------------------------------------
    # instance restart: a writer owns the pool its workers map and the
    # scheduler's block accounting describes, so one death restarts the
    # whole instance, stage by stage (writers, workers, scheduler).
    # ------------------------------------------------------------------
    def _instance_rows(self, inst: str) -> list[Row]:
        return [r for r in self.table if r.spec.role and r.spec.instance_name == inst]

    def _restart_instance(self, role: str, dead: str, now: float, how: str = "",
                          wait_registry: bool = False) -> None:
        """``role`` names the instance (``prefill``, ``prefill1``, ...: InstanceConfig.name)."""
        if role in self._instance_restart:
            return
        rows = self._instance_rows(role)
        stopping = set()
        why = (f"{role} instance restarting: {dead} died" + (f" ({how})" if how else "")
               if self.table.get(dead) is not None else f"{role} instance restarting: {dead}")
        for r in rows:
            if r.name != dead and r.state in (State.STARTED, State.READY):
                self._stop_child(r, why)  # survivors tell their clients why they stop
                stopping.add(r.name)
        if self.host_registry is not None:
            self.host_registry.withdraw(role)
        log.error("%s: stopping %s", why, ", ".join(sorted(stopping)) or "nothing else")
        self._publish_instance(role, "restart", detail=dead)
        self._instance_restart[role] = InstanceRestart(stopping, now, sorted({r.spec.stage for r in rows}),
                                                       wait_registry=wait_registry)
        self._advance_instance(role, now)

    def _advance_instance(self, role: str, now: float) -> None:
        st = self._instance_restart.get(role)
        if st is None or st.stopping or self._host_drain is not None:  # a host that drains restarts nothing
            return
        waiting = st.wait_registry and self.host_registry is not None and not self.host_registry.in_contact
        if st.stage_idx < 0 and waiting:
            return  # stopped; started again once etcd answers (_registry_tick)
        rows = self._instance_rows(role)
        while True:
            if st.stage_idx >= 0:
                stage = st.stages[st.stage_idx]
                if not all(r.state is State.READY for r in rows if r.spec.stage == stage):
                    return
            st.stage_idx += 1
            if st.stage_idx == len(st.stages):
                del self._instance_restart[role]
                log.info("%s instance restarted and ready", role)
                self._publish_instance(role, "ready")
                if self.host_registry is not None:
                    self.host_registry.announce(role)
                return
            if st.stage_idx == 0:  # the dead writer's pool segments are orphans now
                lifecycle.cleanup_instance_shm(self.cfg.deployment_id, role)
            stage = st.stages[st.stage_idx]
            for r in rows:
                if r.spec.stage == stage:
                    self._spawn(r.name, now)

    # ------------------------------------------------------------------
    # the registry (several hosts)
    # ------------------------------------------------------------------
    def _registry_tick(self, reg: HostRegistry, now: float) -> None:
        """When the lease is lost the router has failed this host's requests already: stop every
        instance (their work and blocks go with them) and start them again once etcd answers
        (a process started while cut off may find no network: UCX picks interfaces at start)."""
        if reg.tick(now) and self.phase == "running":
            for inst in self.cfg.instances():
                if inst.name not in self._instance_restart:
                    self._restart_instance(inst.name, "registry lease lost", now, wait_registry=True)
        if reg.in_contact:
            for name in [n for n, st in self._instance_restart.items() if st.wait_registry and st.stage_idx < 0]:
                self._advance_instance(name, now)

    def _unwatch(self, name: str) -> None:
        fd = self._pidfds.pop(name, None)
        if fd is None:
            return
        self.remove_fd(fd)
        os.close(fd)

    def _fail(self, reason: str) -> None:
        if not self.failure:
            self.failure = reason
        self.exit_code = 1
        log.error("%s", reason)
        print(f"FAILED: {reason}", file=sys.stderr, flush=True)
        self._publish("deployment", "failed", detail=reason)
        self.stopping = True

    # ------------------------------------------------------------------
    # run phase: deadlines and health
    # ------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if self.stop_signal and not self._stop_asked:
            self.request_stop(signal.Signals(self.stop_signal).name)
        if self.phase == "draining" and self._host_drain is not None:
            self._host_drain_tick(self._host_drain, now)
            return
        if self.phase == "draining":
            if self._signals > self._signals_at_drain:  # a second Ctrl-C: stop now, as uvicorn's second SIGINT
                log.info("%s again while the router drains: stopping now", signal.Signals(self.stop_signal).name)
                self._signals_at_drain = self._signals
                self.stopping = True
            if now > self._drain_until:
                self.stopping = True
            return
        if self._stop_asked and not self.stopping:
            self._begin_stop(now)
            return
        if self.host_registry is not None and self.phase == "starting":
            self._registry_tick(self.host_registry, now)  # keep the lease taken at start-up
        if self.phase == "starting":
            if now > self._stage_deadline:
                stage = self._stages[self._stage_idx]
                waiting = [r.name for r in self.table.in_state(State.NEW, State.STARTED) if r.spec.stage == stage]
                self._fail(stage_late(stage, self.stage_timeout_s(stage), waiting))
            return
        if self.phase != "running":
            return
        if self.host_registry is not None:
            self._registry_tick(self.host_registry, now)
        for row in self.table.in_state(State.STARTED):  # a restarted child that never gets ready
            if now - row.started_at > self.stage_timeout_s(row.spec.stage):
                log.error("%s (pid %d) not ready %.0f s after restart (%s); killing it", row.name, row.pid,
                          self.stage_timeout_s(row.spec.stage), STAGES.get(row.spec.stage, ("", "", "?"))[2])
                lifecycle.signal_child(self.procs[row.name], signal.SIGKILL)
        for st in self._instance_restart.values():
            for name in st.stopping:
                if now - st.asked > self.stop_timeout_s:
                    lifecycle.signal_child(self.procs[name], signal.SIGKILL)
                elif now - st.asked > self.stop_timeout_s * STOP_GRACE_FRACTION:
                    lifecycle.signal_child(self.procs[name], signal.SIGTERM)
        for name, asked in self._restart_requested.items():  # a restart that does not stop by itself
            if now - asked > self.stop_timeout_s:
                lifecycle.signal_child(self.procs[name], signal.SIGKILL)
            elif now - asked > self.stop_timeout_s * STOP_GRACE_FRACTION:
                lifecycle.signal_child(self.procs[name], signal.SIGTERM)
        if now >= self._next_ping:
            self._next_ping = now + self.ping_interval_s
            self._ping_all(now)

    def _ping_all(self, now: float) -> None:
        self._ping_seq += 1
        ping = m.encode(m.Ping(seq=self._ping_seq))
        if self._host_drain is not None:  # its answers are dated by when it was sent
            self._host_drain.pinged(self._ping_seq, now)
        for row in self.table.in_state(State.READY):
            if row.identity is not None:
                self._router_sock.send_multipart([row.identity, ping])
            if not row.healthy(now, self.health_timeout_s) and row.name not in self._unhealthy:
                self._unhealthy.add(row.name)
                log.warning("%s (pid %d) has not answered pings for %.1f s", row.name, row.pid,
                            now - max(row.last_pong, row.ready_at))
                self._publish(row.name, "unhealthy", row)
        self._publish("supervisor", "heartbeat")

    # ------------------------------------------------------------------
    # stop phase
    # ------------------------------------------------------------------
    def teardown(self) -> None:
        was = self.phase
        self.phase = "stopping"
        if self.host_registry is not None:  # out of the registry first: the router stops choosing us
            self.host_registry.close()
        self._publish("deployment", "stopping", detail=self.failure)
        for name in list(self._pidfds):
            self._unwatch(name)
        live = [r for r in reversed(list(self.table)) if r.name in self.procs and self.procs[r.name].returncode is None]
        for row in live:  # router first, writers (pool owners) last
            if row.identity is not None and self._control_router is not None:
                self._control_router.send_multipart([row.identity, m.encode(m.Shutdown(reason=self.failure or "stop"))])
            if row.state in (State.STARTED, State.READY):
                self.table.apply(row.name, Event.STOP)
        procs = [self.procs[r.name] for r in live]
        killed = lifecycle.stop_all(procs, self.stop_timeout_s * STOP_GRACE_FRACTION, self.stop_timeout_s)
        for row in live:
            code = self.procs[row.name].returncode
            if row.state is State.STOPPING:
                self.table.exited(row.name, code)
            self._publish(row.name, "exit", row, detail=describe_exit(code))
        if killed:
            names = [r.name for r in live if self.procs[r.name] in killed]
            log.error("killed after %.0f s stop deadline: %s", self.stop_timeout_s, ", ".join(names))
        if self._events is not None:
            self._events.close(0)
            self._events = None
        if self._trace_fwd is not None:
            self._trace_fwd.stop()
            self._trace_fwd = None
        if was != "new":
            lifecycle.cleanup(self.cfg.deployment_id, self.cfg.run_dir)
        if self.write_registry:
            registry.remove_record(self.cfg.deployment_id, self.registry_dir)
        self.phase = "stopped"
        log.info("deployment %s stopped (exit code %d)", self.cfg.deployment_id, self.exit_code)

    # ------------------------------------------------------------------
    def _publish(self, name: str, event: str, row: Optional[Row] = None, detail: str = "") -> None:
        if self._events is None:
            return
        topic = f"pushkv.{name}.{event}" if row is None else event_topic(row.spec, event)
        ev = m.LifecycleEvent(
            name=name, event=event, pid=row.pid if row else os.getpid(), detail=detail,
            restarts=row.restarts if row else 0, t_wall=time.time(),
            role=row.spec.role if row else "", kind=row.spec.kind if row else "", rank=row.spec.rank if row else 0,
            instance=row.spec.instance if row else 0,
        )
        self._events.send_multipart([topic.encode(), m.encode(ev)])

    def _publish_instance(self, inst: str, event: str, detail: str = "") -> None:
        """An event about a whole instance (its restart), topic ``pushkv.<role>.instance.<event>``;
        ``inst`` is the instance name (``prefill``, ``prefill1``, ...)."""
        if self._events is None:
            return
        rows = self._instance_rows(inst)
        role, index = (rows[0].spec.role, rows[0].spec.instance) if rows else (inst, 0)
        ev = m.LifecycleEvent(name=f"{inst}.instance", event=event, pid=os.getpid(), detail=detail,
                              t_wall=time.time(), role=role, kind="instance", instance=index)
        self._events.send_multipart([f"pushkv.{role}.instance.{event}".encode(), m.encode(ev)])

    def serve(self) -> int:
        """Run all three phases; the process exit code."""
        self.run()
        return self.exit_code

