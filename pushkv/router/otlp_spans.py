"""One finished request as OpenTelemetry spans (pure): what ``--otlp-traces-endpoint`` exports (router/otlp.py).

As vLLM's ``--otlp-traces-endpoint``, a request is one ``llm_request`` span of kind SERVER, from its arrival at the
router to its end, carrying vLLM's attribute names (the ``gen_ai.*`` of ``vllm.tracing.SpanAttributes``), so a
dashboard built on vLLM's traces reads pushkv's. Its parent is the caller's span where the HTTP request carried a
W3C ``traceparent`` header. pushkv adds what a P/D deployment is about, as ``pushkv.*`` attributes (the path, the
instances, the KV transfer as the side that posted it measured it) and as child spans, one a phase whose both ends
the legs reported (``ledger.timeline``, wall seconds):

- ``queue``: the computing leg's queue, until its prefill starts;
- ``prefill``: the prompt's prefill on P (or on the one instance that computed it);
- ``kv_transfer``: from the first of P's stream start, P's send of its KV or D's READ posting, to D having the KV;
- ``decode``: D's leg from the KV (or the first token, where D computed the prompt) to its last token.

A phase a request never reached (a failed prefill, a local deployment's transfer) is left out, never guessed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from pushkv import messages as m
from pushkv.router.ledger import Ledger, posted_kv

Value = Union[str, int, float, bool]

# vLLM's span and attribute names (vllm/tracing.py), so its dashboards read these
SPAN_NAME = "llm_request"
RESPONSE_MODEL = "gen_ai.response.model"
REQUEST_ID = "gen_ai.request.id"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_N = "gen_ai.request.n"
USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
LATENCY_TTFT = "gen_ai.latency.time_to_first_token"
LATENCY_E2E = "gen_ai.latency.e2e"
LATENCY_PREFILL = "gen_ai.latency.time_in_model_prefill"
LATENCY_DECODE = "gen_ai.latency.time_in_model_decode"
LATENCY_INFERENCE = "gen_ai.latency.time_in_model_inference"


@dataclass(frozen=True)
class Facts:
    """What the router knew of the request besides its ledger."""

    request_id: str  # the transfer id: the one pushkv's logs, `pushkv tap` and /v1/abort name
    model: str  # the served model name the request gave
    sampling: m.SamplingParams
    max_tokens: int
    n: int  # the choices of the HTTP request this one is a choice of
    pull_read: str = ""  # the deployment's --pull-read (pull-write's WRITE is timed by no leg's report)


@dataclass(frozen=True)
class Span:
    """A span to export: wall seconds; ``parent`` None for the request's own span (its parent is the caller's)."""

    name: str
    start: float
    end: float
    attributes: dict[str, Value] = field(default_factory=dict)
    parent: Optional[str] = None  # the name of the span this one is a child of
    error: str = ""  # a span that ended badly: why (the status's description)


def _leg_computing(ledger: Ledger) -> str:
    """The leg that computed the prompt: P, or the one instance of a local or decode-local request."""
    if ledger.path == "local":
        return "local"
    if ledger.path == "decode-local":
        return "decode"
    return "prefill"


def _first(timeline: dict[str, float], *stages: str) -> Optional[float]:
    times = [timeline[s] for s in stages if s in timeline]
    return min(times) if times else None


def phases(ledger: Ledger) -> list[tuple[str, float, float]]:
    """(name, start, end) of each phase whose both ends are in the ledger's timeline, in the order they begin."""
    t = ledger.timeline
    leg = _leg_computing(ledger)
    out: list[tuple[str, Optional[float], Optional[float]]] = [
        ("queue", t.get(f"{leg}.{leg}_queued"), t.get(f"{leg}.prefill_start")),
        ("prefill", t.get(f"{leg}.prefill_start"), t.get(f"{leg}.prefill_end")),
    ]
    if leg == "prefill":
        out.append(("kv_transfer", _first(t, "prefill.stream_start", "prefill.send_kv", "decode.read_posted"),
                    t.get("decode.kv_received")))
        out.append(("decode", t.get("decode.kv_received"), t.get("decode.finished")))
    else:
        out.append(("decode", t.get(f"{leg}.first_token"), t.get(f"{leg}.finished")))
    return sorted(((n, s, e) for n, s, e in out if s is not None and e is not None and e >= s), key=lambda p: p[1])


def request_spans(ledger: Ledger, facts: Facts, end_monotonic: float) -> list[Span]:
    """The request's span and its phases' children. ``end_monotonic``: when the router let the request go (its end
    where it never finished)."""
    wall = ledger.timeline.get("router.arrival", ledger.arrival)
    offset = wall - ledger.arrival  # wall seconds less the router's monotonic clock
    end = (ledger.finish if ledger.outcome == "ok" and ledger.finish is not None else end_monotonic) + offset
    s = facts.sampling
    attrs: dict[str, Value] = {
        RESPONSE_MODEL: facts.model, REQUEST_ID: facts.request_id, REQUEST_TEMPERATURE: s.temperature,
        REQUEST_TOP_P: s.top_p, REQUEST_MAX_TOKENS: facts.max_tokens, REQUEST_N: facts.n,
        USAGE_PROMPT_TOKENS: ledger.prompt_tokens, USAGE_COMPLETION_TOKENS: ledger.completion_tokens,
        USAGE_NUM_SEQUENCES: 1,
        "pushkv.path": ledger.path, "pushkv.outcome": ledger.outcome or "ok",
    }
    if ledger.finish_reason:
        attrs["pushkv.finish_reason"] = ledger.finish_reason
    for role, engine in sorted(ledger.engines.items()):
        attrs[f"pushkv.{role}.engine"] = engine
    for leg, n in sorted(ledger.cached.items()):
        attrs[f"pushkv.{leg}.cached_tokens"] = n
    if ledger.first_token is not None:
        attrs[LATENCY_TTFT] = ledger.first_token - ledger.arrival
    if ledger.outcome == "ok" and ledger.finish is not None:
        attrs[LATENCY_E2E] = ledger.finish - ledger.arrival
    kv, timed = posted_kv(ledger.kv, ledger.path, facts.pull_read)
    if kv is not None:
        attrs.update({"pushkv.kv.bytes": kv.nbytes, "pushkv.kv.descriptors": kv.num_descs})
        if timed:
            attrs["pushkv.kv.transfer_seconds"] = kv.transfer_s
        if kv.rendezvous:
            attrs["pushkv.kv.rendezvous"] = kv.rendezvous
    found = phases(ledger)
    lengths = {name: e - st for name, st, e in found}
    for name, key in (("queue", LATENCY_TIME_IN_QUEUE), ("prefill", LATENCY_PREFILL), ("decode", LATENCY_DECODE)):
        if name in lengths:
            attrs[key] = lengths[name]
    if "prefill" in lengths and "decode" in lengths:
        attrs[LATENCY_INFERENCE] = lengths["prefill"] + lengths["decode"]
    error = "" if ledger.outcome in ("", "ok") else f"request {ledger.outcome}"
    root = Span(SPAN_NAME, wall, max(wall, end), attrs, error=error)
    return [root] + [Span(name, st, e, parent=SPAN_NAME) for name, st, e in found]
