"""A finished request's spans for ``--otlp-traces-endpoint`` (router/otlp_spans.py, pure): vLLM's ``llm_request``
with its attribute names, and pushkv's phases as children where both their ends were reported; and the flag's
refusals (pushkv/otlp.py)."""
from __future__ import annotations

import builtins

import pytest

from pushkv import messages as m
from pushkv import otlp
from pushkv.router import otlp_spans as S
from pushkv.router.ledger import Ledger

pytestmark = pytest.mark.unit

WALL = 1_700_000_000.0  # the router's wall clock at arrival; its monotonic clock then read 100.0


def near(x: float):
    """Equal to within a microsecond: wall seconds near 1.7e9 keep about seven digits after the point."""
    return pytest.approx(x, abs=1e-6)


def _facts(**kw) -> S.Facts:
    return S.Facts(**{"request_id": "abc", "model": "qwen", "sampling": m.SamplingParams(temperature=0.5, top_p=0.9),
                      "max_tokens": 16, "n": 2, **kw})


def _push_ledger() -> Ledger:
    led = Ledger(arrival=100.0, prompt_tokens=40, path="push")
    led.engines = {"prefill": "p0", "decode": "d0"}
    led.cached = {"prefill": 16}
    led.timeline = {"router.arrival": WALL, "prefill.prefill_queued": WALL + 0.001,
                    "prefill.prefill_start": WALL + 0.003, "prefill.stream_start": WALL + 0.004,
                    "prefill.prefill_end": WALL + 0.010, "prefill.send_kv": WALL + 0.011,
                    "decode.decode_queued": WALL + 0.001, "decode.kv_received": WALL + 0.014,
                    "decode.first_token": WALL + 0.016, "decode.finished": WALL + 0.050}
    led.kv = {"prefill": m.KVTransferStats(57344, 3, 0.004, "registration_first"),
              "decode": m.KVTransferStats(57344, 3, 0.002, "registration_first")}
    led.add_tokens(100.017, 1)
    led.add_tokens(100.030, 2)
    led.add_tokens(100.051, 1)
    led.finish, led.finish_reason, led.outcome = 100.051, "length", "ok"
    return led


def test_a_push_request_is_vllms_span_with_pushkvs_phases_as_children():
    spans = S.request_spans(_push_ledger(), _facts(), end_monotonic=100.060)
    root, kids = spans[0], {s.name: s for s in spans[1:]}
    assert root.name == "llm_request" and root.parent is None and not root.error
    assert root.start == WALL and root.end == near(WALL + 0.051)  # to the last token, not the let-go
    a = root.attributes
    assert a["gen_ai.request.id"] == "abc" and a["gen_ai.response.model"] == "qwen"
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.request.max_tokens"] == 16 and a["gen_ai.request.n"] == 2
    assert a["gen_ai.usage.prompt_tokens"] == 40 and a["gen_ai.usage.completion_tokens"] == 4
    assert a["gen_ai.latency.time_to_first_token"] == near(0.017)
    assert a["gen_ai.latency.e2e"] == near(0.051)
    assert a["gen_ai.latency.time_in_queue"] == near(0.002)
    assert a["gen_ai.latency.time_in_model_prefill"] == near(0.007)
    assert a["gen_ai.latency.time_in_model_decode"] == near(0.036)
    assert a["gen_ai.latency.time_in_model_inference"] == near(0.043)
    # P's measure of the transfer (push: the side that posted it), the path and the instances
    assert (a["pushkv.kv.bytes"], a["pushkv.kv.descriptors"], a["pushkv.kv.transfer_seconds"]) == (57344, 3, 0.004)
    assert a["pushkv.kv.rendezvous"] == "registration_first" and a["pushkv.path"] == "push"
    assert (a["pushkv.prefill.engine"], a["pushkv.decode.engine"]) == ("p0", "d0")
    assert a["pushkv.prefill.cached_tokens"] == 16
    assert a["pushkv.finish_reason"] == "length" and a["pushkv.outcome"] == "ok"
    assert list(kids) == ["queue", "prefill", "kv_transfer", "decode"]  # in the order they begin
    assert all(k.parent == "llm_request" for k in kids.values())
    # the transfer starts with the stream, the first of P's stream start, its send and D's READ posting
    assert (kids["kv_transfer"].start, kids["kv_transfer"].end) == (WALL + 0.004, WALL + 0.014)
    assert (kids["decode"].start, kids["decode"].end) == (WALL + 0.014, WALL + 0.050)


