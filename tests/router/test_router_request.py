"""The router's request state machine (router/request.py), driven by plain calls: each case is a
sequence of inputs, each with the actions it must answer."""
from __future__ import annotations

import pytest

from pushkv import messages as m
from pushkv.router import policy as P
from pushkv.router import request as R

T0 = 100.0  # the request's arrival (monotonic)
WALL = 1_000.0  # wall clock minus monotonic
SRC = m.PrefillSource("p0", 1, ("hs",))
PULL = m.PullParams(source=SRC, block_ids=(1, 2), num_tokens=3, first_token=7, lease_deadline=0.0)
LP = m.TokenLogprob(-0.5, (7,), (-0.5,))


def new(mode="push", logprobs=-1, request_s=10.0) -> R.Request:
    sampling = m.SamplingParams(logprobs=logprobs) if logprobs >= 0 else None
    spec = R.Spec(mode=mode, transfer_id="t", prompt=(1, 2, 3), max_tokens=4, stop=(9,), request_s=request_s,
                  sampling=sampling, local_engine="l0", wall_offset=WALL)
    return R.Request(spec, arrival=T0)


def toks(ids, finished=False, reason="", lps=()):
    return m.TokensGenerated("t", 0, tuple(ids), finished, reason, logprobs=tuple(lps))


def pf(pull=None):
    return m.PrefillFinished("t", 0, first_token=7, pull=pull, cached_tokens=2, prefill_steps=1)


def fail(reason="boom", status=500):
    return m.RequestFailed("t", 0, reason, status)


def placed(kind, prefill="p0", decode="d0"):
    v = P.Verdict(kind, prefill=prefill if kind != P.DECODE_LOCAL else None, decode=decode, reason="why")
    return R.Placed(v, SRC if kind == P.PUSH else None)


def show(a: R.Action) -> tuple:
    """An action as a short tuple the tables compare."""
    if isinstance(a, R.Send):
        msg = a.msg
        if isinstance(msg, m.Abort):
            return ("abort", a.leg, a.engine_id)
        flags = "".join(f" {k}" for k, on in (("src", msg.source is not None), ("pull", msg.pull is not None),
                                              ("late", msg.late), ("here", msg.prefill_here)) if on)
        return ("gen", a.leg, a.engine_id, f"max={msg.max_tokens}{flags}")
    if isinstance(a, R.Tokens):
        return ("tokens", a.token_ids) + ((tuple(lp.logprob for lp in a.logprobs),) if a.logprobs else ())
    if isinstance(a, R.Finished):
        return ("finished", a.finish_reason)
    if isinstance(a, R.Failed):
        return ("failed", a.status, a.reason, a.outcome)
    if isinstance(a, R.Arm):
        return ("arm", a.at)
    return (type(a).__name__.lower(),)


START_PUSH = [(R.Start(), "router", T0, [("arm", T0 + 10), ("place",)]),
              (placed(P.PUSH), "router", T0, [("gen", "prefill", "p0", "max=1"),
                                               ("gen", "decode", "d0", "max=4 src")])]
START_LATE = [(R.Start(), "router", T0, [("arm", T0 + 10), ("place",)]),
              (placed(P.LATE), "router", T0, [("gen", "prefill", "p0", "max=1 late")])]
START_PULL = [(R.Start(), "router", T0, [("arm", T0 + 10), ("place",)]),
              (placed(P.LATE), "router", T0, [("gen", "prefill", "p0", "max=1")])]
DONE = [("finished", "stop"), ("disarm",)]

