"""Peer death at every protocol phase: a process SIGKILLs itself at a named
point (pushkv.faults), or the test kill -9s it. Per scenario: the request ends
with a clear error within a bounded time, the supervisor restarts what died
(the whole instance for an engine process), a new request then succeeds, and
both pools return to fully free."""
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import zmq

from pushkv import faults
from pushkv import messages as m
from pushkv.supervisor.commands import ask
from tests.support.deploy import deployment, wait_pools_free

pytestmark = pytest.mark.timeout(900)

DETECT_BOUND_S = 10.0
RESULTS: list[tuple] = []

# (victim process, fault point or "kill", phase it stands for)
SCENARIOS = [
    ("prefill-worker-0", "execute", "prefilling (worker in its forward step)"),
    ("prefill-scheduler", "prefill_done", "prefill finished, before the KV is handed over"),
    ("prefill-writer-0", "registration_received", "rendezvous: registration held"),
    ("prefill-writer-0", "post_write", "about to WRITE"),
    ("decode-writer-0", "registration_sent", "registered, waiting for the WRITE"),
    ("decode-scheduler", "after_alloc", "D blocks allocated"),
    ("decode-worker-0", "execute", "decoding step"),
    ("decode-scheduler", "decoding", "decoding (tokens streaming)"),
    ("router", "kill", "decoding, router killed"),
]


PULL_SCENARIOS = [
    ("prefill-writer-0", "lease_held", "pull: P blocks held under the lease"),
    ("decode-writer-0", "read_posted", "pull: D about to READ"),
    ("decode-scheduler", "after_alloc", "pull: D allocated after the relay"),
]


# P's WRITEs posted by a second NIXL agent on its own thread (--writer-post-thread on): a peer
# dying around a post ends the same way, and the poster's thread never keeps a block
POSTER_SCENARIOS = [
    ("prefill-writer-0", "post_write", "threaded post: about to WRITE"),
    ("decode-writer-0", "registration_sent", "threaded post: registered, waiting for the WRITE"),
]


# --staging pushkv (P WRITEs from slots of its staging area into slots D registered): a peer dying
# around a post ends the same way, and every staging slot on both sides comes back
STAGING_SCENARIOS = [
    ("prefill-writer-0", "post_write", "staged: about to WRITE"),
    ("decode-writer-0", "registration_sent", "staged: registered, waiting for the WRITE"),
]


def _faulty_deployment(tmp_path_factory, mode: str, *extra: str):
    d = tmp_path_factory.mktemp(f"faults-{mode}")
    fdir = d / "armed"
    fdir.mkdir()
    os.environ["PUSHKV_FAULTS_DIR"] = str(fdir)
    try:
        with deployment(d, "--mode", mode, "--model", "small", "--num-blocks", "256",
                        "--max-restarts", "20", *extra) as dep:
            dep.faults_dir = str(fdir)
            yield dep
    finally:
        os.environ.pop("PUSHKV_FAULTS_DIR", None)


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    yield from _faulty_deployment(tmp_path_factory, "push")


@pytest.fixture(scope="module")
def pull_dep(tmp_path_factory):
    yield from _faulty_deployment(tmp_path_factory, "pull")


@pytest.fixture(scope="module")
def poster_dep(tmp_path_factory):
    yield from _faulty_deployment(tmp_path_factory, "push", "--writer-post-thread", "on")


@pytest.fixture(scope="module")
def staged_dep(tmp_path_factory):
    yield from _faulty_deployment(tmp_path_factory, "push", "--staging", "pushkv", "--staging-mib", "4")


@pytest.fixture(scope="module", autouse=True)
def scenario_table():
    yield
    print("\nfault x phase -> outcome | detect s | blocks leaked (P, D)")
    for row in RESULTS:
        print(" | ".join(str(x) for x in row))


