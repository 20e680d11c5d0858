"""Bad input against a real push deployment: malformed HTTP and JSON, fields
missing or of the wrong type, prompts too long for the model or the pool,
undecodable or unexpected ZMQ frames, duplicates, stale and reissued
generations. Each gets a clear error and disturbs nothing else: a normal
request running alongside completes with the reference tokens, and both pools
are fully free afterwards."""
from __future__ import annotations

import http.client
import json
import threading
import time
import uuid

import msgspec
import pytest
import zmq

from pushkv import messages as m
from tests.support.deploy import deployment, wait_pools_free

pytestmark = pytest.mark.timeout(120)

NUM_BLOCKS = 32  # x 16 tokens: a 512-token pool
MAX_LEN = 1024  # model length above the pool, so "fits the model, not the pool" exists
WAIT_S = 4.0  # registration / write waits: a registration nobody answers ends in seconds
NORMAL = [7, 8, 9, 10, 11]
NORMAL_MAX = 24


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-input")
    cfg = tmp / "cfg.json"
    cfg.write_text(json.dumps({"max_model_len": MAX_LEN,
                               "timeouts": {"write_wait_s": WAIT_S, "registration_wait_s": WAIT_S}}))
    with deployment(tmp, "--mode", "push", "--model", "tiny", "--num-blocks", str(NUM_BLOCKS),
                    "--config", str(cfg)) as d:
        yield d


