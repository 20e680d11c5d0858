"""Two P and two D instances on one host (real processes, real NIXL over loopback):
greedy tokens equal local mode's; requests spread over every instance; a request no D
can hold waits at the router and, past the bound, gets 429; push falls back per
request to late allocation when D is short of blocks; killing one instance's process
fails only its requests, the others keep serving, and no block leaks on the survivors."""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import urllib.request

import pytest

from pushkv import faults
from pushkv.supervisor import deployments
from pushkv.supervisor.commands import ask
from tests.support.deploy import deployment, wait_pools_free
from tests.faults.test_faults import Events, wait_serving

pytestmark = pytest.mark.timeout(600)

NUM_BLOCKS = 64  # per instance; D holds 64 x 16 = 1024 tokens
PIN = 0.25  # push: at most 16 of D's 64 blocks reserved early and waiting for KV
MAX_TOKENS = 12
rng = random.Random(11)
PROMPTS = {
    "one-token": [65],
    "non-multiple": [rng.randrange(256) for _ in range(37)],
    "two-blocks": [rng.randrange(256) for _ in range(32)],
    "many-blocks": [rng.randrange(256) for _ in range(300)],  # 20 blocks on D > 16: late allocation
    "text": "The quick brown fox jumps over the lazy dog.",
}
COMMON = ("--model", "small", "--num-blocks", str(NUM_BLOCKS))
# sent by one test only, so no instance holds a block of them before it: the router's placement then
# falls to the least recently chosen P (a prompt P already holds would go back to that P)
FRESH = {"fresh-a": [rng.randrange(256) for _ in range(32)], "fresh-b": [rng.randrange(256) for _ in range(32)]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with deployment(tmp_path_factory.mktemp("local"), "--mode", "local", *COMMON) as dep:
        return {name: dep.tokens(p, MAX_TOKENS) for name, p in {**PROMPTS, **FRESH}.items()}


@pytest.fixture(scope="module")
def xpyd(tmp_path_factory):
    d = tmp_path_factory.mktemp("xpyd")
    fdir = d / "armed"
    fdir.mkdir()
    os.environ["PUSHKV_FAULTS_DIR"] = str(fdir)  # the children inherit it: faults can be armed
    try:
        with deployment(d, "--mode", "push", "--prefill-instances", "2", "--decode-instances", "2",
                        "--router-queue", "1", "--push-pin-fraction", str(PIN), "--max-restarts", "20",
                        *COMMON) as dep:
            dep.faults_dir = str(fdir)
            yield dep
    finally:
        os.environ.pop("PUSHKV_FAULTS_DIR", None)


def metrics(dep) -> dict[str, float]:
    with urllib.request.urlopen(dep.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k.replace('"', "")] = float(v)
    return out


def test_planned_instances_and_status(xpyd):
    """``pushkv status`` shows each instance: its processes and the router's view of it."""
    assert [i.name for i in xpyd.cfg.instances()] == ["prefill", "prefill1", "decode", "decode1"]
    reply = ask(xpyd.cfg.control_endpoint, "status")
    rows = deployments.instance_rows(reply.info["instances"], reply.processes, deployments.router_view(xpyd.url))
    assert [(r["name"], r["state"], r["procs"]) for r in rows] == [
        ("prefill", "up", "3/3"), ("prefill1", "up", "3/3"), ("decode", "up", "3/3"), ("decode1", "up", "3/3")]
    assert [r["engine_id"] for r in rows] == [i.engine_id for i in xpyd.cfg.instances()]
    assert all("legs" in r for r in rows)  # the router's view joined in


def test_tokens_equal_local_and_spread_over_every_instance(xpyd, reference):
    names = list(PROMPTS) * 2
    bodies = [None] * len(names)

    def one(i, n):
        bodies[i] = xpyd.complete(PROMPTS[n], MAX_TOKENS)

    pinned_peak = {}
    stop = threading.Event()

    def watch():  # the router's own accounting: blocks reserved early and still waiting for KV
        while not stop.is_set():
            for i in deployments.router_view(xpyd.url).values():
                pinned_peak[i["engine_id"]] = max(pinned_peak.get(i["engine_id"], 0), i["blocks_pinned"])
            stop.wait(0.01)

    mon = threading.Thread(target=watch, daemon=True)
    mon.start()
    ts = [threading.Thread(target=one, args=(i, n)) for i, n in enumerate(names)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    stop.set()
    mon.join(10)
    # a P backlog never pins more of a D than the cap: past it, requests go late
    assert all(v <= PIN * NUM_BLOCKS for v in pinned_peak.values()), pinned_peak
    served = {"prefill": set(), "decode": set()}
    for n, body in zip(names, bodies):
        assert body["choices"][0]["token_ids"] == reference[n], n
        ext = body["pushkv"]
        for leg, engine in ext["instances"].items():
            served[leg].add(engine)
        # push's cost, measured on D: blocks x seconds until the KV arrived
        assert ext["reserved_blocks"] >= 1 and ext["reserved_block_s"] > 0
        assert ext["allocation"] == ("late" if n == "many-blocks" else "early"), n
        # each leg's KVTransferStats the router has by the end: D's always (it ends the request)
        assert ext["kv"]["decode"]["bytes"] > 0 and ext["kv"]["decode"]["transfer_s"] >= 0, ext
    assert served["prefill"] == {i.engine_id for i in xpyd.cfg.prefills}
    assert served["decode"] == {i.engine_id for i in xpyd.cfg.decodes}
    st = wait_pools_free(xpyd)
    assert set(st) == {"prefill", "prefill1", "decode", "decode1"}
    got = metrics(xpyd)
    assert got["pushkv_router_late_allocations_total"] >= 2
    assert got["pushkv_kv_reserved_block_seconds_count{allocation=late}"] >= 2
    assert got["pushkv_kv_reserved_block_seconds_count{allocation=early}"] >= 8
    for inst in xpyd.cfg.instances():  # per-instance series
        assert got[f"pushkv_instance_up{{engine={inst.engine_id},role={inst.role}}}"] == 1
        assert got[f"pushkv_router_legs_total{{engine={inst.engine_id},role={inst.role}}}"] >= 1
    late_d = sum(st[n].counters.get("late_allocations", 0) for n in ("decode", "decode1"))
    late_p = sum(st[n].counters.get("late_allocations", 0) for n in ("prefill", "prefill1"))
    assert late_d == late_p >= 2  # counted where it happened, on both sides


class Stream(threading.Thread):
    """A streaming request read to its end in the background; ``started`` once its first
    token is here (it then holds its D blocks)."""

    def __init__(self, url: str, prompt, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.started = threading.Event()
        self.rid = ""
        self.outcome = ""
        self.detail = ""

    def run(self):
        body = json.dumps({"prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    line = line.decode().strip()
                    if line == "data: [DONE]":
                        self.outcome = "ok"
                        return
                    if not line.startswith("data: "):
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        self.outcome, self.detail = "error", ev["error"].get("message", "")
                        return
                    self.rid = self.rid or ev.get("id", "")
                    self.started.set()
            self.outcome = "dropped"
        except Exception as e:  # reported through outcome
            self.outcome, self.detail = "exception", str(e)
        finally:
            self.started.set()


def abort(dep, rid: str) -> None:
    req = urllib.request.Request(dep.url + f"/v1/abort/{rid}", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=10):
        pass


def test_requests_no_d_can_hold_wait_then_429(xpyd):
    # two hogs, one on each D (16 + 1008 tokens: every block of one D at most, 2 at admission: the prompt and the
    # first token's slot, as D takes them), and requests whose 63 blocks at admission neither D can take now
    hogs = [Stream(xpyd.url, [7] * 16, NUM_BLOCKS * 16 - 16) for _ in range(2)]
    for h in hogs:
        h.start()
    for h in hogs:
        assert h.started.wait(60) and h.rid, (h.outcome, h.detail)
    long = [1, 2, 3] * ((NUM_BLOCKS - 2) * 16 // 3) + [1, 2]  # 992 tokens and the first token's slot: 63 blocks
    waiter: dict = {}
    t = threading.Thread(target=lambda: waiter.setdefault("r", xpyd.post(
        "/v1/completions", {"prompt": long, "max_tokens": 4})))
    t.start()
    deadline = time.monotonic() + 30
    while metrics(xpyd).get("pushkv_router_queue_depth", 0) < 1:  # the waiter is in the router's queue
        assert time.monotonic() < deadline, "request never queued"
        time.sleep(0.05)  # polling a remote gauge
    status, body = xpyd.post("/v1/completions", {"prompt": long, "max_tokens": 4})
    assert status == 429, body
    assert "queue full" in body["error"]["message"]
    abort(xpyd, hogs[0].rid)  # one D frees: the queued request goes
    t.join(60)
    assert waiter["r"][0] == 200, waiter["r"]
    assert "router.queued" in waiter["r"][1]["pushkv"]["timeline"]
    abort(xpyd, hogs[1].rid)
    for h in hogs:
        h.join(30)
        assert h.outcome == "error" and "abort" in h.detail, (h.outcome, h.detail)
    wait_pools_free(xpyd)


def test_killing_one_instance_fails_only_its_requests(xpyd, reference):
    wait_serving(xpyd)
    ev = Events(xpyd.cfg.events_endpoint)
    try:
        streams = [Stream(xpyd.url, PROMPTS["non-multiple"], 200) for _ in range(4)]
        for s in streams:
            s.start()
            assert s.started.wait(60), (s.outcome, s.detail)
        victim = "decode1-worker-0"
        pid = next(p.pid for p in ask(xpyd.cfg.control_endpoint, "status").processes if p.name == victim)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        d1 = xpyd.cfg.decodes[1].engine_id
        deadline = time.monotonic() + 10
        while deployments.router_view(xpyd.url)[d1]["up"]:  # the router has heard: decode1 is chosen no more
            assert time.monotonic() < deadline, "router never marked decode1 down"
            time.sleep(0.02)  # polling a remote state
        # the survivors keep serving while decode1 restarts
        assert xpyd.tokens(PROMPTS["text"], MAX_TOKENS) == reference["text"]
        for s in streams:
            s.join(120)
        detect = time.monotonic() - t0
        outcomes = sorted((s.outcome, s.detail) for s in streams)
        failed = [d for o, d in outcomes if o != "ok"]
        assert len(failed) == 2 and len(outcomes) - len(failed) == 2, outcomes  # d0, d1, d0, d1
        assert all("decode instance failed: decode1-worker-0 died" in d for d in failed), failed
        ev.wait(lambda e: e.kind == "instance" and e.name == "decode1.instance" and e.event == "ready", 90)
        wait_serving(xpyd)
        st = wait_pools_free(xpyd)  # survivors and the restarted instance: every block back
        print(f"\nkill {victim}: {len(failed)} failed ({failed[0][:70]!r}), detect+drain {detect:.2f}s, "
              f"blocks in use after: {[(n, s.num_blocks - s.free_blocks) for n, s in st.items()]}")
        # and the restarted instance is chosen again (prompts that share no block: the router places a
        # prompt on the D that holds its prefix, which for one prompt four times is always the same D)
        fresh = random.Random(5)
        bodies = [xpyd.complete([fresh.randrange(256) for _ in range(32)], 4) for _ in range(4)]
        assert {b["pushkv"]["instances"]["decode"] for b in bodies} == {i.engine_id for i in xpyd.cfg.decodes}
    finally:
        ev.close()


def test_prefill_instance_dying_fails_only_its_request(xpyd, reference):
    """prefill1's scheduler dies as a prefill on it ends: that request fails with the reason,
    the requests on prefill go on and equal local, and no block is left anywhere."""
    wait_serving(xpyd)
    ev = Events(xpyd.cfg.events_endpoint)
    armed = faults.arm(xpyd.faults_dir, "prefill1-scheduler", "prefill_done")
    try:
        # two prompts no instance holds a block of: idle instances take turns, one on prefill, one on prefill1
        results = [(name, *xpyd.post("/v1/completions", {"prompt": FRESH[name], "max_tokens": MAX_TOKENS}))
                   for name in FRESH]
        failed = [b["error"]["message"] for _, st, b in results if st != 200]
        ok = [(name, b) for name, st, b in results if st == 200]
        assert len(failed) == 1 and "prefill instance failed: prefill1-scheduler died" in failed[0], results
        name, body = ok[0]
        assert body["pushkv"]["instances"]["prefill"] == xpyd.cfg.prefills[0].engine_id
        assert body["choices"][0]["token_ids"] == reference[name]
        assert not os.path.exists(armed)
        ev.wait(lambda e: e.kind == "instance" and e.name == "prefill1.instance" and e.event == "ready", 90)
        wait_serving(xpyd)
        st = wait_pools_free(xpyd)
        print(f"\nprefill1-scheduler killed at prefill_done: {failed[0][:80]!r}; blocks in use after: "
              f"{[(n, s.num_blocks - s.free_blocks) for n, s in st.items()]}")
    finally:
        ev.close()
        if os.path.exists(armed):
            os.unlink(armed)


def test_a_hung_decode_instance_is_passed_over_until_it_answers_again(xpyd, reference):
    """decode1's worker stops (SIGSTOP): once its supervisor reports it unhealthy, the router's /health says so and
    new requests go to decode; SIGCONT, and decode1 is healthy and chosen again."""
    wait_serving(xpyd)
    ev = Events(xpyd.cfg.events_endpoint)
    d0, d1 = (i.engine_id for i in xpyd.cfg.decodes)
    victim = "decode1-worker-0"
    pid = next(p.pid for p in ask(xpyd.cfg.control_endpoint, "status").processes if p.name == victim)

    def chosen_after(event: str, healthy: bool, seed: int) -> set[str]:
        """Once the supervisor said so and the router shows it: the D instances four fresh prompts went to."""
        ev.wait(lambda e: e.name == victim and e.event == event, 60)
        deadline = time.monotonic() + 10
        while deployments.router_view(xpyd.url)[d1].get("healthy") is not healthy:
            assert time.monotonic() < deadline, f"the router never saw {d1} healthy={healthy}"
            time.sleep(0.02)  # polling a remote state
        fresh = random.Random(seed)
        return {xpyd.complete([fresh.randrange(256) for _ in range(32)], 4)["pushkv"]["instances"]["decode"]
                for _ in range(4)}

    os.kill(pid, signal.SIGSTOP)
    try:
        assert chosen_after("unhealthy", False, 6) == {d0}
        assert xpyd.tokens(PROMPTS["text"], MAX_TOKENS) == reference["text"]
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        assert chosen_after("healthy", True, 7) == {d0, d1}
        wait_pools_free(xpyd)
    finally:
        ev.close()
