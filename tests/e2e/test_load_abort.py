"""Load and aborts against a real push deployment (small model, small D pool).

- Load: 4x more concurrent requests than D's pool holds, plus a few that can
  never fit: every request is served with local mode's tokens or refused with
  a reason; none is lost; both pools are exactly free afterwards.
- Abort at each stage a test can hold a request in: queued at the router
  while no D can hold it, prefilling, decoding; by client disconnect and by
  POST /v1/abort/{id}. Proof per scenario: the request's outcome, the time
  from the abort to both pools being free again, and no block leaked.
"""
from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time

import pytest

from tests.support.deploy import deployment, wait_pools_free

pytestmark = pytest.mark.timeout(240)

P_BLOCKS, D_BLOCKS, BLOCK = 400, 200, 16
DETECT_S = 5.0  # abort -> both pools free
rng = random.Random(11)
LOAD = [([rng.randrange(256) for _ in range(rng.randrange(100, 300))], rng.randrange(8, 24)) for _ in range(30)]
TOO_BIG = [([rng.randrange(256) for _ in range(3000)], 300)] * 2  # P fits it, D (207 blocks) never can
COMMON = ("--model", "small")


def blocks(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Local mode's tokens for the load prompts, one at a time."""
    with deployment(tmp_path_factory.mktemp("local"), "--mode", "local", *COMMON, "--num-blocks", "64") as dep:
        out = [dep.tokens(p, n) for p, n in LOAD]
        wait_pools_free(dep)
    return out


@pytest.fixture(scope="module")
def dep(tmp_path_factory, reference):
    tmp = tmp_path_factory.mktemp("push")
    cfg = tmp / "cfg.json"
    cfg.write_text(json.dumps({"prefill": {"num_blocks": P_BLOCKS}, "decode": {"num_blocks": D_BLOCKS}}))
    # push only (no late allocation): the abort scenarios below follow push's legs
    # layer-streamed (the default, named so it stays covered): an abort mid-prefill reaches a writer that
    # may not have seen the worker's first mark yet, and must still answer so P frees the blocks
    with deployment(tmp, "--mode", "push", *COMMON, "--config", str(cfg), "--push-pin-fraction", "1",
                    "--push-stream", "layer") as d:
        yield d


def counters(dep, role) -> dict:
    return dict(dep.stats(role).counters)


# ---------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------
def test_overload_every_request_served_or_refused(dep, reference):
    jobs = [(p, n, ref) for (p, n), ref in zip(LOAD, reference)] + [(p, n, None) for p, n in TOO_BIG]
    fit = D_BLOCKS // max(blocks(len(p) + n) for p, n in LOAD)
    assert len(LOAD) >= 3 * fit, "not an overload"
    before = {r: counters(dep, r) for r in dep.roles()}
    results: list = [None] * len(jobs)
    peak = {"waiting": 0, "running": 0, "router": 0}
    stop = threading.Event()

    def one(i):
        p, n, _ = jobs[i]
        results[i] = dep.post("/v1/completions", {"prompt": p, "max_tokens": n}, timeout=120)

    def monitor():
        while not stop.is_set():
            st = dep.stats("decode")
            peak["waiting"] = max(peak["waiting"], st.waiting)
            peak["running"] = max(peak["running"], st.running)
            peak["router"] = max(peak["router"], dep.health()["queued"])
            stop.wait(0.02)

    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    t0 = time.monotonic()
    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(150)
    elapsed = time.monotonic() - t0
    stop.set()
    mon.join(5)
    assert all(r is not None for r in results), "a request was lost"
    served = refused = 0
    for (p, n, ref), (status, body) in zip(jobs, results):
        if status == 200:
            assert ref is not None and body["choices"][0]["token_ids"] == ref, body
            served += 1
        else:
            assert ref is None and status == 413, (status, body)
            assert "KV blocks" in body["error"]["message"], body
            refused += 1
    assert (served, refused) == (len(LOAD), len(TOO_BIG))
    # the router never sends a D leg to a D that cannot hold it: the overload waits there
    assert peak["router"] > 0, "the router's queue never filled: not an overload"
    st = wait_pools_free(dep)
    after = {r: s.counters for r, s in st.items()}
    assert after["decode"].get("requests_completed", 0) - before["decode"].get("requests_completed", 0) == served
    assert after["decode"].get("rejected", 0) == before["decode"].get("rejected", 0)  # refused at the router
    assert after["prefill"].get("kv_transfers", 0) - before["prefill"].get("kv_transfers", 0) == served
    print(f"load: {len(jobs)} concurrent ({fit} fit D's pool at once): {served} served = local tokens, "
          f"{refused} refused 413 by the router; router queue peak {peak['router']}, D queue peak "
          f"{peak['waiting']}, running peak {peak['running']}; "
          f"{elapsed:.1f}s; pools exactly free")


# ---------------------------------------------------------------------------
# aborts
# ---------------------------------------------------------------------------
class Stream:
    """A streaming completion over a raw connection we can cut at any point."""

    def __init__(self, dep, prompt, max_tokens: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", dep.port, timeout=60)
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True})
        self.conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        self.request_id = self.resp.getheader("X-Request-Id")
        self.tokens: list[int] = []
        self.error = None

    def events(self):
        while True:
            line = self.resp.readline()
            if not line:
                return
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return
            ev = json.loads(line[6:])
            if "error" in ev:
                self.error = ev["error"]
            else:
                self.tokens += ev["choices"][0].get("token_ids") or []
            yield ev

    def first_token(self) -> None:
        for _ in self.events():
            if self.tokens:
                return
        raise AssertionError(f"stream ended without a token: {self.error}")

    def drain(self) -> None:
        for _ in self.events():
            pass

    def disconnect(self) -> None:
        self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.resp.close()
        self.conn.close()


