"""``--otlp-traces-endpoint``, as vLLM's, end to end: a deployment exports each finished request's spans to an
OpenTelemetry collector of the test's own, over gRPC (the default protocol) and over HTTP (``http/protobuf``), decoded
with the OTLP protocol's own messages (``opentelemetry-proto``).

The request's span is vLLM's ``llm_request`` (kind SERVER) in the caller's trace, its parent the span the request's
``traceparent`` header named; its attributes are the usage the client was answered; pushkv's phases are its
children. A collector that is not there costs the requests nothing, and the router still stops at once."""
from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.request
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from tools.launch import free_tcp_port, launched  # noqa: E402

pytestmark = pytest.mark.timeout(300)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Collector:
    """The spans a collector received, by request id (gen_ai.request.id) of their trace's llm_request."""

    def __init__(self) -> None:
        self.spans: list = []  # (resource attributes, span)
        self.changed = threading.Condition()

    def take(self, req: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.changed:
            for rs in req.resource_spans:
                res = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((res, s) for s in ss.spans)
            self.changed.notify_all()

    def trace_of(self, request_id: str, kids: int, timeout_s: float = 60.0) -> tuple[dict, object, list]:
        """(resource, the request's span, its children) once the request's span and ``kids`` children are in."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while True:
                roots = [(r, s) for r, s in self.spans if s.name == "llm_request"
                         and _attrs(s).get("gen_ai.request.id") == request_id]
                if roots:
                    res, root = roots[0]
                    children = [s for _, s in self.spans if s.parent_span_id == root.span_id]
                    if len(children) >= kids:
                        return res, root, children
                left = deadline - time.monotonic()
                assert left > 0, f"no trace of {request_id} with {kids} children in {timeout_s} s: {self.spans}"
                self.changed.wait(left)


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


class _Grpc(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Collector) -> None:
        self.sink = sink

    def Export(self, request, context):  # noqa: N802 (the protocol's name)
        self.sink.take(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def grpc_collector():
    sink = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Grpc(sink), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield sink, port
    finally:
        server.stop(0).wait(10)


@pytest.fixture
def http_collector():
    sink = Collector()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            ok = self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
            if ok:
                sink.take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString() if ok else b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield sink, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        t.join(10)


def _complete(url: str, headers: dict, max_tokens: int = 6) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {"model": "small", "prompt": list(range(1, 41)), "max_tokens": max_tokens, "temperature": 0}).encode(),
        headers={"content-type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _fast_export(monkeypatch, protocol: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: spans leave within a blink, not the 5 s default


def test_push_requests_are_exported_over_grpc_in_the_callers_trace(tmp_path, monkeypatch, grpc_collector):
    sink, port = grpc_collector
    _fast_export(monkeypatch, "grpc")
    with launched("--mode", "push", "--num-blocks", "256", "--served-model-name", "small",
                  "--otlp-traces-endpoint", f"http://127.0.0.1:{port}", log_path=str(tmp_path / "up.log")) as d:
        out = _complete(d.url, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": "vendor=1"})
        rid = out["id"].removeprefix("cmpl-")
        res, root, kids = sink.trace_of(rid, kids=4)
        assert res["service.name"] == "small"
        assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == PARENT_ID  # the caller's trace
        assert root.kind == 2  # SPAN_KIND_SERVER, as vLLM's
        a = _attrs(root)
        assert a["gen_ai.usage.prompt_tokens"] == out["usage"]["prompt_tokens"] == 40
        assert a["gen_ai.usage.completion_tokens"] == out["usage"]["completion_tokens"] == 6
        assert a["gen_ai.response.model"] == "small" and a["gen_ai.request.max_tokens"] == 6
        assert a["pushkv.path"] == "push" and a["pushkv.outcome"] == "ok" and a["pushkv.kv.bytes"] > 0
        assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
        assert {k.name for k in kids} == {"queue", "prefill", "kv_transfer", "decode"}
        for k in kids:  # children of the request, in its trace, within its time
            assert k.trace_id == root.trace_id and k.kind == 1  # SPAN_KIND_INTERNAL
            assert root.start_time_unix_nano - 1_000_000 <= k.start_time_unix_nano <= k.end_time_unix_nano
            assert k.end_time_unix_nano <= root.end_time_unix_nano + 1_000_000
        # a request without a traceparent starts a trace of its own
        out2 = _complete(d.url, {})
        _, root2, _ = sink.trace_of(out2["id"].removeprefix("cmpl-"), kids=4)
        assert root2.trace_id.hex() != TRACE_ID and not root2.parent_span_id
        d.wait_pools_free()


def test_local_requests_are_exported_over_http(tmp_path, monkeypatch, http_collector):
    sink, port = http_collector
    _fast_export(monkeypatch, "http/protobuf")
    with launched("--mode", "local", "--num-blocks", "128", "--otlp-traces-endpoint",
                  f"http://127.0.0.1:{port}/v1/traces", log_path=str(tmp_path / "up.log")) as d:
        out = _complete(d.url, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}, max_tokens=3)
        _, root, kids = sink.trace_of(out["id"].removeprefix("cmpl-"), kids=3)
        assert root.trace_id.hex() == TRACE_ID and _attrs(root)["pushkv.path"] == "local"
        assert {k.name for k in kids} == {"queue", "prefill", "decode"}  # nothing moved, so no kv_transfer
        d.wait_pools_free()


def test_a_collector_that_is_not_there_costs_the_requests_nothing(tmp_path, monkeypatch):
    _fast_export(monkeypatch, "grpc")
    with launched("--mode", "local", "--num-blocks", "128", "--otlp-traces-endpoint",
                  f"http://127.0.0.1:{free_tcp_port()}", log_path=str(tmp_path / "up.log")) as d:
        for _ in range(3):
            assert _complete(d.url, {}, max_tokens=2)["usage"]["completion_tokens"] == 2
        d.wait_pools_free()
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 30  # the stop waited for the last spans a bounded while, not for the collector
