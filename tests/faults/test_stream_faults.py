"""Faults while a prompt streams (push, ``--push-stream chunk``), real processes and NIXL.

A long prompt streams its chunks to D while P computes the rest; then:

- D's writer is SIGKILLed once P posted a part into its pool (parts are not announced to D,
  which never learns when one landed): the rest of the stream goes to a dead writer;
- P's writer SIGKILLs itself about to post a part (``post_part``);
- the client aborts (``POST /v1/abort/{id}``) once P has posted a part.

Each time the request ends with a clear failure within a bound (not a hang), the
instance that died is restarted, the deployment serves again, and every block of both
pools is free: P kept the streamed blocks until its writers answered, D let go of its
registered ones.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import pytest

from pushkv import faults
from tests.e2e.test_load_abort import Stream, abort, wait_until
from tests.faults.test_faults import Events, _pid_of, stream_request, wait_serving
from tests.support.deploy import deployment, wait_pools_free
from tools.layout_report import prompt

pytestmark = pytest.mark.timeout(600)

CHUNK = 32
LONG = prompt(1500, 3)  # ~47 chunks: P computes for a good while after the first part
DETECT_BOUND_S = 15.0
FREE_BOUND_S = 10.0  # abort -> both pools free (no fault: nothing restarts)


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream-faults")
    fdir = d / "armed"
    fdir.mkdir()
    os.environ["PUSHKV_FAULTS_DIR"] = str(fdir)
    try:
        with deployment(d, "--mode", "push", "--push-stream", "chunk", "--prefill-chunk", str(CHUNK),
                        "--model", "small", "--num-blocks", "256", "--max-restarts", "20",
                        "--writer-warm", "off") as dep:  # off: no warm skip of the last WRITE's hint
            dep.faults_dir = str(fdir)
            yield dep
    finally:
        os.environ.pop("PUSHKV_FAULTS_DIR", None)


def writer_counters(dep, role: str = "prefill") -> dict:
    c = dep.stats(role).counters
    return {k[len("writer.0."):]: v for k, v in c.items() if k.startswith("writer.0.")}


def kill_once_a_part_is_posted(dep, victim: str, p0: dict, killed: list) -> None:
    """SIGKILL ``victim`` as soon as P's writer has posted a part of the stream."""
    wait_until(lambda: writer_counters(dep).get("part_posts", 0) > p0.get("part_posts", 0), 30, "a part posted")
    os.kill(_pid_of(dep, victim), signal.SIGKILL)
    killed.append(victim)


def router_outcomes(dep) -> dict[str, float]:
    """The router's finished requests by outcome (pushkv_router_requests_total)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(dep.url + "/metrics", timeout=10).read().decode()
    return {s.labels["outcome"]: s.value for fam in text_string_to_metric_families(text)
            if fam.name == "pushkv_router_requests" for s in fam.samples if s.name.endswith("_total")}


@pytest.mark.parametrize("victim, point", [
    ("decode-writer-0", "part_posted"),  # D's writer killed (by the test) once P posted a part into it
    ("prefill-writer-0", "post_part"),  # P's writer dies about to post a part (fault point)
])
def test_process_killed_mid_stream(dep, victim, point):
    wait_serving(dep)
    st0 = wait_pools_free(dep)
    p0 = writer_counters(dep)
    outcomes0 = router_outcomes(dep)
    ev = Events(dep.cfg.events_endpoint)
    killed: list[str] = []
    if point == "part_posted":
        armed = ""
        killer = threading.Thread(target=kill_once_a_part_is_posted, args=(dep, victim, p0, killed), daemon=True)
        killer.start()
    else:
        armed = faults.arm(dep.faults_dir, victim, point)
    try:
        t0 = time.monotonic()
        outcome, detail = stream_request(dep.url, LONG, 20)
        took = time.monotonic() - t0
        if armed:
            assert not os.path.exists(armed), f"{victim} never reached {point}: the prompt did not stream"
        else:
            killer.join(DETECT_BOUND_S)
            assert killed, f"{victim} was never killed: no part was posted"
        assert outcome != "ok", f"request completed although {victim} died at {point}"
        assert took < DETECT_BOUND_S, f"took {took:.1f}s to fail"
        assert "died" in detail or "failed" in detail or "lost" in detail, detail
        role = victim.split("-")[0]
        if role == "decode":  # answered as the death is, whoever heard it first: the other instance failed, retry
            assert "decode instance" in detail and "retry" in detail, detail
        ev.wait(lambda e: e.kind == "instance" and e.role == role and e.event == "ready", 120)
        wait_serving(dep)
        st = wait_pools_free(dep)
        for name in ("prefill", "decode"):
            assert st[name].free_blocks == st[name].num_blocks == st0[name].num_blocks, (name, st[name])
        if role == "decode":  # P's writer lived through it: it streamed, then ended the stream
            p1 = writer_counters(dep)
            assert p1.get("part_posts", 0) > p0.get("part_posts", 0), p1
            # the part into the dead pool failed (or the death notice came first): the stream ended failed
            assert p1.get("transfers_failed", 0) > p0.get("transfers_failed", 0), p1
            assert p1.get("transfer_stuck", 0) == p0.get("transfer_stuck", 0), p1
        # /metrics counts it as failed, not as the router's own shutdown
        outcomes = router_outcomes(dep)
        assert outcomes.get("failed", 0) > outcomes0.get("failed", 0), outcomes
        assert outcomes.get("shutdown", 0) == outcomes0.get("shutdown", 0), outcomes
        print(f"{victim}:{point}: {outcome}: {detail[:80]!r} after {took:.2f}s; pools free")
    finally:
        ev.close()
        if armed and os.path.exists(armed):
            os.unlink(armed)


def test_abort_mid_stream_frees_every_block(dep):
    wait_serving(dep)
    for attempt in range(3):  # the abort must land while P still computes: on two busy cores P may finish first
        wait_pools_free(dep)
        p0, s0 = writer_counters(dep), dep.stats("prefill").counters
        s = Stream(dep, LONG, 20)
        wait_until(lambda p0=p0: writer_counters(dep).get("parts", 0) > p0.get("parts", 0), 30, "a part written")
        t0 = time.monotonic()
        abort(dep, s.request_id)
        wait_pools_free(dep, timeout_s=FREE_BOUND_S + 5)  # however the race went, every block comes back
        freed = time.monotonic() - t0
        s.drain()
        s.disconnect()
        assert freed < FREE_BOUND_S, f"{freed:.2f}s from the abort to free pools"
        p1, s1 = writer_counters(dep), dep.stats("prefill").counters
        if s1.get("aborted", 0) == s0.get("aborted", 0):  # P's prefill ended before the abort reached it
            print(f"attempt {attempt}: P's prefill ended before the abort (pools free all the same); again")
            continue
        assert s1.get("aborted", 0) == s0.get("aborted", 0) + 1, s1
        assert s.error is not None and s.error["code"] == 499 and not s.tokens, (s.error, s.tokens)
        assert s1.get("kv_transfers", 0) == s0.get("kv_transfers", 0), "the KV moved anyway"
        assert p1.get("writes", 0) == p0.get("writes", 0), "the last WRITE was posted after the abort"
        assert p1.get("cancelled", 0) > p0.get("cancelled", 0), p1
        print(f"abort mid-stream: {p1.get('parts', 0) - p0.get('parts', 0)} parts written; pools free "
              f"{freed * 1e3:.0f} ms after the abort")
        return
    pytest.fail("in 3 attempts, P's prefill always ended before the abort reached it")