def test_the_kv_attributes_are_the_posting_legs_and_no_leg_times_pull_writes_write():
    """A push request whose D allocated after P (path "late") took D's stats, which time nothing (0 s): P posted
    the WRITE. A pull deployment with --pull-read write has P post it after its leg ended, and D's 0 s was reported
    as its time; the attribute is left out there, never guessed."""
    late = _push_ledger()
    late.path, late.late = "late", True
    a = S.request_spans(late, _facts(), end_monotonic=100.060)[0].attributes
    assert (a["pushkv.kv.transfer_seconds"], a["pushkv.kv.rendezvous"]) == (0.004, "registration_first")
    pull = _push_ledger()
    pull.path, pull.kv = "pull", {"decode": m.KVTransferStats(57344, 1, 0.0, "pull")}
    a = S.request_spans(pull, _facts(pull_read="write"), end_monotonic=100.060)[0].attributes
    assert (a["pushkv.kv.bytes"], a["pushkv.kv.descriptors"]) == (57344, 1) and "pushkv.kv.transfer_seconds" not in a
    pull.kv = {"decode": m.KVTransferStats(57344, 1, 0.003, "pull")}
    a = S.request_spans(pull, _facts(pull_read="inline"), end_monotonic=100.060)[0].attributes
    assert a["pushkv.kv.transfer_seconds"] == 0.003  # D's READ


def test_a_local_request_has_no_transfer_and_its_decode_starts_at_its_first_token():
    led = Ledger(arrival=5.0, prompt_tokens=3, path="local")
    led.timeline = {"router.arrival": WALL, "local.local_queued": WALL + 0.001, "local.prefill_start": WALL + 0.002,
                    "local.prefill_end": WALL + 0.004, "local.first_token": WALL + 0.005,
                    "local.finished": WALL + 0.009}
    led.add_tokens(5.006, 2)
    led.finish, led.finish_reason, led.outcome = 5.010, "stop", "ok"
    spans = S.request_spans(led, _facts(), end_monotonic=5.02)
    assert [s.name for s in spans] == ["llm_request", "queue", "prefill", "decode"]
    assert spans[-1].start == WALL + 0.005 and "pushkv.kv.bytes" not in spans[0].attributes


def test_a_failed_request_ends_when_let_go_in_error_and_names_no_phase_it_never_reached():
    led = Ledger(arrival=100.0, prompt_tokens=40, path="push")
    led.timeline = {"router.arrival": WALL, "prefill.prefill_queued": WALL + 0.001,
                    "prefill.prefill_start": WALL + 0.003}  # P died in its prefill
    led.outcome = "failed"
    spans = S.request_spans(led, _facts(), end_monotonic=100.5)
    root = spans[0]
    assert root.error == "request failed" and root.end == near(WALL + 0.5)
    assert [s.name for s in spans[1:]] == ["queue"]  # no prefill end: no prefill span, no transfer, no decode
    for key in ("gen_ai.latency.e2e", "gen_ai.latency.time_to_first_token", "gen_ai.latency.time_in_model_prefill"):
        assert key not in root.attributes
    assert root.attributes["pushkv.outcome"] == "failed"


def test_the_flag_is_refused_by_name_for_an_unknown_protocol_a_bad_endpoint_or_no_sdk(monkeypatch):
    otlp.check("", {})  # off: nothing to check
    otlp.check("http://collector:4317", {})  # grpc, the default
    otlp.check("collector:4317", {})
    otlp.check("http://collector:4318/v1/traces", {otlp.PROTOCOL_ENV: "http/protobuf"})
    with pytest.raises(ValueError, match="--otlp-traces-endpoint.*http/json"):
        otlp.check("http://collector:4318", {otlp.PROTOCOL_ENV: "http/json"})
    for bad in ("collector", "http://a b:4317"):
        with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
            otlp.check(bad, {})
    real = builtins.__import__

    def no_sdk(name, *a, **kw):
        if name.startswith("opentelemetry"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_sdk)
    with pytest.raises(ValueError, match=r"--otlp-traces-endpoint: .* needs opentelemetry.*pip install 'pushkv\[otlp\]'"):
        otlp.check("http://collector:4317", {})
