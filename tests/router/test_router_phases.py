"""The router request's phase table (router/request.py ``TRANSITIONS``), driven by plain calls: every
legal transition, each to every phase the table allows it to lead to; every input a live phase does
not take raises, naming the phase and the input, and leaves the request unchanged (h11's rule); once
over, inputs are dropped (in DONE, Stopped and Shown only say how the choice ended to a leg whose end waits for it)."""
from __future__ import annotations

import copy

import pytest

from pushkv import messages as m
from pushkv.router import policy as P
from pushkv.router import request as R

Ph = R.Phase
T0 = 100.0  # arrival (monotonic); the request's deadline is T0 + 10
SRC = m.PrefillSource("p0", 1, ("hs",))
PULL = m.PullParams(source=SRC, block_ids=(1, 2), num_tokens=3, first_token=7, lease_deadline=0.0)
RT = R.ROUTER


def new(mode: str) -> R.Request:
    spec = R.Spec(mode=mode, transfer_id="t", prompt=(1, 2, 3), max_tokens=4, stop=(), request_s=10.0,
                  local_engine="l0")
    return R.Request(spec, arrival=T0)


def toks(ids, finished=False):
    return m.TokensGenerated("t", 0, tuple(ids), finished, "stop" if finished else "")


def pf(pull=None):
    return m.PrefillFinished("t", 0, first_token=7, pull=pull)


def fail(reason="boom"):
    return m.RequestFailed("t", 0, reason, 500)


def placed(kind):
    v = P.Verdict(kind, prefill="p0", decode="d0" if kind == P.PUSH else None)
    return R.Placed(v, SRC if kind == P.PUSH else None)


# how to reach each phase, per mode: (input, leg) at T0
REACH = {
    ("push", Ph.NEW): [], ("local", Ph.NEW): [],
    ("push", Ph.PLACING): [(R.Start(), RT)],
    ("push", Ph.QUEUED): [(R.Start(), RT), (R.Queued(), RT)],
    ("push", Ph.RUNNING): [(R.Start(), RT), (placed(P.PUSH), RT)],
    ("local", Ph.RUNNING): [(R.Start(), RT)],
    ("pull", Ph.RUNNING): [(R.Start(), RT), (placed(P.LATE), RT)],
    ("pull", Ph.DECODE_PLACING): [(R.Start(), RT), (placed(P.LATE), RT), (pf(PULL), "prefill")],
    ("pull", Ph.DECODE_QUEUED): [(R.Start(), RT), (placed(P.LATE), RT), (pf(PULL), "prefill"), (R.DecodeQueued(), RT)],
    # push: D done first, P not reported: the grace ends at T0 + 1
    ("push", Ph.FINISHING): [(R.Start(), RT), (placed(P.PUSH), RT), (toks([7], True), "decode")],
    ("push", Ph.DONE): [(R.Start(), RT), (R.Cancel(499, "aborted"), RT)],
    ("push", Ph.CLOSED): [(R.Start(), RT), (R.Close(), RT)],
}
MODE = {Ph.NEW: "push", Ph.PLACING: "push", Ph.QUEUED: "push", Ph.RUNNING: "push", Ph.DECODE_PLACING: "pull",
        Ph.DECODE_QUEUED: "pull", Ph.FINISHING: "push", Ph.DONE: "push", Ph.CLOSED: "push"}
DUE = {Ph.FINISHING: T0 + 1}  # when the armed deadline is due, where not T0 + 10


def reach(mode: str, phase: Ph) -> R.Request:
    req = new(mode)
    for msg, leg in REACH[(mode, phase)]:
        req.on(msg, T0, leg)
    assert req.phase is phase
    return req


