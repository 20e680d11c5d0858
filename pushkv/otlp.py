"""The router's OpenTelemetry export (``--otlp-traces-endpoint``, as vLLM's): each finished request's spans
(router/otlp_spans.py) through the OpenTelemetry SDK to an OTLP collector, batched on the SDK's own thread so the
event loop never waits on the collector.

As vLLM's, the protocol is ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``: ``grpc`` (the default; a collector's port 4317)
or ``http/protobuf`` (port 4318, the endpoint's path ``/v1/traces``); the SDK reads its other ``OTEL_*`` variables
itself (``OTEL_EXPORTER_OTLP_TRACES_INSECURE``, ``..._HEADERS``, ``OTEL_BSP_SCHEDULE_DELAY``, ...). The packages are
the ``otlp`` extra (``pip install 'pushkv[otlp]'``); without them the flag is refused before anything starts
(:func:`check`).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Mapping, Optional

from pushkv.extras import missing

if TYPE_CHECKING:
    from pushkv.router.otlp_spans import Span

log = logging.getLogger("pushkv.otlp")

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS = ("grpc", "http/protobuf")
# the W3C trace-context headers a caller's span travels in
TRACE_HEADERS = ("traceparent", "tracestate")
# how long the router's stop waits for the last spans to leave
CLOSE_S = 5.0


def protocol(env: Mapping[str, str]) -> str:
    p = env.get(PROTOCOL_ENV, "grpc")
    if p not in PROTOCOLS:
        raise ValueError(f"--otlp-traces-endpoint: {PROTOCOL_ENV}={p!r} is no protocol pushkv exports with; "
                         f"one of {', '.join(PROTOCOLS)} (http/json is not built)")
    return p


def check(endpoint: str, env: Mapping[str, str]) -> None:
    """Refuse, naming the flag, an endpoint the router could not export to: the packages missing, an unknown
    protocol, an endpoint that is no URL or host:port."""
    if not endpoint:
        return
    p = protocol(env)
    if any(ch.isspace() for ch in endpoint) or ("://" not in endpoint and ":" not in endpoint):
        raise ValueError(f"--otlp-traces-endpoint {endpoint!r}: a collector's URL (http://HOST:4318/v1/traces for "
                         "http/protobuf, http://HOST:4317 or HOST:4317 for grpc)")
    module = ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter" if p == "grpc"
              else "opentelemetry.exporter.otlp.proto.http.trace_exporter")
    try:
        __import__("opentelemetry.sdk.trace")
        __import__(module)
    except ImportError:
        raise ValueError(f"--otlp-traces-endpoint: {missing('opentelemetry', f'the OTLP {p} export')}") from None


class Exporter:
    """Spans out to the collector at ``endpoint``, under the resource ``service.name`` given."""

    def __init__(self, endpoint: str, service_name: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if protocol(os.environ) == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("pushkv.router")
        self.propagator = TraceContextTextMapPropagator()
        self.exported = 0
        log.info("OTLP traces to %s (%s)", endpoint, protocol(os.environ))

    def emit(self, spans: list[Span], headers: Mapping[str, str]) -> None:
        """One request's spans: the first is the request's own, its parent the caller's span where ``headers``
        carry one, and the rest its children."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        carrier = {h: headers[h] for h in TRACE_HEADERS if h in headers}
        made: dict[str, trace.Span] = {}
        for s in spans:
            parent: Optional[trace.Span] = made.get(s.parent) if s.parent else None
            ctx = trace.set_span_in_context(parent) if parent is not None else self.propagator.extract(carrier)
            span = self.tracer.start_span(s.name, context=ctx, kind=SpanKind.SERVER if parent is None else
                                          SpanKind.INTERNAL, attributes=s.attributes, start_time=_ns(s.start))
            if s.error:
                span.set_status(Status(StatusCode.ERROR, s.error))
            made.setdefault(s.name, span)
            span.end(end_time=_ns(s.end))
        self.exported += 1

    def close(self, within_s: float = CLOSE_S) -> None:
        """Export what is batched, then stop the SDK's thread: waited for ``within_s`` at most, so a collector that
        is gone (whose exporter retries for its timeout) never holds the router's stop."""
        done = threading.Thread(target=self.provider.shutdown, name="otlp-shutdown", daemon=True)
        done.start()
        done.join(within_s)
        if done.is_alive():
            log.warning("OTLP: the collector did not take the last spans within %.0f s; left", within_s)


def _ns(wall_s: float) -> int:
    return int(wall_s * 1e9)
