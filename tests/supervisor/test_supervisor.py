"""Supervisor: pure planning and commands by table; real processes with fake children."""
from __future__ import annotations

import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque

import msgspec
import pytest
import zmq

from processes import cli
from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig, preset
from pushkv.cuda_driver import device_count as cuda_device_count
from pushkv.supervisor import commands as c
from pushkv.supervisor import lifecycle, registry
from pushkv.supervisor.plan import ProcessSpec, event_topic, plan_deployment, process_specs
from pushkv.supervisor.table import Event, IllegalTransition, ProcessTable, RestartPolicy, State
from tests.support import ROOT



def counter_ports(start=20000):
    it = itertools.count(start)
    return lambda: next(it)


def planned(**kw) -> DeploymentConfig:
    kw.setdefault("deployment_id", "abc123")
    return plan_deployment(DeploymentConfig(**kw), pick_port=counter_ports())


# ---------------------------------------------------------------------------
# plan_deployment / process_specs (pure)
# ---------------------------------------------------------------------------
def test_plan_fills_everything_push():
    cfg = planned(prefill=InstanceConfig(role="prefill", tp=2))
    assert cfg.run_dir == "/tmp/pushkv-abc123"
    assert cfg.control_endpoint == "ipc:///tmp/pushkv-abc123/control.sock"
    assert cfg.events_endpoint == "ipc:///tmp/pushkv-abc123/events.sock"
    p, d = cfg.prefill, cfg.decode
    assert p.engine_id == "prefill-abc123" and d.engine_id == "decode-abc123"
    assert p.sched_endpoint == "ipc:///tmp/pushkv-abc123/prefill-scheduler.sock"
    assert p.worker_endpoints == tuple(f"ipc:///tmp/pushkv-abc123/prefill-worker-{r}.sock" for r in range(2))
    assert p.writer_endpoints == tuple(f"ipc:///tmp/pushkv-abc123/prefill-writer-{r}.sock" for r in range(2))
    # one host: the handshakes (P's Hello carries its NIXL metadata) are files in the 0700 run dir
    assert p.handshake_endpoints == tuple(f"ipc:///tmp/pushkv-abc123/prefill-handshake-{r}.sock" for r in range(2))
    assert d.handshake_endpoints == ("ipc:///tmp/pushkv-abc123/decode-handshake-0.sock",)
    assert p.dist_init.startswith("tcp://127.0.0.1:")
    assert d.dist_init == ""  # tp=1
    assert cfg.local.sched_endpoint == ""  # unused in push mode


def test_plan_local_and_kept_fields():
    cfg = planned(mode="local", local=InstanceConfig(role="local", tp=2, engine_id="mine"), run_dir="/x/r",
                  trace_endpoint="auto")
    assert cfg.local.engine_id == "mine"
    assert cfg.local.worker_endpoints == ("ipc:///x/r/local-worker-0.sock", "ipc:///x/r/local-worker-1.sock")
    assert cfg.trace_endpoint == "ipc:///x/r/trace.sock"
    assert cfg.prefill.sched_endpoint == ""


def test_plan_fresh_ids_and_duplicate_ports_skipped():
    a = plan_deployment(DeploymentConfig(), pick_port=counter_ports())
    b = plan_deployment(DeploymentConfig(), pick_port=counter_ports())
    assert a.deployment_id != b.deployment_id and a.run_dir != b.run_dir
    dup = iter([5000, 5000, 5001, 5001, 5002, 5003])
    two = dict(tp=2, device="cpu")
    cfg = plan_deployment(DeploymentConfig(deployment_id="x", prefill=InstanceConfig(role="prefill", **two),
                                           decode=InstanceConfig(role="decode", **two)), pick_port=lambda: next(dup))
    assert cfg.prefill.dist_init.endswith(":5000")
    assert cfg.prefill.metrics_port == 5001  # each instance's /metrics takes a planned port too
    assert cfg.decode.dist_init.endswith(":5002")
    assert cfg.decode.metrics_port == 5003