# (phase, mode, input, leg, now, the phase it leads to)
LEGAL = [
    (Ph.NEW, "push", R.Start(), RT, T0, Ph.PLACING),
    (Ph.NEW, "local", R.Start(), RT, T0, Ph.RUNNING),
    (Ph.PLACING, "push", placed(P.PUSH), RT, T0, Ph.RUNNING),
    (Ph.PLACING, "push", R.Queued(), RT, T0, Ph.QUEUED),
    (Ph.PLACING, "push", R.Rejected(429, "queue full"), RT, T0, Ph.DONE),
    (Ph.QUEUED, "push", placed(P.LATE), RT, T0, Ph.RUNNING),
    (Ph.RUNNING, "push", R.SendFailed("prefill", "queue full", ("decode",)), RT, T0, Ph.DONE),
    (Ph.RUNNING, "push", toks([7]), "decode", T0, Ph.RUNNING),
    (Ph.RUNNING, "push", toks([7], True), "decode", T0, Ph.FINISHING),  # P has not reported
    (Ph.RUNNING, "local", toks([7], True), "local", T0, Ph.DONE),
    (Ph.RUNNING, "push", pf(), "prefill", T0, Ph.RUNNING),
    (Ph.RUNNING, "pull", pf(PULL), "prefill", T0, Ph.DECODE_PLACING),
    (Ph.RUNNING, "pull", pf(None), "prefill", T0, Ph.DONE),  # no pull parameters: 502
    (Ph.RUNNING, "push", fail(), "decode", T0, Ph.DONE),
    (Ph.RUNNING, "push", R.Stopped(), RT, T0, Ph.DONE),
    (Ph.DECODE_PLACING, "pull", R.DecodePlaced("d0"), RT, T0, Ph.RUNNING),
    (Ph.DECODE_PLACING, "pull", R.DecodeQueued(), RT, T0, Ph.DECODE_QUEUED),
    (Ph.DECODE_PLACING, "pull", toks([7]), "prefill", T0, Ph.DECODE_PLACING),  # P's own token
    (Ph.DECODE_PLACING, "pull", fail("lease expired"), "prefill", T0, Ph.DONE),
    (Ph.DECODE_QUEUED, "pull", R.DecodePlaced("d0"), RT, T0, Ph.RUNNING),
    (Ph.DECODE_QUEUED, "pull", toks([7]), "prefill", T0, Ph.DECODE_QUEUED),
    (Ph.DECODE_QUEUED, "pull", fail("lease expired"), "prefill", T0, Ph.DONE),
    (Ph.FINISHING, "push", toks([7]), "prefill", T0, Ph.FINISHING),  # P's own token, after D's last
    (Ph.FINISHING, "push", pf(), "prefill", T0, Ph.DONE),
    (Ph.FINISHING, "push", fail(), "prefill", T0, Ph.DONE),  # the client has every token: finished
    (Ph.FINISHING, "push", R.Stopped(), RT, T0, Ph.DONE),
    (Ph.DONE, "push", R.Close(), RT, T0, Ph.CLOSED),
    (Ph.DONE, "push", R.Stopped(), RT, T0, Ph.DONE),  # on the last token: D hears it (ChoiceEnded)
    (Ph.DONE, "push", R.Shown("length"), RT, T0, Ph.DONE),
    (Ph.NEW, "push", R.Tick(), RT, T0 + 99, Ph.NEW),  # nothing armed before Start
]
for _p in (Ph.NEW, Ph.PLACING, Ph.QUEUED, Ph.RUNNING, Ph.DECODE_PLACING, Ph.DECODE_QUEUED, Ph.FINISHING):
    LEGAL += [(_p, MODE[_p], R.Cancel(503, "router shutting down", "shutdown"), RT, T0, Ph.DONE),
              (_p, MODE[_p], R.Close(), RT, T0, Ph.CLOSED)]
    if _p is not Ph.NEW:
        LEGAL += [(_p, MODE[_p], R.Tick(), RT, T0 + 0.5, _p),
                  (_p, MODE[_p], R.Tick(), RT, DUE.get(_p, T0 + 10), Ph.DONE)]


def row_id(row) -> str:
    phase, mode, msg, leg, _, want = row
    return f"{phase.value}-{mode}-{type(msg).__name__}-{leg}->{want.value}"


def test_the_rows_cover_every_legal_transition():
    table = {(p, t, n) for p, row in R.TRANSITIONS.items() for t, nexts in row.items() for n in nexts}
    rows = {(p, type(msg), want) for p, _, msg, _, _, want in LEGAL}
    assert rows == table


@pytest.mark.parametrize("row", LEGAL, ids=row_id)
def test_legal_transition(row):
    phase, mode, msg, leg, now, want = row
    req = reach(mode, phase)
    req.on(msg, now, leg)
    assert req.phase is want


# one input of every type the machine takes, with the leg it comes from
SAMPLES = [(R.Start(), RT), (placed(P.PUSH), RT), (R.Queued(), RT), (R.Rejected(429, "full"), RT),
           (R.DecodePlaced("d0"), RT), (R.DecodeQueued(), RT), (R.SendFailed("decode", "gone"), RT),
           (toks([7]), "decode"), (pf(PULL), "prefill"), (fail(), "decode"), (R.Cancel(499, "x"), RT),
           (R.Tick(), RT), (R.Stopped(), RT), (R.Shown("length"), RT), (R.Close(), RT)]
ILLEGAL = [(p, msg, leg) for p in (Ph.NEW, Ph.PLACING, Ph.QUEUED, Ph.RUNNING, Ph.DECODE_PLACING, Ph.DECODE_QUEUED,
                                   Ph.FINISHING)
           for msg, leg in SAMPLES if type(msg) not in R.TRANSITIONS[p]]


