"""Prometheus collectors of the router, on a registry of their own.

Add a collector as an attribute in ``RouterMetrics.__init__`` with
``registry=self.registry``; ``/metrics`` exposes everything on it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

# Seconds; spans sub-ms ITLs on GPU to minute-long TTFTs of 16k prompts on CPU.
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class RequestRecord:
    """Monotonic times of one request, filled in as it runs."""

    arrival: float
    prompt_tokens: int = 0
    first_token: Optional[float] = None
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (time, n tokens)
    finish: Optional[float] = None
    outcome: str = ""  # "ok" | "failed" | "aborted" | "timeout" | "rejected" | "shutdown"

    @property
    def completion_tokens(self) -> int:
        return sum(n for _, n in self.token_times)

    def add_tokens(self, t: float, n: int) -> None:
        if n <= 0:
            return
        if self.first_token is None:
            self.first_token = t
        self.token_times.append((t, n))


class RouterMetrics:
    def __init__(self, mode: str = ""):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pushkv_router_requests", "Requests finished, by outcome", ["outcome"], registry=r)
        self.in_flight = Gauge(
            "pushkv_router_requests_in_flight", "Requests being served", registry=r)
        self.ttft = Histogram(
            "pushkv_router_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram(
            "pushkv_router_tpot_seconds", "Time per output token after the first",
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram(
            "pushkv_router_itl_seconds", "Inter-token latency", buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram(
            "pushkv_router_e2e_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Histogram(
            "pushkv_router_prompt_tokens", "Prompt length", buckets=TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Counter(
            "pushkv_router_generation_tokens", "Tokens streamed to clients", registry=r)
        self.stage = Histogram(
            "pushkv_router_stage_seconds", "Request stage offset from router arrival",
            ["stage"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.sched_messages = Counter(
            "pushkv_router_scheduler_messages", "Messages from schedulers", ["role", "kind"], registry=r)
        self.unrouted = Counter(
            "pushkv_router_unrouted_messages",
            "Scheduler messages for no in-flight request (late, after abort)", ["role"], registry=r)
        self.aborts_sent = Counter(
            "pushkv_router_aborts_sent", "Abort messages sent to schedulers", ["role"], registry=r)
        self.info = Gauge("pushkv_router_info", "Router deployment", ["mode"], registry=r)
        self.info.labels(mode=mode).set(1)

    def observe(self, rec: RequestRecord, timeline: Optional[dict[str, float]] = None) -> None:
        self.requests.labels(outcome=rec.outcome or "ok").inc()
        if rec.prompt_tokens:
            self.prompt_tokens.observe(rec.prompt_tokens)
        n = rec.completion_tokens
        self.generation_tokens.inc(n)
        if rec.first_token is not None:
            self.ttft.observe(rec.first_token - rec.arrival)
            prev = rec.first_token
            for t, k in rec.token_times[1:]:
                gap = (t - prev) / k  # a message with k tokens: k equal gaps
                for _ in range(k):
                    self.itl.observe(gap)
                prev = t
        if rec.outcome == "ok" and rec.finish is not None:
            self.e2e.observe(rec.finish - rec.arrival)
            if rec.first_token is not None and n > 1:
                self.tpot.observe((rec.finish - rec.first_token) / (n - 1))
        if timeline and "router.arrival" in timeline:
            t0 = timeline["router.arrival"]
            for stage, t in timeline.items():
                if stage != "router.arrival":
                    self.stage.labels(stage=stage).observe(max(0.0, t - t0))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