@pytest.mark.parametrize("flags, want", [
    (dict(), {}),  # free ports, picked by the planner
    (dict(metrics_port=9100), {"prefill": 9100, "decode": 9101}),
    (dict(metrics_port=9100, prefill_instances=2, decode_instances=2),
     {"prefill": 9100, "prefill1": 9101, "decode": 9102, "decode1": 9103}),
    (dict(metrics_port=9100, mode="local"), {"local": 9100}),
])
def test_plan_fixed_metrics_ports(flags, want):
    cfg = plan_deployment(DeploymentConfig(**flags), pick_port=counter_ports())
    got = {i.name: i.metrics_port for i in cfg.instances()}
    assert all(got.values()) and len(set(got.values())) == len(got)
    if want:
        assert got == want


@pytest.mark.parametrize("cfg, err", [
    (DeploymentConfig(prefill=InstanceConfig(role="prefill", tp=0)), "tp must be"),
    (DeploymentConfig(prefill=InstanceConfig(role="prefill", tp=2, worker_endpoints=("ipc://a",))), "worker endpoints"),
])
def test_plan_rejects(cfg, err):
    with pytest.raises(ValueError, match=err):
        plan_deployment(cfg, pick_port=counter_ports())


def test_process_specs_push_order_and_argv():
    cfg = planned(prefill=InstanceConfig(role="prefill", tp=2))
    specs = process_specs(cfg)
    assert [s.name for s in specs] == [
        "prefill-writer-0", "prefill-writer-1", "prefill-worker-0", "prefill-worker-1", "prefill-scheduler",
        "decode-writer-0", "decode-worker-0", "decode-scheduler", "router",
    ]
    conf = "/tmp/pushkv-abc123/config.json"
    w = specs[1]
    assert w.argv == (sys.executable, "-m", "processes.writer", "--config", conf, "--role", "prefill", "--rank", "1")
    assert specs[4].argv[2] == "processes.scheduler" and specs[4].argv[-4:] == ("--role", "prefill", "--rank", "0")
    assert specs[-1].argv == (sys.executable, "-m", "processes.router", "--config", conf)
    assert [s.stage for s in specs] == [0, 0, 1, 1, 2, 0, 1, 2, 3]


def test_process_specs_local():
    specs = process_specs(planned(mode="local"))
    assert [s.name for s in specs] == ["local-writer-0", "local-worker-0", "local-scheduler", "router"]


def test_process_specs_needs_plan():
    with pytest.raises(ValueError):
        process_specs(DeploymentConfig())


@pytest.mark.parametrize("role, kind, rank, event, topic", [
    ("decode", "writer", 0, "exit", "pushkv.decode.writer.exit"),
    ("prefill", "worker", 3, "restart", "pushkv.prefill.worker.restart"),
    ("local", "scheduler", 0, "ready", "pushkv.local.scheduler.ready"),
    ("", "router", 0, "ready", "pushkv.router.ready"),
])
def test_event_topic(role, kind, rank, event, topic):
    spec = ProcessSpec(name="any-name", kind=kind, role=role, rank=rank, argv=("x",), stage=0)
    assert event_topic(spec, event) == topic


# ---------------------------------------------------------------------------
# process table (pure)
# ---------------------------------------------------------------------------
def spec(name="decode-writer-0", stage=0):
    role, kind = name.split("-")[:2] if "-" in name else ("", name)  # test names only; the plan types them
    return ProcessSpec(name=name, kind=kind, role=role, rank=0, argv=("x",), stage=stage)


LEGAL = [
    (State.NEW, Event.SPAWNED, State.STARTED),
    (State.STARTED, Event.READY, State.READY),
    (State.STARTED, Event.EXITED, State.EXITED),
    (State.READY, Event.EXITED, State.EXITED),
    (State.READY, Event.STOP, State.STOPPING),
    (State.STOPPING, Event.EXITED, State.EXITED),
    (State.EXITED, Event.SPAWNED, State.STARTED),
]
ILLEGAL = [
    (State.NEW, Event.READY), (State.READY, Event.READY), (State.EXITED, Event.EXITED),
    (State.READY, Event.SPAWNED), (State.STOPPING, Event.READY), (State.NEW, Event.EXITED),
]