def test_the_samples_are_every_input():
    assert {type(msg) for msg, _ in SAMPLES} == set(R.Request.HANDLERS)


def snapshot(req: R.Request) -> tuple:
    return req.phase, copy.deepcopy(req.ledger), req.deadline, list(req.held), req.p_report


@pytest.mark.parametrize("phase, msg, leg", ILLEGAL,
                         ids=[f"{p.value}-{type(msg).__name__}" for p, msg, _ in ILLEGAL])
def test_illegal_input_raises_and_changes_nothing(phase, msg, leg):
    req = reach(MODE[phase], phase)
    before = snapshot(req)
    with pytest.raises(R.IllegalInput, match=f"^{type(msg).__name__} in phase {phase.value} transfer_id=t$"):
        req.on(msg, T0, leg)
    assert snapshot(req) == before


def test_a_message_from_a_leg_never_sent_raises():
    req = reach("pull", Ph.RUNNING)  # P's leg only: D's comes once P is done
    before = snapshot(req)
    with pytest.raises(R.IllegalInput, match="TokensGenerated from the decode leg, never sent, in phase running"):
        req.on(toks([7]), T0, "decode")
    assert snapshot(req) == before


@pytest.mark.parametrize("phase", [Ph.DONE, Ph.CLOSED])
def test_over_drops_every_input_but_the_first_close(phase):
    req = reach("push", phase)
    for msg, leg in SAMPLES:
        if phase is Ph.DONE and isinstance(msg, R.Close):
            continue
        before = snapshot(req)
        assert req.on(msg, T0 + 99, leg) == [] and snapshot(req) == before


@pytest.mark.parametrize("path, close, outcome, abort_reason", [
    ("running", R.Close(), "aborted", "client disconnected"),  # the client went away
    ("running", R.Close(outcome="rejected"), "rejected", "request rejected"),  # a sibling choice was refused
    ("running", R.Close("stop string matched"), "aborted", "stop string matched"),
    ("failed", R.Close(), "failed", "request failed"),  # ended before: the first outcome stands
    ("cancelled", R.Close(), "aborted", "aborted via /v1/abort"),  # the legs hear why, not "client disconnected"
])
def test_close_ends_what_had_not_ended(path, close, outcome, abort_reason):
    req = reach("push", Ph.RUNNING)
    if path == "failed":
        req.on(fail(), T0, "decode")
    if path == "cancelled":
        req.on(R.Cancel(499, "aborted via /v1/abort", "aborted"), T0, RT)
    out = req.on(close, T0, RT)
    assert req.phase is Ph.CLOSED and req.ledger.outcome == outcome
    assert {a.msg.reason for a in out if isinstance(a, R.Send)} == {abort_reason}


class SentLog:
    """A scheduler link that keeps what the shell sends (the shell test needs no socket)."""

    def __init__(self):
        self.sent: list[m.Msg] = []

    def send(self, msg: m.Msg) -> None:
        self.sent.append(msg)


def test_the_shell_drops_a_schedulers_input_out_of_turn_and_raises_on_its_own(tmp_path):
    from pushkv.router.flow import RequestRun
    from pushkv.router.metrics import RouterMetrics

    from tests.support.router_fakes import make_cfg

    link = SentLog()
    run = RequestRun(make_cfg(tmp_path, "local"), None, "t", [1, 2, 3], 4, (), T0, RouterMetrics("local"),
                     local_link=link)
    assert run.start() is None and [type(g) for g in link.sent] == [m.Generate]
    assert run._feed(toks([7]), "decode") == []  # no decode leg in local mode: logged and dropped
    assert run.req.phase is Ph.RUNNING and run.ledger.output_ids == []
    with pytest.raises(R.IllegalInput, match="Placed in phase running"):  # the router's own bug is loud
        run._feed(placed(P.PUSH))
    assert run._feed(toks([7], True), "local") == [R.Tokens((7,), last=True), R.Finished("stop")]
    run.close()
    assert run.req.phase is Ph.CLOSED and run.ledger.outcome == "ok"


def test_per_request_lines_are_written_as_floods_says():
    """A late allocation, a failed leg, a client gone: the first ten lines of a kind, then every hundredth, each
    saying its count (a burst of 1,500 requests had written 1,013 late-allocation lines)."""
    from pushkv.floods import Kinds

    lines = Kinds()
    written = [n for n in (lines.seen("late") for _ in range(250)) if n]
    assert written == list(range(1, 11)) + [100, 200]
    assert lines.seen(("failed", "decode", 503)) == 1  # each kind counts on its own


