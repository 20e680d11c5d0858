"""Tracing: the publisher/forwarder pair, the tap's timeline analysis (pure,
by table), and real deployments tapped end to end (push and pull), with the
router's /metrics and `pushkv status` checked on the same deployment."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request

import msgspec
import pytest
import zmq

from pushkv import messages as m
from pushkv.trace import TraceForwarder, TracePublisher
from tools.trace import tap as tap_cli
from tools.trace import timeline as T
from tools.trace import merge as trace_merge

TID = "0123456789abcdef0123456789abcdef"


# ---------------------------------------------------------------------------
# synthetic traces: (ms, process, direction, kind, peer/detail)
# ---------------------------------------------------------------------------
def events(script, tid=TID) -> list[m.TraceEvent]:
    out = []
    for t_ms, proc, direction, kind, peer, *payload in script:
        out.append(m.TraceEvent(t_mono=100.0 + t_ms / 1e3, t_wall=1e9 + t_ms / 1e3, process=proc,
                                direction=direction, peer=peer, kind=kind,
                                transfer_id=tid if kind not in ("ExecuteStep", "StepDone") else "",
                                payload=payload[0] if payload else b""))
    return out


def push_script(reg_ms: float, posted_ms: float):
    step = m.encode(m.ExecuteStep(1, (m.SeqWork(1, (1, 2, 3), 0, (0,)),)))
    done = m.encode(m.StepDone(1, (7,), 0.004))
    return [
        (0.0, "router", "event", "http_request", "prompt=3 max_tokens=3"),
        (0.1, "router", "send", "Generate", "prefill-scheduler"),
        (0.2, "router", "send", "Generate", "decode-scheduler"),
        (0.3, "prefill-scheduler", "recv", "Generate", "router"),
        (0.4, "prefill-scheduler", "event", "prefill_queued", ""),
        (0.5, "prefill-scheduler", "event", "prefill_alloc", ""),
        (0.6, "prefill-scheduler", "event", "prefill_start", ""),
        (0.62, "prefill-worker-0", "recv", "ExecuteStep", "prefill-scheduler", step),
        (0.4, "decode-scheduler", "recv", "Generate", "router"),
        (0.5, "decode-scheduler", "event", "decode_queued", ""),
        (0.6, "decode-scheduler", "event", "decode_alloc", ""),
        (0.7, "decode-scheduler", "send", "ExpectKV", "decode-writer-0"),
        (0.75, "decode-scheduler", "event", "registration_sent", ""),
        (0.8, "decode-writer-0", "recv", "ExpectKV", "decode-scheduler"),
        (0.9, "decode-writer-0", "send", "Register", "prefill-x-w0"),
        (1.0, "decode-writer-0", "event", "registration_sent", ""),
        (reg_ms, "prefill-writer-0", "recv", "Register", "decode-x-w0"),
        (4.9, "prefill-worker-0", "send", "StepDone", "prefill-scheduler", done),
        (5.0, "prefill-scheduler", "event", "prefill_end", ""),
        (5.1, "prefill-scheduler", "send", "SendKV", "prefill-writer-0"),
        (5.15, "prefill-scheduler", "event", "send_kv", ""),
        (5.2, "prefill-writer-0", "recv", "SendKV", "prefill-scheduler"),
        (posted_ms, "prefill-writer-0", "event", "write_posted", "4096B/2d"),
        (7.0, "prefill-writer-0", "event", "write_done", ""),
        (7.1, "prefill-writer-0", "send", "KVSent", "prefill-scheduler"),
        (7.2, "prefill-scheduler", "recv", "KVSent", "prefill-writer-0"),
        (7.3, "prefill-scheduler", "event", "kv_sent", ""),
        (7.4, "prefill-scheduler", "send", "PrefillFinished", "router"),
        (7.5, "router", "recv", "PrefillFinished", "prefill-scheduler"),
        (7.2, "decode-writer-0", "recv", "WriteDone", "prefill-x-w0"),
        (7.3, "decode-writer-0", "event", "kv_received", ""),
        (7.4, "decode-writer-0", "send", "KVReceived", "decode-scheduler"),
        (7.5, "decode-scheduler", "recv", "KVReceived", "decode-writer-0"),
        (7.6, "decode-scheduler", "event", "kv_received", ""),
        (7.7, "decode-scheduler", "send", "TokensGenerated", "router"),
        (7.9, "router", "recv", "TokensGenerated", "decode-scheduler"),
        (9.0, "decode-scheduler", "send", "TokensGenerated", "router"),
        (9.2, "router", "recv", "TokensGenerated", "decode-scheduler"),
        (9.3, "decode-scheduler", "event", "finished", ""),
        (9.4, "decode-scheduler", "send", "TokensGenerated", "router"),
        (9.5, "router", "recv", "TokensGenerated", "decode-scheduler"),
        (9.6, "router", "event", "http_done", "ok"),
    ]


PULL = [
    (0.0, "router", "event", "http_request", ""),
    (0.1, "router", "send", "Generate", "prefill-scheduler"),
    (0.3, "prefill-scheduler", "recv", "Generate", "router"),
    (0.4, "prefill-scheduler", "event", "prefill_queued", ""),
    (0.6, "prefill-scheduler", "event", "prefill_start", ""),
    (4.0, "prefill-scheduler", "event", "prefill_end", ""),
    (4.1, "prefill-scheduler", "send", "HoldKV", "prefill-writer-0"),
    (4.2, "prefill-writer-0", "recv", "HoldKV", "prefill-scheduler"),
    (4.3, "prefill-scheduler", "send", "PrefillFinished", "router"),
    (4.5, "router", "recv", "PrefillFinished", "prefill-scheduler"),
    (4.6, "router", "send", "Generate", "decode-scheduler"),
    (4.8, "decode-scheduler", "recv", "Generate", "router"),
    (4.9, "decode-scheduler", "event", "decode_queued", ""),
    (5.0, "decode-scheduler", "event", "decode_alloc", ""),
    (5.1, "decode-scheduler", "send", "ReadKV", "decode-writer-0"),
    (5.15, "decode-scheduler", "event", "read_posted", ""),
    (5.2, "decode-writer-0", "recv", "ReadKV", "decode-scheduler"),
    (5.5, "decode-writer-0", "event", "read_posted", "8192B/1d"),
    (6.5, "decode-writer-0", "event", "read_done", ""),
    (6.6, "decode-writer-0", "send", "ReadDone", "prefill-x-w0"),
    (6.7, "decode-writer-0", "send", "KVReceived", "decode-scheduler"),
    (6.9, "decode-scheduler", "recv", "KVReceived", "decode-writer-0"),
    (7.0, "decode-scheduler", "event", "kv_received", ""),
    (7.1, "decode-scheduler", "send", "TokensGenerated", "router"),
    (7.2, "router", "recv", "TokensGenerated", "decode-scheduler"),
    (7.3, "prefill-writer-0", "recv", "ReadDone", "decode-x-w0"),
    (7.4, "prefill-writer-0", "send", "KVSent", "prefill-scheduler"),
    (7.5, "prefill-scheduler", "recv", "KVSent", "prefill-writer-0"),
    (7.6, "prefill-scheduler", "event", "kv_sent", ""),
    (8.0, "decode-scheduler", "send", "TokensGenerated", "router"),
    (8.1, "decode-scheduler", "event", "finished", ""),
    (8.2, "router", "recv", "TokensGenerated", "decode-scheduler"),
    (8.3, "router", "event", "http_done", "ok"),
]

# pull's protocol, push's WRITE (--pull-read write): D registers after the relay, P WRITEs
PULL_WRITE = [e for e in PULL if e[3] != "ReadDone" and not (e[1] == "decode-writer-0" and e[3].startswith("read_"))] + [
    (5.3, "decode-writer-0", "send", "Register", "prefill-x-w0"),
    (5.4, "decode-writer-0", "event", "registration_sent", ""),
    (5.6, "prefill-writer-0", "recv", "Register", "decode-x-w0"),
    (5.8, "prefill-writer-0", "event", "write_posted", "8192B/1d"),
    (6.4, "prefill-writer-0", "event", "write_done", ""),
    (6.5, "prefill-writer-0", "send", "KVSent", "prefill-scheduler"),
    (6.55, "decode-writer-0", "recv", "WriteDone", "prefill-x-w0"),
    (6.6, "decode-writer-0", "event", "kv_received", ""),
]
PULL_WRITE = [e for e in PULL_WRITE if not (e[1] == "prefill-writer-0" and e[3] == "KVSent" and e[0] == 7.4)]

LOCAL = [
    (0.0, "router", "event", "http_request", ""),
    (0.1, "router", "send", "Generate", "local-scheduler"),
    (0.2, "local-scheduler", "recv", "Generate", "router"),
    (0.3, "local-scheduler", "event", "local_queued", ""),
    (0.4, "local-scheduler", "event", "prefill_start", ""),
    (3.0, "local-scheduler", "event", "prefill_end", ""),
    (3.1, "local-scheduler", "event", "first_token", ""),
    (3.2, "local-scheduler", "send", "TokensGenerated", "router"),
    (3.4, "router", "recv", "TokensGenerated", "local-scheduler"),
    (4.5, "local-scheduler", "send", "TokensGenerated", "router"),
    (4.6, "local-scheduler", "event", "finished", ""),
    (4.7, "router", "recv", "TokensGenerated", "local-scheduler"),
    (4.8, "router", "event", "http_done", "ok"),
]

CASES = {
    # name: (script, mode, stages in ms, info)
    "push registration first": (
        push_script(1.2, 5.3), "push",
        {"queue": 0.6, "prefill": 4.4, "relay": 0.3, "transfer": 2.3, "first_decode_step": 1.4,
         "ttft": 7.9, "e2e": 9.6, "rendezvous_wait": 4.0, "write": 1.7},
        {"rendezvous": "registration_first", "bytes": 4096, "descriptors": 2}),
    "push prefill first": (
        push_script(5.3, 5.4), "push",
        {"prefill": 4.4, "relay": 0.4, "transfer": 2.2, "rendezvous_wait": 0.1},
        {"rendezvous": "prefill_first"}),
    "pull": (
        PULL, "pull",
        {"queue": 0.6, "prefill": 3.4, "relay": 1.5, "transfer": 1.5, "first_decode_step": 1.0,
         "ttft": 7.2, "read": 1.0},
        {"bytes": 8192, "descriptors": 1}),
    "pull write": (
        PULL_WRITE, "pull",
        {"relay": 1.8, "transfer": 1.2, "write": 0.6, "rendezvous_wait": 1.4},
        {"bytes": 8192, "descriptors": 1, "rendezvous": "prefill_first", "mode": "pull-write"}),
    "local": (
        LOCAL, "local", {"queue": 0.4, "prefill": 2.6, "first_decode_step": 1.3, "ttft": 3.4, "e2e": 4.8}, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_timeline_stages_spans_and_order(name):
    script, mode, stages, info = CASES[name]
    tl = T.RequestTimeline(TID, events(script))
    assert tl.mode == mode and tl.complete
    assert T.problems(tl) == []
    got = tl.stages()
    for k, ms in stages.items():
        assert got[k] * 1e3 == pytest.approx(ms, abs=1e-6), k
    for k, v in info.items():
        assert tl.info[k] == v, k
    for s in tl.spans:
        assert s.end >= s.start, s


def test_push_rendezvous_span_names_the_waiting_half():
    first = {s.name: s for s in T.RequestTimeline(TID, events(push_script(1.2, 5.3))).spans}
    assert "wait for prefill" in first and first["wait for prefill"].lane == "prefill-writer-0"
    assert first["WRITE"].args == {"bytes": 4096, "descriptors": 2}
    later = {s.name for s in T.RequestTimeline(TID, events(push_script(5.3, 5.4))).spans}
    assert "wait for registration" in later


def test_streamed_push_order_is_the_writers_and_its_wait_ends_at_the_first_group():
    """Streamed push: the writer's rendezvous counts the first stored layer group, not the SendKV at the
    prefill's end. A registration between the two is prefill first (the KVSent says so), and the wait runs
    from the group (the writer's wall-clock stage on the monotonic clock) to the registration."""
    group_ms, reg_ms = 2.0, 3.0
    sent = m.encode(m.KVSent(TID, 0, 4096, 2, 0.001, "prefill_first",
                             (("stream_progress", 1e9 + group_ms / 1e3), ("layers_stored_0", 1e9 + group_ms / 1e3)), 1))
    script = [e if e[3] != "KVSent" or e[2] != "send" else (*e, sent) for e in push_script(reg_ms, 5.3)]
    tl = T.RequestTimeline(TID, events(script))
    assert tl.info["rendezvous"] == "prefill_first"
    wait = next(s for s in tl.spans if s.name.startswith("wait for"))
    assert wait.name == "wait for registration" and wait.lane == "prefill-writer-0"
    assert (wait.start - 100.0) * 1e3 == pytest.approx(group_ms, abs=1e-3)
    assert (wait.end - 100.0) * 1e3 == pytest.approx(reg_ms, abs=1e-6)
    # a chunk's StreamKV is a progress mark too, and without the KVSent's order the times decide
    chunked = [e for e in push_script(reg_ms, 5.3)] + [(group_ms, "prefill-writer-0", "recv", "StreamKV", "prefill-scheduler")]
    assert T.RequestTimeline(TID, events(chunked)).info["rendezvous"] == "prefill_first"
    assert T.RequestTimeline(TID, events(push_script(reg_ms, 5.3))).info["rendezvous"] == "registration_first"


@pytest.mark.parametrize("mutate, problem", [
    (lambda s: [e for e in s if e[3] != "write_posted"], "missing span prefill-writer/WRITE"),
    (lambda s: [e if e[3] != "kv_received" or e[1] != "decode-writer-0" else (4.0, *e[1:]) for e in s],
     "decode-writer.kv_received"),
    (lambda s: [e for e in s if e[3] != "http_done"], "missing span router/request"),
])
def test_problems_name_what_is_missing_or_out_of_order(mutate, problem):
    tl = T.RequestTimeline(TID, events(mutate(push_script(1.2, 5.3))))
    assert any(problem in p for p in T.problems(tl)), T.problems(tl)


def test_perfetto_one_group_per_request_with_lanes_spans_flows_and_steps():
    evs = events(push_script(1.2, 5.3)) + events(PULL, tid="f" * 32)
    doc = json.loads(json.dumps(T.perfetto(evs)))
    te = doc["traceEvents"]
    groups = {e["pid"]: e["args"]["name"] for e in te if e["name"] == "process_name"}
    assert sorted(groups.values())[0] == "engine steps"
    assert any(g.startswith("request 01234567 (push, TTFT 7.9 ms)") for g in groups.values())
    assert any(g.startswith("request ffffffff (pull") for g in groups.values())
    push_pid = next(p for p, g in groups.items() if g.startswith("request 01234567"))
    lanes = {e["tid"]: e["args"]["name"] for e in te if e["name"] == "thread_name" and e["pid"] == push_pid}
    assert list(lanes.values())[:3] == ["router", "prefill-scheduler", "prefill-writer-0"]
    spans = {(lanes[e["tid"]], e["name"]) for e in te if e["ph"] == "X" and e["pid"] == push_pid}
    msgs = [e for e in te if e.get("cat") == "message"]
    assert msgs and all(e["ph"] == "X" and e["dur"] == 0 for e in msgs)  # flows bind to these
    assert {("prefill-scheduler", "prefill"), ("prefill-writer-0", "WRITE"), ("decode-writer-0", "registration"),
            ("decode-scheduler", "first decode step"), ("router", "TTFT")} <= spans
    starts = {e["id"]: e for e in te if e["ph"] == "s"}
    ends = [e for e in te if e["ph"] == "f"]
    assert ends and all(e["id"] in starts and e["ts"] >= starts[e["id"]]["ts"] for e in ends)
    steps = [e for e in te if e["ph"] == "X" and e["pid"] == 0]
    assert steps[0]["name"] == "step 1: 1 seq (1 prefill)" and steps[0]["dur"] == pytest.approx(4280.0)


def test_summarize_and_filter():
    gen = m.Generate("t" * 32, 0, "decode", tuple(range(100)), 4, source=m.PrefillSource("p", 1, ("tcp://x",)))
    ev = m.TraceEvent(1.0, 2.0, "decode-scheduler", "recv", "router", "Generate", gen.transfer_id, m.encode(gen))
    text = T.summarize(T.decode_payload(ev))
    assert "prompt_token_ids=[100 items]" in text and "leg=decode" in text and "max_tokens=4" in text
    assert tap_cli.Filter(["ttt"], ["decode-*"], ["generate"])(ev)
    assert not tap_cli.Filter(["x"])(ev) and not tap_cli.Filter(processes=["prefill"])(ev)
    assert not tap_cli.Filter(kinds=["Register"])(ev)
    assert "decode-scheduler" in tap_cli.format_event(ev, 0.5) and "<-" in tap_cli.format_event(ev, 0.5)


def test_breakdown_table_and_replay(tmp_path, capsys):
    evs = events(push_script(1.2, 5.3)) + events(PULL, tid="f" * 32)
    rec = tmp_path / "ev.msgpack"
    rec.write_bytes(msgspec.msgpack.encode(evs))
    pf = tmp_path / "t.json"
    assert tap_cli.main(["--replay", str(rec), "--breakdown", "--spans", "--perfetto", str(pf),
                         "--kind", "Register"]) == 0
    out = capsys.readouterr().out
    assert out.count(" Register ") == 2  # the filtered live log: send and recv
    rows = [ln for ln in out.splitlines() if ln.startswith(("01234567", "ffffffff", "median"))]
    assert len(rows) == 3 and "registration_first" in rows[0] and "7.90" in rows[0]
    assert json.loads(pf.read_text())["traceEvents"]
    assert "request 01234567 (push, TTFT 7.90 ms)" in out and "request ffffffff (pull" in out
    write = next(ln for ln in out.splitlines() if " WRITE " in ln).split()
    assert write[0] == "+5.300" and write[2] == "1.700" and write[4] == "prefill-writer-0"
    # a live --requests 1 lists the first request that finished, not one that ended while it lingered
    tap_cli.report(evs, tap_cli.parse_args(["--breakdown"]), only=["f" * 32])
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("01234567", "ffffffff", "median"))]
    assert len(rows) == 1 and rows[0].startswith("ffffffff")