@pytest.mark.parametrize("state, event, new", LEGAL)
def test_transition_legal(state, event, new):
    t = ProcessTable([spec()])
    t["decode-writer-0"].state = state
    assert t.apply("decode-writer-0", event) is new


@pytest.mark.parametrize("state, event", ILLEGAL)
def test_transition_illegal_leaves_state(state, event):
    t = ProcessTable([spec()])
    t["decode-writer-0"].state = state
    with pytest.raises(IllegalTransition, match=f"{event.value}.*{state.value}"):
        t.apply("decode-writer-0", event)
    assert t["decode-writer-0"].state is state


def test_table_lifecycle_restart_counts_and_health():
    t = ProcessTable([spec("decode-writer-0", 0), spec("router", 3)])
    t.spawned("decode-writer-0", 11, now=0.0, wall=100.0)
    assert not t.all_ready(0)
    said = m.Ready("decode-writer-0", 11, agent="a")
    t.ready("decode-writer-0", b"id1", said, now=1.0)
    assert t.all_ready(0) and not t.all_ready()
    row = t["decode-writer-0"]
    assert row.ready is said
    assert row.healthy(5.0, timeout_s=10) and not row.healthy(12.0, timeout_s=10)
    t.pong("decode-writer-0", 11.0)
    assert row.healthy(12.0, timeout_s=10)
    t.exited("decode-writer-0", -9)
    assert row.identity is None and row.exit_code == -9 and not row.healthy(12.0)
    t.spawned("decode-writer-0", 12, now=20.0, wall=120.0)
    # the last exit stays for `pushkv status` (its LAST EXIT column): why the process was restarted
    assert row.restarts == 1 and row.pid == 12 and row.exit_code == -9 and row.ready is None
    assert t.by_pid(12) is row


def test_restart_policy_window():
    pol = RestartPolicy(max_restarts=2, window_s=60)
    row = ProcessTable([spec()])["decode-writer-0"]
    row.restart_times = deque([0.0, 10.0])
    assert not pol.allows(row, 50.0)
    assert pol.allows(row, 61.0)  # the first restart left the window
    assert list(row.restart_times) == [10.0]


# ---------------------------------------------------------------------------
# commands against a fake context (no sockets)
# ---------------------------------------------------------------------------
class FakeCtx:
    def __init__(self):
        self.table = ProcessTable([spec("decode-writer-0", 0), spec("router", 3)])
        self.table.spawned("decode-writer-0", 11, now=0.0, wall=0.0)
        self.table.ready("decode-writer-0", b"i", m.Ready("decode-writer-0", 11), now=0.5)
        self.stopped = None
        self.restarted = []

    def deployment_info(self):
        return {"deployment_id": "abc", "phase": "running"}

    def request_stop(self, reason):
        self.stopped = reason

    def request_restart(self, name, reason):
        if self.table[name].state is not State.READY:
            return f"{name} is {self.table[name].state.value}"
        self.restarted.append(name)
        return None


def run_cmd(ctx, command, now=2.0, **args):
    reply = c.dispatch(ctx, m.ControlCommand(command=command, args=args), now)
    # every reply survives the wire
    assert m.DEC_REPLY.decode(msgspec.msgpack.encode(reply)) == reply
    return reply


def test_status_command():
    r = run_cmd(FakeCtx(), "status")
    assert r.status == c.OK and r.info["deployment_id"] == "abc"
    w, router = r.processes
    assert (w.name, w.pid, w.state, w.uptime_s, w.healthy, w.last_exit) == ("decode-writer-0", 11, "READY", 2.0, True, "running")
    assert (router.state, router.pid, router.healthy) == ("NEW", 0, False)
    one = run_cmd(FakeCtx(), "status", name="router")
    assert [p.name for p in one.processes] == ["router"]
    assert run_cmd(FakeCtx(), "status", name="nope").status == c.ERROR