@pytest.mark.parametrize("mode, before, finish", [
    # a stop string: the client has its answer; the token leg ends "stop" there, as vLLM counts a stop string its
    # frontend matched (P's instance knows whether its one token was out)
    ("push", [(R.Stopped(), RT)], {"decode": "stop", "prefill": ""}),
    ("local", [(toks([7]), "local"), (R.Stopped(), RT)], {"local": "stop"}),
    ("push", [(toks([7], True), "decode"), (R.Tick(), RT)], {"prefill": ""}),  # D done, P not reported
    # the client went away, a failure, the deadline: aborts, which vLLM counts nowhere
    ("push", [], {"decode": "", "prefill": ""}),
    ("push", [(fail(), "decode")], {"prefill": ""}),
    ("local", [(R.Tick(), RT)], {"local": ""}),
])
def test_an_open_leg_hears_whether_the_request_was_complete(mode, before, finish):
    req = reach(mode, Ph.RUNNING)
    for msg, leg in before:
        req.on(msg, T0 + 20 if isinstance(msg, R.Tick) else T0, leg)
    out = req.on(R.Close(), T0 + 20, RT)
    assert {a.leg: a.msg.finish for a in out if isinstance(a, R.Send) and isinstance(a.msg, m.Abort)} == finish


def ended_by_length(mode: str, stop_strings: bool = True, reason: str = "length") -> R.Request:
    """A request whose token leg's last token came, ending it by ``reason``, the client's text searched for stop
    strings (``stop_strings``)."""
    spec = R.Spec(mode=mode, transfer_id="t", prompt=(1, 2, 3), max_tokens=4, stop=(), request_s=10.0,
                  local_engine="l0", stop_strings=stop_strings)
    req = R.Request(spec, arrival=T0)
    for msg, leg in REACH[(mode, Ph.RUNNING)]:
        req.on(msg, T0, leg)
    leg = req.token_leg
    req.on(m.TokensGenerated("t", 0, (7,), True, reason), T0, leg)
    return req


def told(out) -> list[tuple[str, str]]:
    return [(a.leg, a.msg.finish) for a in out if isinstance(a, R.Send) and isinstance(a.msg, m.ChoiceEnded)]


@pytest.mark.parametrize("mode, inputs, said", [
    # a stop string on the last token (the leg ended by length): vLLM's frontend counts it stop
    ("local", [R.Stopped(), R.Close()], [("local", "stop")]),
    ("push", [R.Stopped(), R.Close()], [("decode", "stop")]),  # D done, P not reported: FINISHING
    # the client was given the end: how it ended there (a stop string can match only as the text is flushed)
    ("local", [R.Shown("length"), R.Close()], [("local", "length")]),
    ("local", [R.Shown("stop"), R.Stopped(), R.Close()], [("local", "stop")]),
    # the client went before its end was given: the leg's own reason
    ("local", [R.Close()], [("local", "length")]),
])
def test_a_leg_ended_by_length_hears_once_how_the_clients_choice_ended(mode, inputs, said):
    req = ended_by_length(mode)
    assert told([a for msg in inputs for a in req.on(msg, T0, RT)]) == said
    assert req.ledger.outcome == "ok"


@pytest.mark.parametrize("stop_strings, reason", [(False, "length"), (True, "stop")])
def test_no_word_is_owed_without_stop_strings_or_for_a_leg_that_ended_by_stop(stop_strings, reason):
    req = ended_by_length("local", stop_strings, reason)
    assert told(req.on(R.Stopped(), T0, RT) + req.on(R.Close(), T0, RT)) == []


def test_only_the_token_leg_is_told_that_stop_strings_are_searched():
    spec = R.Spec(mode="push", transfer_id="t", prompt=(1, 2, 3), max_tokens=4, stop=(), request_s=10.0,
                  stop_strings=True)
    req = R.Request(spec, arrival=T0)
    req.on(R.Start(), T0, RT)
    sent = {a.leg: a.msg.stop_strings for a in req.on(placed(P.PUSH), T0, RT) if isinstance(a, R.Send)}
    assert sent == {"prefill": False, "decode": True}


@pytest.mark.parametrize("mode, reported, last", [("local", False, True), ("push", True, True),
                                                  ("push", False, False)])
def test_the_last_tokens_say_whether_the_finish_comes_with_them(mode, reported, last):
    """A run's last tokens are marked last (the stream sends them with the finish_reason, as vLLM's) only where
    their Finished comes with them: in push, D's last before P's report waits for it, so they go out alone at once
    rather than held up to PREFILL_REPORT_GRACE_S."""
    req = reach(mode, Ph.RUNNING)
    if reported:
        req.on(pf(), T0, "prefill")
    out = req.on(toks([7], True), T0, "local" if mode == "local" else "decode")
    tokens = [a for a in out if isinstance(a, R.Tokens)]
    assert [t.last for t in tokens] == [last]
    assert any(isinstance(a, R.Finished) for a in out) is last