def abort(dep, request_id: str) -> None:
    status, body = dep.post(f"/v1/abort/{request_id}", b"", timeout=10)
    assert status == 200 and body["aborted"], (status, body)


def wait_until(cond, timeout_s: float = 10.0, what: str = ""):
    end = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)  # polling remote state


def pools(dep):
    return {r: dep.stats(r) for r in dep.roles()}


def freed_after(dep, t0: float, cond=None) -> float:
    """Seconds from ``t0`` until ``cond(pools)`` (default: both pools fully free and idle)."""
    if cond is None:
        wait_pools_free(dep, timeout_s=DETECT_S + 5)
    else:
        wait_until(lambda: cond(pools(dep)), DETECT_S + 5, "blocks back")
    return time.monotonic() - t0


SCENARIOS: list = []


def report(name: str, outcome: str, detect_s: float) -> None:
    SCENARIOS.append((name, outcome, detect_s))
    print(f"{name}: {outcome}; blocks back {detect_s * 1e3:.0f} ms after the abort; 0 leaked")
    assert detect_s < DETECT_S, f"{name}: {detect_s:.2f}s to free"


class Unary:
    """A non-streaming completion sent on a raw socket, so we can hang up before the answer."""

    def __init__(self, dep, prompt, max_tokens: int):
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode()
        self.sock = socket.create_connection(("127.0.0.1", dep.port), timeout=30)
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def disconnect(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("how", ["disconnect", "unary-disconnect", "abort-endpoint"])
def test_abort_while_prefilling(dep, how):
    """A long prompt; the abort lands while P computes it: P drops it after the
    step, D's registration is cancelled at P, nothing is transferred."""
    before = {r: counters(dep, r) for r in dep.roles()}
    prompt = [rng.randrange(256) for _ in range(2800)]  # ~0.5 s of prefill on 2 cores
    s = Unary(dep, prompt, 16) if how == "unary-disconnect" else Stream(dep, prompt, 16)
    wait_until(lambda: dep.stats("prefill").free_blocks < P_BLOCKS, what="P admitted")
    t0 = time.monotonic()
    if how.endswith("disconnect"):
        s.disconnect()
    else:
        abort(dep, s.request_id)
    detect_s = freed_after(dep, t0)
    if how == "abort-endpoint":
        s.drain()
        assert s.error is not None and s.error["code"] == 499 and not s.tokens, (s.error, s.tokens)
        s.disconnect()
    after = {r: counters(dep, r) for r in dep.roles()}
    for role in dep.roles():
        assert after[role].get("aborted", 0) == before[role].get("aborted", 0) + 1, (role, after[role])
    assert after["prefill"].get("kv_transfers", 0) == before["prefill"].get("kv_transfers", 0), "KV moved anyway"
    assert after["decode"].get("requests_completed", 0) == before["decode"].get("requests_completed", 0)
    report(f"prefilling/{how}", "aborted, no KV moved" + (", client got 499" if how == "abort-endpoint" else ""),
           detect_s)


def test_abort_queued_at_router_then_while_decoding(dep):
    """A hog decodes on D. A second request whose prompt no D can take beside it then waits at the router
    (nothing sent to P or D). Abort it (POST /v1/abort): the client gets 499 and no instance heard of it. Then
    disconnect the hog mid-decode: D's blocks go."""
    hog_max = D_BLOCKS * BLOCK - 200  # prompt 100 + this: up to ~190 of D's 200 blocks, 7 at its admission
    hog = Stream(dep, [rng.randrange(256) for _ in range(100)], hog_max)
    hog.first_token()  # decoding now
    before = {r: counters(dep, r) for r in dep.roles()}
    # 3,100 prompt tokens: 194 D blocks at admission (the prompt and the first token's slot); 193 are not the hog's
    victim = Stream(dep, [rng.randrange(256) for _ in range(3100)], 32)
    wait_until(lambda: dep.health()["queued"] == 1, what="queued at the router")
    assert dep.stats("prefill").free_blocks == P_BLOCKS and dep.stats("decode").waiting == 0
    t0 = time.monotonic()
    abort(dep, victim.request_id)
    detect_s = freed_after(dep, t0, lambda st: st["prefill"].free_blocks == P_BLOCKS
                           and st["decode"].waiting == 0 and st["decode"].running == 1)  # the hog's, growing
    victim.drain()
    assert victim.error is not None and victim.error["code"] == 499 and not victim.tokens, victim.error
    victim.disconnect()
    assert dep.health()["queued"] == 0
    report("queued at the router/abort-endpoint", "aborted, client got 499", detect_s)
    assert not hog.error and len(hog.tokens) < hog_max, "the hog must still be decoding"
    hog.first_token()  # still streaming, undisturbed
    t0 = time.monotonic()
    hog.disconnect()
    detect_s = freed_after(dep, t0)
    after = {r: counters(dep, r) for r in dep.roles()}
    assert after["decode"].get("aborted", 0) == before["decode"].get("aborted", 0) + 1  # the hog
    assert after["prefill"].get("aborted", 0) == before["prefill"].get("aborted", 0)  # hog's P leg ended
    assert after["prefill"].get("requests", 0) == before["prefill"].get("requests", 0)  # the victim never left
    report("decoding/disconnect", f"aborted mid-decode ({hog_max} tokens asked)", detect_s)


def test_abort_while_decoding_via_endpoint(dep):
    s = Stream(dep, [rng.randrange(256) for _ in range(50)], 2000)
    s.first_token()
    t0 = time.monotonic()
    abort(dep, s.request_id)
    detect_s = freed_after(dep, t0)
    s.drain()
    assert s.error is not None and s.error["code"] == 499, s.error
    assert 0 < len(s.tokens) < 2000
    s.disconnect()
    report("decoding/abort-endpoint", f"aborted after {len(s.tokens)} of 2000 tokens, client got 499", detect_s)


def test_abort_then_serve(dep, reference):
    """After every abort above: the deployment serves, tokens unchanged, pools free."""
    p, n = LOAD[0]
    assert dep.tokens(p, n) == reference[0]
    wait_pools_free(dep)
    print("\n".join(f"  {n:<60} {o:<45} {d * 1e3:6.0f} ms" for n, o, d in SCENARIOS))