class Events:
    """The supervisor's lifecycle events, collected in a background thread."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"pushkv.")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.seen: list = []
        self.cv = threading.Condition()
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self.stop:
            if self.sock.poll(100):
                ev = m.DEC_EVENT.decode(self.sock.recv_multipart()[-1])
                with self.cv:
                    self.seen.append(ev)
                    self.cv.notify_all()

    def wait(self, pred, timeout_s: float):
        with self.cv:
            if not self.cv.wait_for(lambda: any(pred(e) for e in self.seen), timeout_s):
                raise TimeoutError(f"event not seen; got {[(e.name, e.event) for e in self.seen]}")

    def close(self):
        self.stop = True
        self.t.join()
        self.sock.close(0)


def stream_request(url: str, prompt, max_tokens: int, on_first_token=None) -> tuple[str, str]:
    """('ok'|'error'|'http <code>'|'dropped', detail)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            first = True
            for line in r:
                line = line.decode().strip()
                if line == "data: [DONE]":
                    return "ok", ""
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    return "error", ev["error"].get("message", "")
                if first and on_first_token is not None:
                    first = False
                    on_first_token()
            return "dropped", "stream ended without [DONE]"
    except urllib.error.HTTPError as e:
        return f"http {e.code}", e.read().decode(errors="replace")[:200]
    except (ConnectionError, urllib.error.URLError, OSError) as e:
        return "dropped", str(e)


def wait_serving(dep, timeout_s: float = 90.0) -> None:
    """The restarted deployment answers again (readiness was signalled; this
    confirms the whole path end to end)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            dep.tokens([1, 2, 3], 2)
            return
        except Exception:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


@pytest.mark.parametrize("victim,point,phase", SCENARIOS, ids=[f"{v}:{p}" for v, p, _ in SCENARIOS])
def test_peer_death(dep, victim, point, phase):
    _scenario(dep, victim, point, phase)


@pytest.mark.parametrize("victim,point,phase", PULL_SCENARIOS, ids=[f"{v}:{p}" for v, p, _ in PULL_SCENARIOS])
def test_peer_death_pull(pull_dep, victim, point, phase):
    _scenario(pull_dep, victim, point, phase)


@pytest.mark.parametrize("victim,point,phase", POSTER_SCENARIOS, ids=[f"{v}:{p}" for v, p, _ in POSTER_SCENARIOS])
def test_peer_death_threaded_post(poster_dep, victim, point, phase):
    _scenario(poster_dep, victim, point, phase)


@pytest.mark.parametrize("victim,point,phase", STAGING_SCENARIOS, ids=[f"{v}:{p}" for v, p, _ in STAGING_SCENARIOS])
def test_peer_death_staged(staged_dep, victim, point, phase):
    _scenario(staged_dep, victim, point, phase)
    for role in ("prefill", "decode"):  # every slot of every staging area is back (a restarted writer's: fresh)
        c = staged_dep.stats(role).counters
        areas = {k.rsplit(".", 1)[0]: v for k, v in c.items() if k.endswith(".staging_blocks")}
        assert areas and all(c[f"{w}.staging_free_blocks"] == n for w, n in areas.items()), (role, c)


def _scenario(dep, victim, point, phase):
    wait_serving(dep)  # a failed earlier scenario must not leave this one a restarting instance
    ev = Events(dep.cfg.events_endpoint)
    armed = ""
    try:
        prompt = list(range(1, 200))
        t0 = time.monotonic()
        if point == "kill":
            pid = _pid_of(dep, victim)
            outcome, detail = stream_request(dep.url, prompt, 400, on_first_token=lambda: os.kill(pid, signal.SIGKILL))
        else:
            armed = faults.arm(dep.faults_dir, victim, point)
            outcome, detail = stream_request(dep.url, prompt, 40)
        detect = time.monotonic() - t0
        assert outcome != "ok", f"request completed although {victim} died at {point}"
        assert detect < DETECT_BOUND_S, f"took {detect:.1f}s to fail"
        if victim != "router":
            assert "died" in detail or "failed" in detail or "lost" in detail, detail
        role = victim.split("-")[0]
        if role == "router":
            ev.wait(lambda e: e.name == "router" and e.event == "ready", 60)
        else:
            ev.wait(lambda e: e.kind == "instance" and e.role == role and e.event == "ready", 90)
        wait_serving(dep)
        st = wait_pools_free(dep)
        RESULTS.append((f"{victim}:{point}", phase, f"{outcome}: {detail[:60]!r}", f"{detect:.2f}",
                        (st["prefill"].num_blocks - st["prefill"].free_blocks, st["decode"].num_blocks - st["decode"].free_blocks)))
    finally:
        ev.close()
        if armed and os.path.exists(armed):  # never fired: do not let it fire in a later scenario
            os.unlink(armed)


def _pid_of(dep, name: str) -> int:
    reply = ask(dep.cfg.control_endpoint, "status")
    for p in reply.processes:
        if p.name == name:
            return p.pid
    raise KeyError(name)