# ---------------------------------------------------------------------------
# publisher -> forwarder -> taps
# ---------------------------------------------------------------------------
@contextlib.contextmanager
def recorded_supervisor(tmp_path, dep_id: str, **fields):
    """A registry (yielded) holding one deployment's record, ``fields`` in it, whose supervisor is a live process
    titled as one (so `pushkv tap` finds it running) until the block ends."""
    from pushkv.supervisor import registry

    reg = tmp_path / "reg"
    reg.mkdir(mode=0o700)
    sup = subprocess.Popen([sys.executable, "-c", "import setproctitle, sys; setproctitle.setproctitle("
                            f"'pushkv supervisor {dep_id}'); print('titled', flush=True); sys.stdin.read()"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert sup.stdout.readline().strip() == "titled"
        registry.write_record(registry.DeploymentRecord(
            dep_id, sup.pid, "ipc://c", "ipc://e", "http://x", str(tmp_path / "run"), "push", 0.0, **fields), str(reg))
        yield reg
    finally:
        sup.stdin.close()
        sup.wait(timeout=30)


def tap_command(reg, *args: str) -> dict:
    """`pushkv tap ARGS` from the checkout, reading the registry ``reg``: subprocess's args, cwd and env."""
    return {"args": [sys.executable, "-m", "tools.cli", "tap", *args],
            "cwd": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            "env": dict(os.environ, PUSHKV_REGISTRY_DIR=str(reg))}


@pytest.mark.timeout(30)
def test_a_tap_found_through_the_registry_ends_when_its_deployment_stops(tmp_path):
    """`pushkv tap` (live until Ctrl-C) waited for good once the deployment had stopped, saying nothing: now it
    says so and ends, writing what it was asked to (its breakdown here)."""
    with recorded_supervisor(tmp_path, "dead0001", trace_tap_endpoint=f"ipc://{tmp_path}/tap.sock") as reg:
        tap = subprocess.Popen(**tap_command(reg, "-q", "--breakdown"), text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
        try:
            assert tap.wait(timeout=3) is None, tap.communicate()  # the deployment runs: the tap keeps listening
        except subprocess.TimeoutExpired:
            pass
    try:
        out, err = tap.communicate(timeout=15)
    finally:
        tap.kill()
    assert tap.returncode == 0, err
    assert "pushkv tap: deployment dead0001 stopped" in err and "no request seen" in out


def test_forwarder_fans_out_and_publishers_never_block(tmp_path):
    pub_ep, tap_ep = f"ipc://{tmp_path}/trace.sock", f"ipc://{tmp_path}/tap.sock"
    ctx = zmq.Context()
    pub = TracePublisher("p", pub_ep, ctx)
    t0 = time.monotonic()
    for _ in range(20000):  # nobody listening: dropped at the publisher, no blocking
        pub.event("noise")
    assert time.monotonic() - t0 < 5
    fwd = TraceForwarder(pub_ep, tap_ep, ctx)
    fwd.start()
    taps = [tap_cli.Tap(tap_ep, ctx=ctx) for _ in range(2)]
    try:
        got = [[], []]
        deadline = time.monotonic() + 10
        while not all(any(e.kind == "hello" for e in g) for g in got):  # until subscriptions reach the PUB
            assert time.monotonic() < deadline, "events never reached both taps"
            pub.event("hello", TID, "x")
            for g, tap in zip(got, taps):
                g.extend(tap.poll(20))
        ev = next(e for e in got[0] if e.kind == "hello")
        assert (ev.process, ev.direction, ev.transfer_id, ev.peer) == ("p", "event", TID, "x")
        pub.msg("send", "peer", m.Abort(TID, 3, "r"), m.encode(m.Abort(TID, 3, "r")))
        deadline = time.monotonic() + 5
        while not any(e.kind == "Abort" for e in got[1]):
            assert time.monotonic() < deadline
            got[1].extend(taps[1].poll(50))
        ab = next(e for e in got[1] if e.kind == "Abort")
        assert T.decode_payload(ab) == m.Abort(TID, 3, "r")
    finally:
        for tap in taps:
            tap.close()
        fwd.stop()
        pub.close()
        ctx.term()
    assert fwd._thread is None


# ---------------------------------------------------------------------------
# real deployments, tapped
# ---------------------------------------------------------------------------
ACTORS = {"prefill-scheduler", "prefill-worker-0", "prefill-writer-0",
          "decode-scheduler", "decode-worker-0", "decode-writer-0"}
FLAGS = ("--model", "tiny", "--num-blocks", "64", "--trace", "--ping-interval", "0.3")


class Collector:
    """The in-process tap of a test: every event so far, and waits on conditions."""

    def __init__(self, endpoint: str):
        self.tap = tap_cli.Tap(endpoint)
        self.events: list[m.TraceEvent] = []

    def until(self, pred, timeout_s: float = 20.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout_s
        while not pred(self.events):
            assert time.monotonic() < deadline, f"tap: {what} not seen within {timeout_s} s"
            self.events.extend(self.tap.poll(50))

    def request(self, tid: str) -> T.RequestTimeline:
        self.until(lambda evs: T.RequestTimeline(tid, [e for e in evs if e.transfer_id == tid]).complete,
                   what=f"request {tid} complete")
        return T.RequestTimeline(tid, [e for e in self.events if e.transfer_id == tid])

    def attach(self, dep) -> None:
        """Subscribed everywhere: every actor seen (pings), then the router (a warm-up request)."""
        self.until(lambda evs: ACTORS <= {e.process for e in evs}, what="every actor")
        tid = dep.complete([1, 2, 3], 2)["pushkv"]["transfer_id"]
        self.until(lambda evs: any(e.kind == "http_done" and e.transfer_id == tid for e in evs), what="router")

    def close(self) -> None:
        self.tap.close()


def kv_bytes(dep, tokens: int) -> int:
    """Whole blocks move (P and D share a block size here)."""
    bs = dep.cfg.prefill.block_size
    return -(-tokens // bs) * bs * dep.cfg.model.kv_bytes_per_token()


def _metrics(dep) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(dep.url + "/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


@pytest.mark.timeout(90)
def test_push_deployment_tapped_spans_complete_and_ordered(tmp_path, monkeypatch, capsys):
    from processes import cli
    from tests.support.deploy import deployment, wait_pools_free

    reg = tmp_path / "registry"
    with deployment(tmp_path, "--mode", "push", *FLAGS) as dep:
        endpoint, rec = tap_cli.find_endpoint(directory=str(reg))
        assert endpoint == dep.cfg.trace_tap_endpoint and rec.trace_tap_endpoint == endpoint
        col = Collector(endpoint)
        try:
            col.attach(dep)
            # the console tool alongside: live log filtered to the push protocol, breakdown, Perfetto
            env = dict(os.environ, PUSHKV_REGISTRY_DIR=str(reg))
            pf, raw = tmp_path / "push.json", tmp_path / "push.msgpack"
            cmd = [sys.executable, "-m", "tools.trace.tap", "--requests", "1", "--breakdown", "--perfetto", str(pf),
                   "--record", str(raw), "--kind", "Register", "--kind", "WriteDone", "--kind", "write_posted"]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                for line in proc.stderr:  # waits on the tool's own "receiving" line, not on time
                    if line.startswith("receiving events"):
                        break
                prompt = list(range(1, 101))
                body = dep.complete(prompt, 4)
                tid = body["pushkv"]["transfer_id"]
                out, err = proc.communicate(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            assert proc.returncode == 0, err
            assert raw.stat().st_mode & 0o077 == 0  # the record holds the prompts' token ids: its owner's alone

            tl = col.request(tid)
            assert tl.mode == "push" and T.problems(tl) == []
            mk = tl.marks
            assert mk["decode-writer.send_register"] < mk["prefill-writer.write_posted"]
            assert mk["prefill.prefill_start"] < mk["prefill.prefill_end"] <= mk["prefill-writer.write_posted"]
            # write_posted is stamped when the post call returns: the last WRITE of a layer-streamed
            # prefill is small, and its notification may reach D first; the KV lands after prefill end
            assert mk["prefill.prefill_end"] < mk["decode-writer.kv_received"] < mk["router.first_token"]
            st = tl.stages()
            assert all(st[k] >= 0 for k in ("prefill", "relay", "transfer", "first_decode_step", "ttft"))
            assert st["ttft"] <= st["e2e"]
            assert tl.info["bytes"] == kv_bytes(dep, 100) and tl.info["descriptors"] >= 1
            # the breakdown's order is the writer's own (streamed, its first layer group may beat the registration)
            assert tl.info["rendezvous"] == body["pushkv"]["kv"]["prefill"]["rendezvous"]
            assert tl.info["rendezvous"] in ("registration_first", "prefill_first")

            # the tool's outputs
            live = [ln for ln in out.splitlines() if " ms  " in ln and tid[:8] in ln]
            assert {ln.split()[5] for ln in live} == {"Register", "WriteDone", "write_posted"}, live
            row = next(ln for ln in out.splitlines() if ln.startswith(tid[:8]))
            assert row.split()[1] == "push" and tl.info["rendezvous"] in row
            assert "incomplete" not in out and "missing" not in out
            doc = json.loads(pf.read_text())
            names = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"}
            assert {"prefill", "WRITE", "registration", "KV wait", "await KV", "decode", "TTFT"} <= names
            replayed = msgspec.msgpack.decode(raw.read_bytes(), type=list[m.TraceEvent])
            assert T.problems(T.RequestTimeline(tid, [e for e in replayed if e.transfer_id == tid])) == []

            # the same events as if D ran on another host whose clock reads 1234.5 s more: the merge
            # finds that offset from the messages between the hosts (router <-> D scheduler, P's and
            # D's writers), within its stated error, and the request reads as it did on one clock
            moved = [msgspec.structs.replace(e, host="d-host", t_mono=e.t_mono + 1234.5)
                     if e.process.startswith("decode") else msgspec.structs.replace(e, host="p-host")
                     for e in replayed]
            back, al = trace_merge.merged(moved)
            assert al.reference == "p-host" and al.unaligned == []
            assert abs(al.offsets["d-host"] + 1234.5) <= al.error_s["d-host"] < 0.05, al
            assert {e.process for e in back if e.process.startswith("decode-writer")} == {"decode-writer-0@d-host"}
            again = T.RequestTimeline(tid, [e for e in back if e.transfer_id == tid])
            assert T.problems(again) == []
            assert abs(again.stages()["ttft"] - st["ttft"]) <= al.error_s["d-host"]
        finally:
            col.close()

        # /metrics on the same deployment: per-transfer histograms and the instances' gauges
        wait_pools_free(dep)
        got = _metrics(dep)
        assert got["pushkv_router_requests_total{outcome=ok}"] == 2
        assert got["pushkv_router_ttft_seconds_count"] == 2 and got["pushkv_router_tpot_seconds_count"] == 2
        assert got["pushkv_kv_transfer_bytes_count"] == 2
        assert got["pushkv_kv_transfer_bytes_sum"] == kv_bytes(dep, 3) + kv_bytes(dep, 100)
        assert got["pushkv_kv_transfer_descriptors_count"] == 2 and got["pushkv_kv_transfer_seconds_count"] == 2
        orders = {k: v for k, v in got.items() if k.startswith("pushkv_kv_rendezvous_total")}
        assert sum(orders.values()) == 2 and len(orders) == 2
        eng = dep.cfg.prefill.engine_id
        assert got[f"pushkv_instance_blocks{{engine={eng},role=prefill}}"] == 64
        assert got[f"pushkv_instance_block_usage{{engine={eng},role=prefill}}"] == 0
        assert got[f"pushkv_instance_kv_transfers_total{{engine={eng},role=prefill}}"] == 2
        assert got[f"pushkv_instance_lease_expiries_total{{engine={eng},role=prefill}}"] == 0
        assert got[f"pushkv_instance_aborts_total{{engine={eng},role=prefill}}"] == 0
        assert got[f"pushkv_writer_events_total{{engine={eng},event=writes,rank=0,role=prefill}}"] == 2
        assert got[f"pushkv_instance_up{{engine={dep.cfg.decode.engine_id},role=decode}}"] == 1

        # `pushkv status`: every process with pid, uptime, restarts, health
        monkeypatch.setenv("PUSHKV_REGISTRY_DIR", str(reg))
        capsys.readouterr()
        assert cli.main(["status"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith(f"deployment {dep.cfg.deployment_id}") and "running" in lines[0]
        assert lines[1].split() == ["NAME", "PID", "STATE", "UPTIME", "RESTARTS", "HEALTH", "LAST", "EXIT"]
        end = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["INSTANCE"])
        rows = {ln.split()[0]: ln.split() for ln in lines[2:end]}
        # then one row per instance, up, all processes ready (the router's cost model follows)
        insts = [ln.split() for ln in lines[end + 1:]
                 if ln.split() and "cost model:" not in ln and ln.split()[1:2] != ["metrics"]]
        urls = [ln.split() for ln in lines[end + 1:] if ln.split()[1:2] == ["metrics"]]  # each instance's own /metrics
        assert [u[0] for u in urls] == ["prefill", "decode"] and all(u[2].endswith("/metrics") for u in urls), urls
        assert [(r[0], r[1], r[3], r[4]) for r in insts] == [
            ("prefill", dep.cfg.prefill.engine_id, "up", "3/3"), ("decode", dep.cfg.decode.engine_id, "up", "3/3")]
        assert set(rows) == ACTORS | {"router"}
        for name, cols in rows.items():
            assert int(cols[1]) > 0 and cols[2] == "READY" and cols[3].endswith("s") and cols[4] == "0", cols
            assert cols[5] == "ok", cols


@pytest.mark.timeout(90)
def test_pull_deployment_tapped_spans_complete_and_ordered(tmp_path):
    from tests.support.deploy import deployment

    with deployment(tmp_path, "--mode", "pull", *FLAGS) as dep:
        col = Collector(dep.cfg.trace_tap_endpoint)
        try:
            col.attach(dep)
            tid = dep.complete(list(range(1, 101)), 4)["pushkv"]["transfer_id"]
            tl = col.request(tid)
        finally:
            col.close()
        assert tl.mode == "pull" and T.problems(tl) == []
        mk = tl.marks
        assert mk["prefill.prefill_end"] <= mk["router.prefill_finished"] <= mk["router.send_decode"]
        assert mk["router.send_decode"] < mk["decode-writer.read_posted"] < mk["decode-writer.read_done"]
        assert mk["decode-writer.read_done"] < mk["prefill-writer.recv_readdone"]  # P frees after D's READ
        spans = {(s.lane, s.name) for s in tl.spans}
        assert {("router", "relay"), ("decode-writer-0", "READ"), ("prefill-writer-0", "lease")} <= spans
        st = tl.stages()
        assert st["relay"] > 0 and st["transfer"] > 0 and st["read"] > 0
        assert tl.info["bytes"] == kv_bytes(dep, 100)
        got = _metrics(dep)
        assert got["pushkv_kv_transfer_seconds_count"] == 2  # D's READ times, from the decode leg
        assert not any(k.startswith("pushkv_kv_rendezvous_total") for k in got)


def decode_local_script():
    """A push deployment with --conditional-disagg whose router had D prefill the prompt itself (path decode-local):
    no P process sees the request. As a tap recorded it."""
    tokens = m.encode(m.TokensGenerated(TID, 0, (222,)))
    return [
        (0.0, "router", "event", "http_request", "prompt=34 max_tokens=3"),
        (3.8, "router", "send", "Generate", "decode-scheduler"),
        (13.9, "decode-scheduler", "recv", "Generate", "router"),
        (14.2, "decode-scheduler", "event", "decode_queued", ""),
        (14.21, "decode-scheduler", "event", "decode_alloc", ""),
        (14.22, "decode-scheduler", "event", "prefill_start", ""),
        (106.5, "decode-scheduler", "event", "prefill_end", ""),
        (106.55, "decode-scheduler", "event", "first_token", ""),
        (106.56, "decode-scheduler", "send", "TokensGenerated", "router", tokens),
        (107.1, "router", "recv", "TokensGenerated", "decode-scheduler", tokens),
        (132.3, "decode-scheduler", "send", "TokensGenerated", "router", tokens),
        (132.9, "router", "recv", "TokensGenerated", "decode-scheduler", tokens),
        (160.3, "decode-scheduler", "event", "finished", ""),
        (160.4, "decode-scheduler", "send", "TokensGenerated", "router", tokens),
        (160.9, "router", "recv", "TokensGenerated", "decode-scheduler", tokens),
        (164.7, "router", "event", "http_done", "ok"),
    ]


def test_a_request_d_prefilled_itself_has_its_spans_and_stages():
    """A decode-local request was taken for a push one: no queue, prefill or decode span, every breakdown column
    "-" but TTFT and e2e, and "incomplete (still running when the tap stopped?)" for a request that had ended."""
    tl = T.RequestTimeline(TID, events(decode_local_script()))
    assert tl.variant == "decode-local" and tl.complete and T.problems(tl) == []
    spans = {(s.lane, s.name) for s in tl.spans}
    assert {("decode-scheduler", "queued"), ("decode-scheduler", "prefill"), ("decode-scheduler", "decode"),
            ("decode-scheduler", "first decode step")} <= spans
    st = tl.stages()
    assert st["queue"] == pytest.approx(0.01422) and st["prefill"] == pytest.approx(0.09228)
    assert st["first_decode_step"] == pytest.approx(0.132_3 - 0.106_56) and st["ttft"] == pytest.approx(0.1071)
    assert "relay" not in st and "transfer" not in st
    table = T.breakdown_table([tl])
    assert "decode-local" in table and "incomplete" not in table


def test_a_last_write_d_has_before_its_post_call_returns_counts_no_negative_transfer():
    """write_posted is stamped when the post call returns: a layer-streamed push's last WRITE is
    small, and D may have it first. The transfer stage is then 0, never negative, and the relay
    runs to the KV's arrival."""
    script = [(7.8, *ev[1:]) if ev[3] == "write_done" else ev for ev in push_script(1.2, 7.65)]
    st = T.RequestTimeline(TID, events(script)).stages()
    assert st["transfer"] == 0.0
    assert st["relay"] * 1e3 == pytest.approx(7.6 - 5.0)
    assert all(v >= 0 for v in st.values()), st


def test_a_record_is_its_owners_alone_even_over_a_wider_file(tmp_path):
    from tools.trace.tap import write_private

    path = tmp_path / "old.msgpack"
    path.write_bytes(b"old")
    path.chmod(0o644)
    write_private(str(path), b"new")
    assert path.read_bytes() == b"new" and path.stat().st_mode & 0o777 == 0o600


def test_a_tap_asks_for_the_secret_where_the_taps_end_is_under_curve(tmp_path):
    """Without --secret-file, CURVE refuses the tap's handshake without a word, and the tap waited for good: the
    record says the end is secured, and the tap says what to give."""
    with recorded_supervisor(tmp_path, "curve001", trace_tap_endpoint="tcp://127.0.0.1:1",
                             trace_tap_secured=True) as reg:
        tap = subprocess.run(**tap_command(reg, "-q"), text=True, capture_output=True, timeout=30)
    assert tap.returncode == 1, tap.stderr
    assert "tap end tcp://127.0.0.1:1 is under CURVE: give --secret-file FILE" in tap.stderr