@pytest.mark.parametrize("command, args, status, effect", [
    ("stop", {}, c.OK, ("stopped", "stop command")),
    ("stop", {"reason": "bye"}, c.OK, ("stopped", "bye")),
    ("restart", {"name": "decode-writer-0"}, c.OK, ("restarted", ["decode-writer-0"])),
    ("restart", {"name": "router"}, c.ERROR, ("restarted", [])),
    ("restart", {"name": "ghost"}, c.ERROR, ("restarted", [])),
    ("info", {}, c.OK, ("stopped", None)),
    ("frobnicate", {}, c.ERROR, ("stopped", None)),
])
def test_commands(command, args, status, effect):
    ctx = FakeCtx()
    r = run_cmd(ctx, command, **args)
    assert r.status == status and r.command == command
    assert getattr(ctx, effect[0]) == effect[1]


def test_help_is_docstrings_and_raising_command_answers():
    r = run_cmd(FakeCtx(), "help")
    assert set(r.info) == set(c.COMMANDS) and r.info["stop"].startswith("Stop the whole deployment")

    class Boom(FakeCtx):
        def deployment_info(self):
            raise RuntimeError("kaput")

    r = run_cmd(Boom(), "info")
    assert r.status == c.ERROR and "kaput" in r.reason


# ---------------------------------------------------------------------------
# CLI config assembly (pure)
# ---------------------------------------------------------------------------
def test_config_flags_override_file(tmp_path):
    f = tmp_path / "d.toml"
    f.write_text('mode = "pull"\nport = 9000\nmodel = "tiny"\n[prefill]\ntp = 2\nblock_size = 32\n')
    args = cli.build_parser().parse_args(
        ["up", "--config", str(f), "--port", "9100", "--num-layers", "3", "--block-size", "8",
         "--decode-block-size", "64", "--num-blocks", "100"])
    cfg = cli.config_from_args(args)
    assert cfg.mode == "pull" and cfg.port == 9100
    assert cfg.model == preset("tiny", num_layers=3)
    assert (cfg.prefill.tp, cfg.prefill.block_size, cfg.prefill.num_blocks) == (2, 8, 100)
    assert (cfg.decode.block_size, cfg.local.block_size) == (64, 8)
    j = tmp_path / "d.json"
    j.write_text(json.dumps({"mode": "local", "local": {"tp": 2}}))
    cfg = cli.config_from_args(cli.build_parser().parse_args(["up", "--config", str(j), "--model", "medium", "--trace"]))
    assert cfg.mode == "local" and cfg.local.tp == 2 and cfg.model.name == "medium" and cfg.trace_endpoint == "auto"


# ---------------------------------------------------------------------------
# real processes, fake children
# ---------------------------------------------------------------------------
class Deployment:
    """``tests/support/fake_up.py`` in a subprocess; its stdout lines arrive on a queue."""

    def __init__(self, reg_dir, *flags, child_args=None, ignore_hup=False):
        env = dict(os.environ, PUSHKV_REGISTRY_DIR=str(reg_dir), FAKE_CHILD_ARGS=json.dumps(child_args or {}))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "support", "fake_up.py"), "--port", "18999", "--ping-interval", "0.2",
             "--log-level", "INFO", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            preexec_fn=(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if ignore_hup else None,  # nohup's
        )
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.err.append), daemon=True).start()
        self.reg_dir = str(reg_dir)

    @staticmethod
    def _pump(stream, put):
        for line in stream:
            put(line.rstrip("\n"))

    def wait_ready(self, timeout=30.0) -> list[str]:
        got, deadline = [], time.monotonic() + timeout
        while "READY" not in got:
            got.append(self.lines.get(timeout=max(deadline - time.monotonic(), 0.01)))
        return got

    def record(self) -> registry.DeploymentRecord:
        (rec,) = registry.list_records(self.reg_dir)
        return rec

    def status(self) -> dict[str, m.ProcessInfo]:
        reply = c.ask(self.record().control_endpoint, "status")
        assert reply.status == c.OK
        return {p.name: p for p in reply.processes}

    def stderr(self) -> str:
        return "\n".join(self.err)