@pytest.fixture(scope="module")
def reference(dep):
    return dep.tokens(NORMAL, NORMAL_MAX)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def raw_http(dep, method: str, path: str, body: bytes = b"", timeout: float = 30.0):
    conn = http.client.HTTPConnection("127.0.0.1", dep.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = {"raw": raw.decode(errors="replace")}
        return r.status, parsed
    finally:
        conn.close()


class Alongside:
    """A normal request running while the bad input arrives; must be undisturbed."""

    def __init__(self, dep):
        self.dep, self.out, self.err = dep, None, None
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            self.out = self.dep.tokens(NORMAL, NORMAL_MAX)
        except Exception as e:  # surfaced in check()
            self.err = e

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.t.join(60)

    def check(self, reference):
        assert self.err is None, self.err
        assert self.out == reference


def counters(dep) -> dict[str, dict[str, int]]:
    return {r: dict(dep.stats(r).counters) for r in dep.roles()}


def delta(before, after, role, name) -> int:
    return after[role].get(name, 0) - before[role].get(name, 0)


def still_serves(dep, reference) -> float:
    """A normal request gives the reference tokens; every block comes back. Returns s to free."""
    assert dep.tokens(NORMAL, NORMAL_MAX) == reference
    t0 = time.monotonic()
    wait_pools_free(dep, timeout_s=10)
    return time.monotonic() - t0


def dealer(endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def recv(sock, timeout_s: float = 15.0):
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no answer within {timeout_s}s")
    return m.DEC_SCHED_TO_ROUTER.decode(sock.recv_multipart()[-1])


def recv_until(sock, done, timeout_s: float = 15.0) -> list:
    """Collect messages until ``done(msgs)``."""
    got: list = []
    end = time.monotonic() + timeout_s
    while not done(got):
        got.append(recv(sock, max(0.01, end - time.monotonic())))
    return got


def source(dep) -> m.PrefillSource:
    p = dep.cfg.prefill
    return m.PrefillSource(p.engine_id, p.tp, tuple(p.handshake_endpoints))


def gen(dep, leg: str, tid: str, generation: int = 0, prompt=tuple(NORMAL), max_tokens: int = NORMAL_MAX,
        **kw) -> m.Generate:
    if leg == "decode" and "source" not in kw:
        kw["source"] = source(dep)
    return m.Generate(tid, generation, leg, tuple(prompt), 1 if leg == "prefill" else max_tokens, **kw)


def tid() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------
def j(obj) -> bytes:
    return json.dumps(obj).encode()


HTTP_CASES = [
    # id, method, path, body, status, message fragment, reaches schedulers
    ("invalid-json", "POST", "/v1/completions", b"{", 400, "malformed JSON", False),
    ("empty-body", "POST", "/v1/completions", b"", 400, "malformed JSON", False),
    ("not-utf8", "POST", "/v1/completions", b"\xff\xfe{}", 400, "malformed JSON", False),
    ("json-array", "POST", "/v1/completions", b"[1, 2]", 400, "JSON object", False),
    ("json-string", "POST", "/v1/completions", b'"hi"', 400, "JSON object", False),
    ("deep-nesting", "POST", "/v1/completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
     400, "nested too deeply", False),
    ("missing-prompt", "POST", "/v1/completions", j({"max_tokens": 3}), 400, "missing field 'prompt'", False),
    ("prompt-int", "POST", "/v1/completions", j({"prompt": 5}), 400, "prompt must be", False),
    ("prompt-null", "POST", "/v1/completions", j({"prompt": None}), 400, "prompt must be", False),
    ("prompt-object", "POST", "/v1/completions", j({"prompt": {"a": 1}}), 400, "prompt must be", False),
    ("prompt-mixed", "POST", "/v1/completions", j({"prompt": [1, "a"]}), 400, "prompt must be", False),
    ("prompt-bools", "POST", "/v1/completions", j({"prompt": [True, False]}), 400, "prompt must be", False),
    ("prompt-floats", "POST", "/v1/completions", j({"prompt": [1.5]}), 400, "prompt must be", False),
    ("empty-prompt", "POST", "/v1/completions", j({"prompt": ""}), 400, "prompt is empty", False),
    ("empty-prompt-ids", "POST", "/v1/completions", j({"prompt": []}), 400, "prompt is empty", False),
    ("batch-too-large", "POST", "/v1/completions", j({"prompt": ["a"] * 65}), 400, "at most 64 prompts", False),
    ("batch-empty-prompt", "POST", "/v1/completions", j({"prompt": ["a", ""]}), 400, "prompt[1] is empty", False),
    ("lone-surrogate", "POST", "/v1/completions", b'{"prompt": "\\ud800"}', 400, "not valid text", False),
    ("token-above-vocab", "POST", "/v1/completions", j({"prompt": [320]}), 400, "outside the vocabulary", False),
    ("token-negative", "POST", "/v1/completions", j({"prompt": [-1]}), 400, "outside the vocabulary", False),
    ("token-huge", "POST", "/v1/completions", j({"prompt": [2**70]}), 400, "outside the vocabulary", False),
    ("max-tokens-0", "POST", "/v1/completions", j({"prompt": [1], "max_tokens": 0}), 400, "at least 1", False),
    ("max-tokens-negative", "POST", "/v1/completions", j({"prompt": [1], "max_tokens": -5}), 400, "at least 1",
     False),
    ("max-tokens-string", "POST", "/v1/completions", j({"prompt": [1], "max_tokens": "3"}), 400,
     "must be an integer", False),
    ("max-tokens-float", "POST", "/v1/completions", j({"prompt": [1], "max_tokens": 2.5}), 400,
     "must be an integer", False),
    ("max-tokens-bool", "POST", "/v1/completions", j({"prompt": [1], "max_tokens": True}), 400,
     "must be an integer", False),
    ("prompt-over-model-len", "POST", "/v1/completions", j({"prompt": [1] * (MAX_LEN + 1), "max_tokens": 1}),
     400, "maximum context length", False),
    ("stream-not-bool", "POST", "/v1/completions", j({"prompt": [1], "stream": "yes"}), 400, "stream", False),
    ("temperature", "POST", "/v1/completions", j({"prompt": [1], "temperature": -0.7}), 400,
     "temperature must be in", False),
    ("n-17", "POST", "/v1/completions", j({"prompt": [1], "n": 17}), 400, "n must be in", False),
    ("top-p-string", "POST", "/v1/completions", j({"prompt": [1], "top_p": "x"}), 400, "top_p must be a number",
     False),
    ("logit-bias-id", "POST", "/v1/completions", j({"prompt": [1], "logit_bias": {"320": 1}}), 400,
     "logit_bias token id 320", False),
    ("chat-no-messages", "POST", "/v1/chat/completions", j({"model": "x"}), 400, "missing field 'messages'", False),
    ("chat-bad-role", "POST", "/v1/chat/completions", j({"messages": [{"role": 5, "content": "x"}]}), 400,
     "role must be a non-empty string", False),
    ("chat-top-logprobs", "POST", "/v1/chat/completions",
     j({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}), 400, "needs logprobs", False),
    ("stop-ids-bad", "POST", "/v1/completions", j({"prompt": [1], "stop_token_ids": [999]}), 400,
     "stop token id", False),
    ("stop-ids-type", "POST", "/v1/completions", j({"prompt": [1], "stop_token_ids": "x"}), 400,
     "stop_token_ids", False),
    # fits the model (1024) but not the 512-token pools: the router refuses it (no D can ever hold
    # it) before any leg leaves
    ("over-both-pools", "POST", "/v1/completions", j({"prompt": [1] * 600, "max_tokens": 1}), 413, "KV blocks", False),
    # P's blocks fit, D's (prompt + max_tokens) do not: refused at the router too, P never computes it
    ("over-decode-pool", "POST", "/v1/completions", j({"prompt": [1] * 500, "max_tokens": 40}), 413,
     "decode pool", False),
    ("unknown-path", "POST", "/v1/nope", j({}), 404, "", False),
    ("wrong-method", "GET", "/v1/completions", b"", 405, "", False),
    ("abort-unknown-id", "POST", "/v1/abort/cmpl-nope", b"", 404, "no in-flight request", False),
    ("body-too-large", "POST", "/v1/completions", b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413, "", False),
]


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input(dep, reference, case):
    name, method, path, body, status, fragment, reaches = case
    before = counters(dep)
    with Alongside(dep) as normal:
        t0 = time.monotonic()
        got, parsed = raw_http(dep, method, path, body)
        answered_s = time.monotonic() - t0
    normal.check(reference)
    assert got == status, parsed
    err = parsed.get("error")
    assert isinstance(err, dict), f"error body is not JSON: {parsed}"
    assert err["code"] == status and fragment in err["message"], err
    free_s = still_serves(dep, reference)
    after = counters(dep)
    rejected = sum(delta(before, after, r, "rejected") for r in dep.roles())
    assert (rejected > 0) == reaches, (before, after)
    print(f"{name}: HTTP {got} in {answered_s * 1e3:.1f} ms; pools free {free_s * 1e3:.0f} ms later; "
          f"message: {err['message'][:80]}")


def test_streaming_bad_input_is_plain_4xx(dep, reference):
    """A refused streaming request answers a JSON 4xx, not an event stream."""
    got, parsed = raw_http(dep, "POST", "/v1/completions", j({"prompt": [999], "stream": True}))
    assert got == 400 and "vocabulary" in parsed["error"]["message"]
    still_serves(dep, reference)


# ---------------------------------------------------------------------------
# ZMQ: straight to the schedulers' ROUTER sockets
# ---------------------------------------------------------------------------
FRAMES = [
    ("garbage", b"\x00garbage"),
    ("empty", b""),
    ("msgpack-int", msgspec.msgpack.encode(12345)),
    ("unknown-tag", msgspec.msgpack.encode(["Nope", "t", 0])),
    ("other-channel", m.encode(m.StepDone(1, (1, 2)))),
    ("peer-notif", m.encode(m.Register("t", 0, "d", 0, 1, (1,), 1))),
    ("wrong-type-field", msgspec.msgpack.encode(["Generate", "t-wrong-type", 0, "prefill", "notalist", 4])),
    ("missing-fields", msgspec.msgpack.encode(["Generate", "t-missing"])),
    # a leg outside the closed set (messages.Role): refused when decoded, before any handler
    ("unknown-leg", msgspec.msgpack.encode(["Generate", "t-unknown-leg", 0, "bogus", [1, 2], 4])),
    ("truncated", m.encode(m.Generate("t-trunc", 0, "prefill", (1, 2, 3), 1))[:-3]),
    ("big-garbage", b"\xc1" * (48 << 10)),  # under the front socket's cap (64 KiB here)
]


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("name,frame", FRAMES, ids=[f[0] for f in FRAMES])
def test_undecodable_frames_are_counted(dep, reference, role, name, frame):
    before = counters(dep)
    s = dealer(dep.cfg.instance(role).sched_endpoint)
    try:
        with Alongside(dep) as normal:
            s.send(frame)
            reply = recv(s)  # a clear error back to the sender
        assert isinstance(reply, m.RequestFailed) and reply.status == 400, reply
        assert "undecodable" in reply.reason
        if name in ("wrong-type-field", "missing-fields", "unknown-leg"):  # the id is readable: named, so a client can match it
            assert reply.transfer_id.startswith("t-"), reply
    finally:
        s.close(0)
    normal.check(reference)
    after = counters(dep)
    assert delta(before, after, role, "bad_frame") == 1
    assert delta(before, after, role, "requests") == 1  # only the normal request
    still_serves(dep, reference)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_frame_past_the_cap_is_dropped_unread(dep, reference, role):
    """4 MiB at a scheduler whose front socket takes at most twice the largest legal Generate:
    ZeroMQ disconnects the sender; nothing is decoded, answered or counted, and the request
    running alongside is untouched."""
    from pushkv import limits

    assert limits.generate_cap_bytes(dep.cfg) < 4 << 20
    before = counters(dep)
    s = dealer(dep.cfg.instance(role).sched_endpoint)
    try:
        with Alongside(dep) as normal:
            s.send(b"\xc1" * (4 << 20))
            assert not s.poll(1000)  # no answer: the frame never reached the scheduler
    finally:
        s.close(0)
    normal.check(reference)
    after = counters(dep)
    assert delta(before, after, role, "bad_frame") == 0 and delta(before, after, role, "requests") == 1
    still_serves(dep, reference)


def refused(dep, role: str, msg: m.Msg) -> m.RequestFailed:
    s = dealer(dep.cfg.instance(role).sched_endpoint)
    try:
        s.send(m.encode(msg))
        reply = recv(s)
    finally:
        s.close(0)
    assert isinstance(reply, m.RequestFailed), reply
    assert (reply.transfer_id, reply.generation) == (msg.transfer_id, msg.generation)
    return reply


def _bogus_source(dep):
    return m.PrefillSource("prefill-nobody", 1, ("tcp://127.0.0.1:9",))


GENERATE_CASES = [
    # id, role, build(dep, tid) -> Generate, status, fragment
    ("leg-mismatch", "prefill", lambda d, t: gen(d, "decode", t), 400, "cannot serve"),
    ("empty-prompt", "prefill", lambda d, t: gen(d, "prefill", t, prompt=()), 400, "empty prompt"),
    ("max-tokens-0", "decode", lambda d, t: gen(d, "decode", t, max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", "decode", lambda d, t: gen(d, "decode", t, max_tokens=-3), 400, "max_tokens"),
    ("token-above-vocab", "prefill", lambda d, t: gen(d, "prefill", t, prompt=(1, 320)), 400, "vocabulary"),
    ("token-negative", "decode", lambda d, t: gen(d, "decode", t, prompt=(-1,)), 400, "vocabulary"),
    ("over-model-len", "prefill", lambda d, t: gen(d, "prefill", t, prompt=(1,) * (MAX_LEN + 1)), 400,
     "max model length"),
    ("over-pool", "decode", lambda d, t: gen(d, "decode", t, prompt=(1,) * 500, max_tokens=40), 413, "KV blocks"),
    ("decode-without-source", "decode", lambda d, t: gen(d, "decode", t, source=None), 400, "source"),
    ("decode-unknown-source", "decode", lambda d, t: gen(d, "decode", t, source=_bogus_source(d)), 400,
     "unknown prefill source"),
]


@pytest.mark.parametrize("case", GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_invalid_generate_is_refused(dep, reference, case):
    name, role, build, status, fragment = case
    before = counters(dep)
    with Alongside(dep) as normal:
        t0 = time.monotonic()
        reply = refused(dep, role, build(dep, tid()))
        answered_s = time.monotonic() - t0
    normal.check(reference)
    assert reply.status == status and fragment in reply.reason, reply
    after = counters(dep)
    assert delta(before, after, role, "rejected") == 1
    still_serves(dep, reference)
    print(f"{name}: {status} in {answered_s * 1e3:.1f} ms: {reply.reason}")


def test_duplicate_and_stale_generate(dep, reference):
    """Same (transfer id, generation) while in flight, an older generation while a
    newer one is in flight, and the same key again after it finished: all 409."""
    t = tid()
    d = dealer(dep.cfg.decode.sched_endpoint)
    p = dealer(dep.cfg.prefill.sched_endpoint)
    try:
        d.send(m.encode(gen(dep, "decode", t, 1)))  # D registers with P and waits for P's KV
        # admitted before the duplicate is sent: two sockets' messages are not ordered between them, and
        # a duplicate that overtook this one would be the request (and this one its duplicate)
        end = time.monotonic() + 10
        while dep.stats("decode").free_blocks == NUM_BLOCKS:
            assert time.monotonic() < end, "the request was never admitted"
            time.sleep(0.01)
        dup = refused(dep, "decode", gen(dep, "decode", t, 1))
        assert dup.status == 409 and "duplicate" in dup.reason, dup
        stale = refused(dep, "decode", gen(dep, "decode", t, 0))
        assert stale.status == 409 and "stale" in stale.reason, stale
        p.send(m.encode(gen(dep, "prefill", t, 1)))  # the P half: the pair completes
        msgs = recv_until(d, lambda g: any(isinstance(x, m.TokensGenerated) and x.finished for x in g))
        assert [x.token_ids[0] for x in msgs if isinstance(x, m.TokensGenerated)] == reference
        assert all(x.generation == 1 for x in msgs)
        assert isinstance(recv(p), m.PrefillFinished)
        wait_pools_free(dep, timeout_s=10)
        # the same key once more, after it finished: refused, never re-run
        again_d = refused(dep, "decode", gen(dep, "decode", t, 1))
        again_p = refused(dep, "prefill", gen(dep, "prefill", t, 1))
        for r in (again_d, again_p):
            assert r.status == 409 and "duplicate" in r.reason, r
        late_p = refused(dep, "prefill", gen(dep, "prefill", t, 0))
        assert late_p.status == 409 and "stale" in late_p.reason, late_p
    finally:
        d.close(0)
        p.close(0)
    still_serves(dep, reference)


def test_reissue_supersedes_older_generation(dep, reference):
    """Generation 0's D half waits registered at P; generation 1 arrives (both
    halves): 0 is failed with a reason, its registration is dropped on both sides,
    1 completes with the reference tokens; every block comes back."""
    t = tid()
    before = counters(dep)
    d = dealer(dep.cfg.decode.sched_endpoint)
    p = dealer(dep.cfg.prefill.sched_endpoint)
    try:
        d.send(m.encode(gen(dep, "decode", t, 0)))
        end = time.monotonic() + 10
        while dep.stats("decode").free_blocks == NUM_BLOCKS:  # admitted: blocks reserved, registration out
            assert time.monotonic() < end, "generation 0 never admitted"
            time.sleep(0.01)
        t0 = time.monotonic()
        # D's half first, and D's answer to a GetStats behind it: D has seen the reissue before P's half can
        # end generation 0 at P's rendezvous (that order is the rendezvous's own tests' case).
        d.send(m.encode(gen(dep, "decode", t, 1)))
        d.send(m.encode(m.GetStats()))
        msgs = recv_until(d, lambda g: any(isinstance(x, m.Stats) for x in g))
        assert delta(before, {"decode": dict(msgs[-1].counters)}, "decode", "reissued") == 1
        msgs = msgs[:-1]
        p.send(m.encode(gen(dep, "prefill", t, 1)))
        msgs += recv_until(d, lambda g: any(isinstance(x, m.TokensGenerated) and x.finished for x in g))
        old = [x for x in msgs if x.generation == 0]
        assert len(old) == 1 and isinstance(old[0], m.RequestFailed), old
        assert "superseded by generation 1" in old[0].reason
        new = [x for x in msgs if x.generation == 1]
        assert [x.token_ids[0] for x in new if isinstance(x, m.TokensGenerated)] == reference
        pf = recv(p)
        assert isinstance(pf, m.PrefillFinished) and pf.generation == 1, pf
        wait_pools_free(dep, timeout_s=10)
        freed_s = time.monotonic() - t0
    finally:
        d.close(0)
        p.close(0)
    after = counters(dep)
    assert delta(before, after, "decode", "reissued") == 1
    print(f"reissue: generation 0 failed, 1 completed; pools free {freed_s * 1e3:.0f} ms after the reissue")
    still_serves(dep, reference)


def test_registration_nobody_answers(dep, reference):
    """A D leg whose transfer P never hears of: D's registration waits at P's
    rendezvous, nothing pairs it, and the request fails with a reason by the
    deadline; both pools come back."""
    t = tid()
    d = dealer(dep.cfg.decode.sched_endpoint)
    try:
        t0 = time.monotonic()
        d.send(m.encode(gen(dep, "decode", t, 0)))
        with Alongside(dep) as normal:
            reply = recv(d, WAIT_S + 10)
        detect_s = time.monotonic() - t0
    finally:
        d.close(0)
    normal.check(reference)
    assert isinstance(reply, m.RequestFailed) and reply.status == 502, reply
    assert "KV transfer failed" in reply.reason
    assert detect_s < WAIT_S + 3, detect_s
    wait_pools_free(dep, timeout_s=10)
    print(f"unanswered registration: failed after {detect_s:.2f}s ({reply.reason})")


def stats_after(sock) -> m.Stats:
    """GetStats on the same connection: answered only after what was sent before it."""
    sock.send(m.encode(m.GetStats()))
    while True:
        msg = recv(sock)
        if isinstance(msg, m.Stats):
            return msg


def test_abort_unknown_or_wrong_generation_changes_nothing(dep, reference):
    """An Abort for no request, or for the wrong generation of a live one, is
    counted and changes nothing; the right one frees both sides at once."""
    t = tid()
    before = counters(dep)
    d = dealer(dep.cfg.decode.sched_endpoint)
    p = dealer(dep.cfg.prefill.sched_endpoint)
    try:
        p.send(m.encode(m.Abort("nobody", 0)))
        assert stats_after(p).counters.get("abort_unknown", 0) == before["prefill"].get("abort_unknown", 0) + 1
        d.send(m.encode(gen(dep, "decode", t, 0)))  # waits registered at P's rendezvous
        d.send(m.encode(m.Abort(t, 5)))
        st = stats_after(d)
        assert st.counters.get("abort_unknown", 0) == before["decode"].get("abort_unknown", 0) + 1
        assert st.free_blocks < st.num_blocks  # still holding its blocks, still waiting
        with Alongside(dep) as normal:
            pass
        normal.check(reference)
        t0 = time.monotonic()
        d.send(m.encode(m.Abort(t, 0)))
        wait_pools_free(dep, timeout_s=10)
        freed_s = time.monotonic() - t0
        assert not d.poll(200), "an aborted request is not answered (the client asked)"
    finally:
        d.close(0)
        p.close(0)
    after = counters(dep)
    assert delta(before, after, "decode", "aborted") == 1
    assert freed_s < 5, freed_s
    print(f"abort at the rendezvous (D registered, P never prefilled): pools free in {freed_s * 1e3:.0f} ms")
    still_serves(dep, reference)