CASES = {
    "push completes": ("push", -1, START_PUSH + [
        (toks([7]), "prefill", T0 + 1, []),  # P's own token: D re-emits it
        (pf(), "prefill", T0 + 1, [("prefilldone",)]),
        (toks([7]), "decode", T0 + 2, [("kvarrived",), ("tokens", (7,))]),
        (toks([8], True, "stop"), "decode", T0 + 3, [("tokens", (8,))] + DONE),
        (toks([8], True, "stop"), "decode", T0 + 4, []),  # a duplicate after the end
        (fail(), "decode", T0 + 4, []),  # a late failure after the end
        (R.Close("request complete"), "router", T0 + 5, [("disarm",), ("release",)]),  # nothing open
        (R.Close("request complete"), "router", T0 + 5, []),
    ]),
    "push: D done first waits for P's report": ("push", -1, START_PUSH + [
        (toks([7, 8], True, "length"), "decode", T0 + 2, [("kvarrived",), ("tokens", (7, 8)),
                                                          ("arm", T0 + 2 + R.PREFILL_REPORT_GRACE_S)]),
        (pf(), "prefill", T0 + 2.5, [("prefilldone",), ("finished", "length"), ("disarm",)]),
    ]),
    "push: P never reports, the grace ends it": ("push", -1, START_PUSH + [
        (toks([7], True, "stop"), "decode", T0 + 2, [("kvarrived",), ("tokens", (7,)), ("arm", T0 + 3)]),
        (R.Tick(), "router", T0 + 2.9, []),
        (R.Tick(), "router", T0 + 3, DONE),
        (R.Close("request complete"), "router", T0 + 3, [("disarm",), ("release",), ("abort", "prefill", "p0")]),
    ]),
    "push: P fails after D finished: the client has every token": ("push", -1, START_PUSH + [
        (toks([7], True, "stop"), "decode", T0 + 2, [("kvarrived",), ("tokens", (7,)), ("arm", T0 + 3)]),
        (fail(), "prefill", T0 + 2.1, DONE),
        (R.Close("request complete"), "router", T0 + 3, [("disarm",), ("release",)]),
    ]),
    "P fails": ("push", -1, START_PUSH + [
        (fail("no blocks", 503), "prefill", T0 + 1, [("failed", 503, "prefill: no blocks", "failed"), ("disarm",)]),
        (toks([7]), "decode", T0 + 2, []),
        (R.Close("request failed"), "router", T0 + 2, [("disarm",), ("release",), ("abort", "decode", "d0")]),
    ]),
    "D fails (pull)": ("pull", -1, START_PULL + [
        (pf(PULL), "prefill", T0 + 1, [("prefilldone",), ("placedecode",)]),
        (R.DecodePlaced("d1"), "router", T0 + 1, [("gen", "decode", "d1", "max=4 src pull")]),
        (toks([7]), "decode", T0 + 2, [("kvarrived",), ("tokens", (7,))]),
        (fail("step failed"), "decode", T0 + 3, [("failed", 500, "decode: step failed", "failed"), ("disarm",)]),
        (R.Close("request failed"), "router", T0 + 3, [("disarm",), ("release",)]),  # both legs ended
    ]),
    "late: no D can hold it yet": ("push", -1, START_LATE + [
        (pf(PULL), "prefill", T0 + 1, [("prefilldone",), ("placedecode",)]),
        (R.DecodeQueued(), "router", T0 + 1, []),
        (R.DecodePlaced("d0"), "router", T0 + 2, [("gen", "decode", "d0", "max=4 src pull")]),
        (toks([7, 8], True, "stop"), "decode", T0 + 3, [("kvarrived",), ("tokens", (7, 8))] + DONE),
    ]),
    # P answered its late leg but still holds the KV: a request that ends before D has it frees it
    "late: D fails before its KV": ("push", -1, START_LATE + [
        (pf(PULL), "prefill", T0 + 1, [("prefilldone",), ("placedecode",)]),
        (R.DecodePlaced("d0"), "router", T0 + 2, [("gen", "decode", "d0", "max=4 src pull")]),
        (fail("decode instance failed", 503), "decode", T0 + 3,
         [("failed", 503, "decode: decode instance failed", "failed"), ("disarm",)]),
        (R.Close("request failed"), "router", T0 + 3, [("disarm",), ("release",), ("abort", "prefill", "p0")]),
    ]),
    "late: the client leaves while D's leg waits at the router": ("push", -1, START_LATE + [
        (pf(PULL), "prefill", T0 + 1, [("prefilldone",), ("placedecode",)]),
        (R.DecodeQueued(), "router", T0 + 1, []),
        (R.Close("client disconnected"), "router", T0 + 2, [("disarm",), ("release",), ("abort", "prefill", "p0")]),
    ]),
    "pull: P answers without pull parameters": ("pull", -1, START_PULL + [
        (pf(None), "prefill", T0 + 1, [("prefilldone",),
                                       ("failed", 502, "prefill finished without pull parameters", "failed"),
                                       ("disarm",)]),
    ]),
    "client aborts mid-stream": ("push", -1, START_PUSH + [
        (toks([7]), "decode", T0 + 2, [("kvarrived",), ("tokens", (7,))]),
        (R.Close("client disconnected"), "router", T0 + 2, [("disarm",), ("release",), ("abort", "decode", "d0"),
                                                            ("abort", "prefill", "p0")]),
        (toks([8]), "decode", T0 + 3, []),  # closed: over
    ]),
    "the abort endpoint": ("push", -1, START_PUSH + [
        (R.Cancel(499, "aborted via /v1/abort"), "router", T0 + 1,
         [("failed", 499, "aborted via /v1/abort", "aborted"), ("disarm",)]),
    ]),
    "shutdown": ("push", -1, START_PUSH + [
        (R.Cancel(503, "router shutting down", "shutdown"), "router", T0 + 1,
         [("failed", 503, "router shutting down", "shutdown"), ("disarm",)]),
    ]),
    "an instance holding a leg down": ("push", -1, START_PUSH + [
        (R.Cancel(503, "decode instance failed: decode-worker-0 died; retry", "failed"), "router", T0 + 1,
         [("failed", 503, "decode instance failed: decode-worker-0 died; retry", "failed"), ("disarm",)]),
    ]),
    "the deadline, waiting at the balancer": ("push", -1, [
        (R.Start(), "router", T0, [("arm", T0 + 10), ("place",)]),
        (R.Queued(), "router", T0, []),
        (R.Tick(), "router", T0 + 9.9, []),
        (R.Tick(), "router", T0 + 10, [("failed", 504, "request exceeded 10 s", "timeout"), ("disarm",)]),
        (placed(P.PUSH), "router", T0 + 11, []),  # too late
        (R.Close("request timeout"), "router", T0 + 11, [("disarm",), ("release",)]),
    ]),
    "the deadline, running": ("push", -1, START_PUSH + [
        (R.Tick(), "router", T0 + 10, [("failed", 504, "request exceeded 10 s", "timeout"), ("disarm",)]),
    ]),
    "refused by the balancer": ("push", -1, [
        (R.Start(), "router", T0, [("arm", T0 + 10), ("place",)]),
        (R.Rejected(429, "queue full"), "router", T0, [("failed", 429, "queue full", "rejected"), ("disarm",)]),
    ]),
    "a link refuses the send": ("push", -1, START_PUSH + [
        (R.SendFailed("prefill", "queue full", unsent=("decode",)), "router", T0,
         [("failed", 503, "scheduler unreachable: queue full", "failed"), ("disarm",)]),
        (R.Close("request failed"), "router", T0, [("disarm",), ("release",), ("abort", "prefill", "p0")]),
    ]),
    "decode-local": ("push", -1, [
        (R.Start(), "router", T0, [("arm", T0 + 10), ("place",)]),
        (placed(P.DECODE_LOCAL), "router", T0, [("gen", "decode", "d0", "max=4 here")]),
        (toks([7, 8], True, "length"), "decode", T0 + 1, [("kvarrived",), ("tokens", (7, 8)),
                                                          ("finished", "length"), ("disarm",)]),
    ]),
    "local": ("local", -1, [
        (R.Start(), "router", T0, [("arm", T0 + 10), ("gen", "local", "l0", "max=4")]),
        (toks([7]), "local", T0 + 1, [("tokens", (7,))]),
        (toks([8], True, "stop"), "local", T0 + 2, [("tokens", (8,))] + DONE),
        (R.Close("request complete"), "router", T0 + 2, [("disarm",)]),
    ]),
    "logprobs: D's first token waits for P's": ("push", 0, START_PUSH + [
        (toks([7, 8], lps=[m.TokenLogprob(-1.0)]), "decode", T0 + 2, []),  # D has no logprob for P's token
        (toks([9]), "decode", T0 + 2, []),  # held behind it, in order
        (toks([7], lps=[LP]), "prefill", T0 + 2, [("kvarrived",), ("tokens", (7, 8), (-0.5, -1.0)),
                                                  ("tokens", (9,))]),
    ]),
    "a stop string ends the choice": ("push", -1, START_PUSH + [
        (toks([7]), "decode", T0 + 2, [("kvarrived",), ("tokens", (7,))]),
        (R.Stopped(), "router", T0 + 2, [("disarm",)]),
        (toks([8]), "decode", T0 + 3, []),
        (R.Close("stop string matched"), "router", T0 + 3, [("disarm",), ("release",), ("abort", "decode", "d0"),
                                                            ("abort", "prefill", "p0")]),
    ]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sequence(name):
    mode, logprobs, steps = CASES[name]
    req = new(mode, logprobs)
    for i, (msg, leg, now, want) in enumerate(steps):
        got = [show(a) for a in req.on(msg, now, leg)]
        assert got == want, f"step {i}: {type(msg).__name__} from {leg}"


@pytest.mark.parametrize("name, outcome", [
    ("push completes", "ok"), ("P fails", "failed"), ("the abort endpoint", "aborted"), ("shutdown", "shutdown"),
    ("the deadline, running", "timeout"), ("refused by the balancer", "rejected"),
    ("a stop string ends the choice", "ok"),
])
def test_the_end_sets_the_records_outcome(name, outcome):
    mode, logprobs, steps = CASES[name]
    req = new(mode, logprobs)
    for msg, leg, now, _ in steps:
        req.on(msg, now, leg)
    assert req.over and req.ledger.outcome == outcome


def test_what_a_completed_request_keeps():
    req = new("push")
    for msg, leg, now, _ in CASES["push completes"][2]:
        req.on(msg, now, leg)
    assert req.ledger.output_ids == [7, 8] and req.ledger.emitted == 2 and req.ledger.done
    assert req.ledger.cached == {"prefill": 2, "decode": 0} and req.ledger.prefill_work == (1, 0, 0)
    assert req.ledger.engines == {"prefill": "p0", "decode": "d0"} and req.ledger.path == "push"
    assert req.ledger.first_token == T0 + 2 and req.ledger.finish == T0 + 3
    assert req.ledger.token_times == [(T0 + 2, 1), (T0 + 3, 1)]
    tl = req.ledger.timeline
    assert tl["router.arrival"] == T0 + WALL and tl["router.send_prefill"] == T0 + WALL
    assert tl["router.first_token"] == T0 + 2 + WALL and tl["router.finish"] == T0 + 3 + WALL


def test_the_generate_legs_carry_the_request():
    req = new("push", logprobs=0)
    req.on(R.Start(), T0)
    p, d = (a.msg for a in req.on(placed(P.PUSH), T0))
    assert isinstance(p, m.Generate) and isinstance(d, m.Generate)
    assert (p.leg, p.max_tokens, p.source, d.leg, d.max_tokens, d.source) == ("prefill", 1, None, "decode", 4, SRC)
    for g in (p, d):
        assert (g.transfer_id, g.generation, g.prompt_token_ids, g.stop_token_ids) == ("t", 0, (1, 2, 3), (9,))
        assert g.arrival == T0 + WALL and g.sampling == m.SamplingParams(logprobs=0)


def test_late_path_and_queue_marks():
    req = new("push")
    req.on(R.Start(), T0)
    req.on(R.Queued(), T0)
    req.on(placed(P.LATE), T0 + 1)
    assert req.ledger.path == "late" and req.ledger.late
    assert {"router.queued", "router.placed", "router.late_allocation"} <= set(req.ledger.timeline)


@pytest.mark.parametrize("role, engine, steps, holds", [
    ("decode", "d0", 0, True),  # D's leg is open
    ("decode", "d1", 0, False),  # another D
    ("prefill", "p0", 2, False),  # push: P reported, D has its KV coming by itself
    ("decode", "d0", 4, False),  # D ended its leg
])
def test_an_instance_down_fails_what_it_holds(role, engine, steps, holds):
    req = new("push")
    seq = [(R.Start(), "router"), (placed(P.PUSH), "router"), (pf(), "prefill"), (toks([7]), "decode"),
           (toks([8], True, "stop"), "decode")]
    for msg, leg in seq[:2 + steps]:
        req.on(msg, T0, leg)
    assert req.holds(role, engine) is holds


def test_a_late_p_holds_the_kv_until_d_streams():
    req = new("pull")
    for msg, leg, now, _ in START_PULL + [(pf(PULL), "prefill", T0, None), (R.DecodePlaced("d0"), "router", T0, None)]:
        req.on(msg, now, leg)
    assert req.holds("prefill", "p0")  # P's leg ended, but D has not read the KV yet
    req.on(toks([7]), T0, "decode")
    assert not req.holds("prefill", "p0")


def test_every_input_has_one_handler_and_others_are_dropped():
    inputs = {R.Start, R.Queued, R.DecodeQueued, R.Rejected, R.SendFailed, R.Cancel, R.Tick, R.Stopped, R.Shown, R.Close,
              R.Placed, R.DecodePlaced, m.TokensGenerated, m.PrefillFinished, m.RequestFailed}
    assert set(R.Request.HANDLERS) == inputs
    req = new("push")
    assert req.on(m.Stats("e", "decode", 1, 1, 0, 0), T0, "decode") == [] and req.phase is R.Phase.NEW


def test_start_twice_is_an_error_naming_the_phase():
    req = new("push")
    req.on(R.Start(), T0)
    with pytest.raises(ValueError, match="Start in phase placing"):
        req.on(R.Start(), T0)


@pytest.mark.parametrize("client_id, names", [("", "transfer_id=t status=503"),
                                               ("myreq-1", "transfer_id=t client_id=myreq-1 status=503")])
def test_a_failure_line_names_the_clients_id(monkeypatch, caplog, client_id, names):
    """The client was answered `cmpl-myreq-1` for X-Request-Id myreq-1: that id finds the line of its failure."""
    monkeypatch.setattr(R, "LINES", type(R.LINES)())
    spec = R.Spec(mode="push", transfer_id="t", prompt=(1, 2, 3), max_tokens=4, stop=(9,), request_s=10.0,
                  client_id=client_id)
    req = R.Request(spec, arrival=T0)
    for msg, leg, now, _ in START_PUSH:
        req.on(msg, now, leg)
    with caplog.at_level("INFO", logger=R.__name__):
        req.on(fail("decode-worker-0 died", 503), T0, "decode")
    assert [r.getMessage() for r in caplog.records] == [
        f"leg decode failed {names}: decode-worker-0 died (decode legs failed with 503 so far: 1)"]


def test_refusals_are_logged_first_one_by_one_then_one_in_a_hundred(monkeypatch, caplog):
    """A client retrying hard while an instance restarts gets a 503 each time: the log keeps the first ten, then
    every hundredth, each with the count so far."""
    monkeypatch.setattr(R, "LINES", type(R.LINES)())
    with caplog.at_level("INFO", logger=R.__name__):
        for _ in range(250):
            req = new("push")
            req.on(R.Start(), T0)
            assert req.on(R.Rejected(503, "no live decode instance"), T0)[0] == R.Failed(
                503, "no live decode instance", "rejected")
        req = new("push")
        req.on(R.Start(), T0)
        req.on(R.Rejected(429, "queue full"), T0)  # another status counts apart
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
    assert len(lines) == 10 + 2 + 1, lines
    assert lines[-2].endswith("(refused with 503 so far: 200)") and lines[-1].endswith("(refused with 429 so far: 1)")