@pytest.fixture
def deployments(tmp_path):
    """Start deployments; afterwards nothing may be left: processes, shm, run dirs."""
    made: list[Deployment] = []
    pids: set[int] = set()

    def start(*flags, child_args=None, ignore_hup=False):
        d = Deployment(tmp_path / "reg", *flags, child_args=child_args, ignore_hup=ignore_hup)
        d.track = pids.add
        made.append(d)
        return d

    yield start
    leaks = []
    for d in made:
        if d.proc.poll() is None:
            leaks.append(f"supervisor {d.proc.pid}")
            d.proc.kill()
            d.proc.wait()
    for pid in pids:
        if lifecycle.pid_alive(pid) and not _is_zombie(pid):
            leaks.append(f"child {pid}")
            os.kill(pid, signal.SIGKILL)
    shm = [p for i in _ids(made) for p in lifecycle.shm_leftovers(i)]
    for rec in registry.list_records(str(tmp_path / "reg")):
        lifecycle.cleanup(rec.deployment_id, rec.run_dir)
    assert not leaks, leaks
    assert not shm, shm


def _ids(made):
    out = []
    for d in made:
        out.extend(getattr(d, "ids", []))
    return out


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _track(d: Deployment) -> dict[str, m.ProcessInfo]:
    st = d.status()
    for p in st.values():
        d.track(p.pid)
    d.ids = [d.record().deployment_id]
    return st


def _gone(pid: int, timeout=10.0) -> bool:
    return lifecycle.wait_pid_exit(pid, timeout) or _is_zombie(pid)


def _assert_clean(rec: registry.DeploymentRecord, pids, reg_dir):
    assert all(_gone(p) for p in pids)
    assert lifecycle.shm_leftovers(rec.deployment_id) == []
    assert not os.path.exists(rec.run_dir)
    assert registry.list_records(reg_dir) == []


@pytest.mark.timeout(60)
def test_startup_all_ready_then_sigterm_cleans_up(deployments):
    d = deployments("--mode", "push", "--prefill-tp", "2")
    assert d.wait_ready() == ["http://127.0.0.1:18999", "READY"]
    st = _track(d)
    rec = d.record()
    assert len(st) == 9 and all(p.state == "READY" and p.pid > 0 for p in st.values())
    assert len(lifecycle.shm_leftovers(rec.deployment_id)) == 9  # fake children leave theirs behind
    assert os.path.isfile(os.path.join(rec.run_dir, "config.json"))

    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=20) == 0
    _assert_clean(rec, [p.pid for p in st.values()], d.reg_dir)
    if not cuda_device_count()[0]:  # the CPU's pool: --num-blocks' default, said at startup
        assert "KV pool prefill: 2048 blocks x 16 tokens = 32768 tokens of context (1.00 x --max-model-len 32768), " \
               "0.06 GiB per rank on cpu (tp 2; --num-blocks (cpu))" in d.stderr()


@pytest.mark.timeout(60)
def test_a_hang_up_stops_the_deployment_cleanly_unless_nohup_ignores_it(deployments):
    """The terminal (or ssh session) of `pushkv up` gone: SIGHUP stops it as SIGTERM does, nothing left behind (it
    killed the supervisor at once: its children died by SIGKILL, their pools, run dir and record stayed). Under
    nohup the hang-up stays ignored."""
    d = deployments("--mode", "local")
    d.wait_ready()
    st = _track(d)
    rec = d.record()
    d.proc.send_signal(signal.SIGHUP)
    assert d.proc.wait(timeout=20) == 0
    assert "stop requested: SIGHUP" in d.stderr()
    _assert_clean(rec, [p.pid for p in st.values()], d.reg_dir)

    d = deployments("--mode", "local", ignore_hup=True)
    d.wait_ready()
    st = _track(d)
    rec = d.record()
    d.proc.send_signal(signal.SIGHUP)
    for _ in range(3):  # each answer is a turn of the loop, whose tick would have begun the stop a hang-up asks for
        reply = c.ask(rec.control_endpoint, "status")
        assert reply.status == c.OK and reply.info["phase"] == "running", reply.info
    assert d.proc.poll() is None
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=20) == 0
    assert "stop requested: SIGTERM" in d.stderr() and "SIGHUP" not in d.stderr()
    _assert_clean(rec, [p.pid for p in st.values()], d.reg_dir)


def _environ(pid: int) -> dict[str, str]:
    """What the supervisor gave a (fake) child: one that sets no process title keeps it readable."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read().split(b"\0")
    return dict(kv.decode(errors="replace").partition("=")[::2] for kv in raw if b"=" in kv)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("metrics_auth", [False, True])
def test_a_child_gets_only_the_secrets_it_uses(deployments, metrics_auth):
    """The API key reaches the router, and the schedulers only when their /metrics check it
    (--metrics-auth); never a worker or a writer."""
    from pushkv.security import API_KEY_ENV

    d = deployments("--mode", "push", "--api-key", "sk-child", *(["--metrics-auth"] if metrics_auth else []))
    d.wait_ready()
    st = _track(d)
    assert {p.kind for p in st.values()} == {"router", "scheduler", "worker", "writer"}
    for p in st.values():
        env = _environ(p.pid)
        assert env["PUSHKV_NAME"] == p.name
        wants = p.kind == "router" or (p.kind == "scheduler" and metrics_auth)
        assert (env.get(API_KEY_ENV) == "sk-child") is wants and (API_KEY_ENV in env) is wants, p.name
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=20) == 0


@pytest.mark.timeout(60)
def test_metrics_auth_needs_an_api_key(tmp_path, capsys):
    assert cli.main(["up", "--metrics-auth", "--port", "18998"]) == 2
    assert "--metrics-auth puts /metrics behind the API key: give --api-key" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_child_crash_at_startup_fails_at_once(deployments):
    d = deployments("--mode", "local", "--startup-timeout", "60",
                    child_args={"local-worker-0": ["--crash-at-start", "3"]})
    t0 = time.monotonic()
    rc = d.proc.wait(timeout=30)
    assert rc == 1 and time.monotonic() - t0 < 20  # not the 60 s startup deadline
    err = d.stderr()
    assert "local-worker-0" in err and "exit code 3" in err and "startup failed" in err
    assert "READY" not in list(d.lines.queue)
    dep_id = re.search(r"deployment (\w+) \(local mode\)", err).group(1)
    d.ids = [dep_id]
    assert lifecycle.shm_leftovers(dep_id) == []
    assert not os.path.exists(f"/tmp/pushkv-{dep_id}")
    assert registry.list_records(d.reg_dir) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hung, flags, says", [
    ("local-writer-0", ("--startup-timeout", "1"),
     "the writers stage (KV pools allocated and registered with NIXL) is not ready after 1 s: local-writer-0; "
     "if it is only slow, give it longer with --startup-timeout SECONDS"),
    ("local-worker-0", ("--startup-timeout", "10", "--load-timeout", "2"),
     "the workers stage (weights loaded, engine warmed) is not ready after 2 s: local-worker-0; "
     "if it is only slow, give it longer with --load-timeout SECONDS"),
], ids=["writers", "workers"])
def test_a_stage_past_its_time_names_itself_and_its_flag(deployments, hung, flags, says):
    d = deployments("--mode", "local", "--stop-timeout", "2", *flags, child_args={hung: ["--hang-at-start"]})
    assert d.proc.wait(timeout=30) == 1
    err = d.stderr()
    assert says in err, err
    d.ids = [re.search(r"deployment (\w+) \(local mode\)", err).group(1)]
    assert lifecycle.shm_leftovers(d.ids[0]) == []


def _subscribe(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"pushkv.")
    sub.connect(endpoint)
    return sub


def _next_event(sub: zmq.Socket, want_topic: str, timeout=15.0) -> m.LifecycleEvent:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no {want_topic} event within {timeout} s"
        if sub.poll(int(left * 1000)):
            topic, payload = sub.recv_multipart()
            if topic.decode() == want_topic:
                return m.DEC_EVENT.decode(payload)


@pytest.mark.timeout(60)
def test_kill9_after_startup_reported_restarted_ready(deployments, monkeypatch, capsys):
    d = deployments("--mode", "push")
    d.wait_ready()
    st = _track(d)
    rec = d.record()
    sub = _subscribe(rec.events_endpoint)
    _next_event(sub, "pushkv.supervisor.heartbeat")  # subscription is live
    victim = st["decode-writer-0"].pid
    os.kill(victim, signal.SIGKILL)
    ev = _next_event(sub, "pushkv.decode.writer.exit")
    assert (ev.name, ev.pid, ev.detail) == ("decode-writer-0", victim, "killed by SIGKILL")
    ev = _next_event(sub, "pushkv.decode.writer.restart")
    assert ev.restarts == 1 and ev.pid != victim
    ev = _next_event(sub, "pushkv.decode.writer.ready")
    new = d.status()["decode-writer-0"]
    d.track(new.pid)
    assert (new.state, new.restarts, new.pid, new.last_exit) == ("READY", 1, ev.pid, "killed by SIGKILL")
    assert f"ERROR supervisor pushkv.supervisor.supervisor: decode-writer-0 (pid {victim}) died: killed by SIGKILL" in d.stderr()

    # the restart command: Shutdown/SIGTERM, then spawned again
    assert c.ask(rec.control_endpoint, "restart", {"name": "router"}).status == c.OK
    assert _next_event(sub, "pushkv.router.exit").detail == "exit code 0"
    ev = _next_event(sub, "pushkv.router.ready")
    d.track(ev.pid)
    assert d.status()["router"].restarts == 1 and ev.pid != st["router"].pid
    sub.close(0)

    # `pushkv status` and `pushkv stop` through the CLI
    monkeypatch.setenv("PUSHKV_REGISTRY_DIR", d.reg_dir)
    assert cli.main(["status", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["state"] == "running" and len(entry["processes"]) == 7
    assert cli.main(["stop"]) == 0
    assert d.proc.wait(timeout=20) == 0
    _assert_clean(rec, [p.pid for p in st.values()] + [new.pid], d.reg_dir)


@pytest.mark.timeout(60)
def test_on_child_exit_shutdown_policy(deployments):
    d = deployments("--mode", "local", "--on-child-exit", "shutdown",
                    child_args={"router": ["--crash-after", "0.5"]})
    d.wait_ready()
    st = _track(d)
    rec = d.record()
    assert d.proc.wait(timeout=20) == 1
    assert "router" in d.stderr() and "exit code 7" in d.stderr()
    _assert_clean(rec, [p.pid for p in st.values()], d.reg_dir)


@pytest.mark.timeout(60)
def test_restart_cap_then_shutdown(deployments):
    d = deployments("--mode", "local", "--max-restarts", "2",
                    child_args={"local-scheduler": ["--crash-after", "1.5"]})
    d.wait_ready()
    st = _track(d)
    rec = d.record()
    assert d.proc.wait(timeout=30) == 1
    assert "after 2 restarts" in d.stderr()
    _assert_clean(rec, [p.pid for p in st.values()], d.reg_dir)


@pytest.mark.timeout(60)
def test_stubborn_child_is_killed_at_the_deadline(deployments):
    d = deployments("--mode", "local", "--stop-timeout", "2", child_args={"local-worker-0": ["--ignore-term"]})
    d.wait_ready()
    st = _track(d)
    rec = d.record()
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGINT)
    assert d.proc.wait(timeout=20) == 0
    assert 1.5 < time.monotonic() - t0 < 10
    assert "killed after 2 s stop deadline: local-worker-0" in d.stderr()
    _assert_clean(rec, [p.pid for p in st.values()], d.reg_dir)


@pytest.mark.timeout(60)
def test_shutdown_timeout_stops_the_router_alone_first_and_pushkv_stop_waits_for_it(deployments, monkeypatch,
                                                                                  capsys):
    """--shutdown-timeout: the router is asked to stop alone and has that long (a router that ignores Shutdown and
    SIGTERM stands in for a long drain) while the rest runs and `pushkv status` answers (phase draining); then the
    rest stops as ever, and `pushkv stop` waits that much longer."""
    d = deployments("--mode", "local", "--stop-timeout", "1", "--shutdown-timeout", "3",
                    child_args={"router": ["--ignore-term"]})
    d.wait_ready()
    st = _track(d)
    rec = d.record()
    assert rec.shutdown_timeout_s == 3
    t0 = time.monotonic()
    assert c.ask(rec.control_endpoint, "stop").status == c.OK
    end = time.monotonic() + 5
    while (reply := c.ask(rec.control_endpoint, "status")).info["phase"] != "draining":
        assert time.monotonic() < end, reply.info["phase"]
    procs = {p.name: p.state for p in reply.processes}
    assert procs["router"] == "STOPPING" and procs["local-worker-0"] == procs["local-writer-0"] == "READY", procs
    monkeypatch.setenv("PUSHKV_REGISTRY_DIR", d.reg_dir)
    assert cli.main(["stop", rec.deployment_id, "--timeout", "3"]) == 0
    assert 3.5 < time.monotonic() - t0 < 15
    assert d.proc.wait(timeout=10) == 0
    assert "killed after 1 s stop deadline: router" in d.stderr()
    _assert_clean(rec, [p.pid for p in st.values()], d.reg_dir)


@pytest.mark.timeout(60)
def test_the_record_says_whether_the_taps_end_is_under_curve(deployments, tmp_path):
    """`pushkv tap` reads it to ask for the secret (CURVE refuses a client without it and says nothing)."""
    from pushkv.supervisor.plan import free_tcp_port

    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o600)
    for flags, secured in ((["--trace", f"tcp://127.0.0.1:{free_tcp_port('127.0.0.1')}", "--secret-file",
                             str(secret)], True), (["--trace"], False)):
        d = deployments("--mode", "local", *flags)
        d.wait_ready()
        assert d.record().trace_tap_secured is secured, flags
        d.proc.send_signal(signal.SIGINT)
        assert d.proc.wait(timeout=30) == 0


@pytest.mark.timeout(60)
def test_a_second_ctrl_c_cuts_the_drain_short(deployments):
    """Under --shutdown-timeout a first Ctrl-C drains; a second stops now (as uvicorn's, under vllm serve), not at the
    end of the drain (a router that ignores Shutdown and SIGTERM stands in for a long one)."""
    d = deployments("--mode", "local", "--stop-timeout", "1", "--shutdown-timeout", "60",
                    child_args={"router": ["--ignore-term"]})
    d.wait_ready()
    st = _track(d)
    rec = d.record()
    d.proc.send_signal(signal.SIGINT)
    end = time.monotonic() + 5
    while (reply := c.ask(rec.control_endpoint, "status")).info["phase"] != "draining":
        assert time.monotonic() < end, reply.info["phase"]
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGINT)
    assert d.proc.wait(timeout=20) == 0
    assert time.monotonic() - t0 < 15  # the stop's own deadline, not the drain's 60 s
    assert "SIGINT again while the router drains: stopping now" in d.stderr()
    _assert_clean(rec, [p.pid for p in st.values()], d.reg_dir)


@pytest.mark.timeout(60)
def test_children_die_with_supervisor_and_stop_cleans_stale(deployments, monkeypatch, capsys):
    d = deployments("--mode", "local")
    d.wait_ready()
    st = _track(d)
    rec = d.record()
    d.proc.kill()
    d.proc.wait(timeout=10)
    assert all(_gone(p.pid) for p in st.values())  # PR_SET_PDEATHSIG
    monkeypatch.setenv("PUSHKV_REGISTRY_DIR", d.reg_dir)
    assert cli.main(["status"]) == 1
    assert "stale" in capsys.readouterr().out
    assert lifecycle.shm_leftovers(rec.deployment_id)
    assert cli.main(["stop", rec.deployment_id[:4]]) == 0
    _assert_clean(rec, [], d.reg_dir)


def test_planned_ports_never_take_the_router_port():
    from pushkv.config import DeploymentConfig, InstanceConfig
    from pushkv.supervisor.plan import plan_deployment

    picks = iter([8000, 8000, 9001, 9002, 9003, 9004])
    cfg = DeploymentConfig(port=8000, prefill=InstanceConfig(role="prefill", tp=2),
                           decode=InstanceConfig(role="decode", tp=2))
    planned = plan_deployment(cfg, pick_port=lambda: next(picks))
    used = [int(i.dist_init.rsplit(":", 1)[1]) for i in (planned.prefill, planned.decode)]
    assert 8000 not in used and len(set(used)) == len(used)
