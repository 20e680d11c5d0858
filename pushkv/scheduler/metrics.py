"""One instance's Prometheus metrics, under the names vLLM's model server exposes.

llm-d's endpoint picker, the Gateway API Inference Extension, vLLM's Grafana dashboards and
autoscalers read ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` and the latency histograms from each model server's ``/metrics``,
labelled with ``model_name`` and, as vLLM's, ``engine`` ("0": an instance is one engine). Each P and D
instance's scheduler serves them (its shell starts
the HTTP server); pushkv's own per-instance counters (the KV moved, refusals, prefix cache)
sit beside them under ``pushkv_instance_*``.

What the core observes is on this instance's clock, from the request's arrival here:
P's first token is its prefill's; D's is the first it sends (P's token, once the KV is in).

No I/O here: the core calls ``first_token``, ``token`` and ``finished``; the shell calls
``publish`` after each entry point, so the scrape (on the HTTP server's thread) reads a
snapshot and never iterates the core's live structures.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Literal, Mapping, NamedTuple, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# buckets over the range vLLM's dashboards plot (ms TPOTs on GPU to minute-long TTFTs on CPU)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0)
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                     240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM 0.32's (vllm/v1/metrics/buckets.py: REQUEST_NUM_PREEMPTIONS_BUCKETS): 1 holds the never and the once preempted
NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# vLLM's FinishReason, each series there from the start. pushkv counts "stop" and "length" (every way a leg ends
# complete), and "error" (a request this instance failed after admitting it, as vLLM's engine ends a KV load failure
# or a grammar's failure): vLLM's frontend drops a client's abort without counting it (the "abort" series stays at 0
# there: vllm-project/vllm#31503), and the router's aborts are counted nowhere here either
EndReason = Literal["stop", "length", "abort", "error", "repetition"]
FINISH_REASONS: tuple[EndReason, ...] = ("stop", "length", "abort", "error", "repetition")
# vllm:prompt_tokens_by_source's sources, as vLLM 0.32's PromptTokenStats names them: computed here, found in the
# prefix cache here, moved here by a KV transfer
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# vLLM's engine label: the index of its data-parallel engine. A pushkv instance is one engine with its own /metrics,
# as one `vllm serve` without data parallelism, whose only engine is 0
ENGINE = "0"
MAX_HELD_ENDS = 65536  # ends waiting for the router's word (Generate.stop_strings); past it the oldest is observed


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's request-token buckets: 1, 2, 5, 10, 20, 50, ... up to the model's length."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Finish(NamedTuple):
    """One request's end here, as the histograms take it (seconds on this instance's clock)."""

    reason: EndReason
    prompt_len: int
    generated: int
    max_tokens: int
    e2e_s: float  # arrival here -> the end
    prefill_s: float  # blocks allocated -> this instance's first token (D: the KV's wait with it)
    decode_s: float  # first token -> the end
    preemptions: int = 0  # times its blocks were taken back here (Request.preemptions)

# the core's counters exposed as pushkv_instance_<name>_total (the rest stay in the router's GetStats view)
OWN_COUNTERS = {
    "requests": "requests admitted to the queue",
    "rejected": "requests refused at arrival",
    "requests_failed": "requests failed after arrival",
    "aborted": "requests aborted by the router",
    "kv_transfers": "P: KV transfers completed",
    "kv_waits": "D: KV arrivals completed",
    "kv_bytes": "KV bytes of completed transfers, as this instance's writers count them: where they post (P's "
                "WRITEs, D's READs) and D's arrivals by push (P's count is 0 where D READs)",
    "kv_descs": "NIXL descriptors posted for those bytes",
    "kv_transfer_us": "microseconds of transfer, posted to done, summed over requests",
    "step_timeout": "forward steps past --step timeout",
}


class Snapshot:
    """The gauges' values and the core's counters at the end of the last entry point."""

    def __init__(self, waiting: int = 0, running: int = 0, usage: float = 0.0, num_blocks: int = 0,
                 counters: Mapping[str, int] | None = None, lora: Optional["LoraSnapshot"] = None):
        self.waiting, self.running, self.usage, self.num_blocks = waiting, running, usage, num_blocks
        self.counters = dict(counters or {})
        self.lora = lora  # with --enable-lora


class LoraSnapshot(NamedTuple):
    """vLLM's ``vllm:lora_requests_info``: the adapters of the requests running and waiting (comma-separated, as
    vLLM's and the Gateway API Inference Extension's LoRA affinity read them), --max-loras, and when."""

    max_lora: int
    running: str
    waiting: str
    wall: float


class InstanceMetrics(Collector):
    def __init__(self, model_name: str, engine_id: str, role: str, max_model_len: int = 100_000):
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "engine": ENGINE}
        self.engine_id, self.role = engine_id, role
        self.snap = Snapshot()
        r, names, one = self.registry, ["model_name", "engine"], (model_name, ENGINE)

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*one)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Arrival here to this instance's first token",
                         TTFT_BUCKETS_S)
        self.tpot = hist("vllm:time_per_output_token_seconds", "Between consecutive output tokens",
                         TPOT_BUCKETS_S)
        self.itl = hist("vllm:inter_token_latency_seconds", "Between consecutive output tokens", TPOT_BUCKETS_S)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival here to the request's end here",
                        REQUEST_BUCKETS_S)
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival here to blocks allocated",
                          REQUEST_BUCKETS_S)
        tokens = token_buckets(max_model_len)
        self.prompt_hist = hist("vllm:request_prompt_tokens", "Prompt tokens of finished requests", tokens)
        self.gen_hist = hist("vllm:request_generation_tokens", "Tokens this instance produced per finished request",
                             tokens)
        self.request_tpot = hist("vllm:request_time_per_output_token_seconds",
                                 "Per request: its output tokens' mean interval here (first to last)", TPOT_BUCKETS_S)
        self.inference = hist("vllm:request_inference_time_seconds", "Blocks allocated to the request's end here",
                              REQUEST_BUCKETS_S)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Blocks allocated to this instance's first token (D: the KV's wait with it)",
                            REQUEST_BUCKETS_S)
        self.decode = hist("vllm:request_decode_time_seconds", "This instance's first token to the request's end",
                           REQUEST_BUCKETS_S)
        self.max_gen = hist("vllm:request_max_num_generation_tokens", "Tokens generated per finished request (vLLM: "
                            "the most of a request's n choices; each choice is a request here)", tokens)
        self.params_max_tokens = hist("vllm:request_params_max_tokens", "max_tokens of finished requests", tokens)
        self.params_n = hist("vllm:request_params_n", "n of finished requests (pushkv runs each choice as its own)",
                             PARAMS_N_BUCKETS)
        self.iteration = hist("vllm:iteration_tokens_total", "Tokens per forward step", ITERATION_TOKENS_BUCKETS)
        self.num_preemptions = hist("vllm:request_num_preemptions",
                                    "Histogram of the number of times a request was preempted.",
                                    NUM_PREEMPTIONS_BUCKETS)
        self.prompt_cached = Counter("vllm:prompt_tokens_cached", "Prompt tokens not computed here (the prefix "
                                     "cache's, and on D the KV transfer's) of requests that reached their first "
                                     "token here", names, registry=r).labels(*one)
        by_source = Counter("vllm:prompt_tokens_by_source", "Prompt tokens by source", names + ["source"],
                            registry=r)
        self.prompt_by_source = {s: by_source.labels(*one, s) for s in PROMPT_SOURCES}
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests that reached their first "
                                     "token here", names, registry=r).labels(*one)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens this instance produced", names,
                                         registry=r).labels(*one)
        self.success = Counter("vllm:request_success", "Requests finished here", names + ["finished_reason"],
                               registry=r)
        for reason in FINISH_REASONS:  # each at 0 from the start, as vLLM's (a rate over it is defined at once)
            self.success.labels(*one, reason)
        # request -> its end, until when it waits for the router's word (``hold``), and the router connection whose
        # word it waits for; oldest first
        self.held: OrderedDict[Hashable, tuple[Finish, float, bytes]] = OrderedDict()
        r.register(self)

    # -- from the core (pure: values in, observations out) ------------------------------
    def queued(self, waited_s: float) -> None:
        self.queue.observe(waited_s)

    def first_token(self, prompt_len: int, ttft_s: float, cached: int = 0, transferred: int = 0) -> None:
        """``cached``: the prompt's tokens found in the prefix cache here; ``transferred``: those whose KV came by
        transfer (D's legs: all the rest). vLLM counts both as cached, and each by its source."""
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(prompt_len)
        self.prompt_cached.inc(cached + transferred)
        for source, n in zip(PROMPT_SOURCES, (prompt_len - cached - transferred, cached, transferred)):
            self.prompt_by_source[source].inc(n)
        self.generation_tokens.inc()

    def step(self, tokens: int) -> None:
        """A forward step launched with this many tokens."""
        self.iteration.observe(tokens)

    def token(self, since_last_s: float) -> None:
        """A token after the first."""
        self.tpot.observe(since_last_s)
        self.itl.observe(since_last_s)
        self.generation_tokens.inc()

    def finished(self, f: Finish) -> None:
        self.success.labels(self.labels["model_name"], ENGINE, f.reason).inc()
        self.prompt_hist.observe(f.prompt_len)
        self.gen_hist.observe(f.generated)
        self.e2e.observe(f.e2e_s)
        self.inference.observe(f.prefill_s + f.decode_s)
        self.prefill.observe(f.prefill_s)
        self.decode.observe(f.decode_s)
        # one a request, 0 for a request of one token (P's legs), as vLLM's (its mean_time_per_output_token)
        self.request_tpot.observe(f.decode_s / (f.generated - 1) if f.generated > 1 else 0.0)
        # the tokens it generated, not its max_tokens: vLLM's is the most any of a request's n choices generated,
        # and each choice is a request of its own here
        self.max_gen.observe(f.generated)
        self.params_max_tokens.observe(f.max_tokens)
        self.params_n.observe(1)
        self.num_preemptions.observe(f.preemptions)

    # -- ends the router has the last word on (the core's loop only) ------------------------
    def hold(self, key: Hashable, f: Finish, until: float, router: bytes = b"") -> None:
        """A token leg ended by length while the router searches its text for stop strings: vLLM's frontend counts
        a stop string matched on the last token as stop, so ``f`` is observed when the router (the connection
        ``router`` sent the request) says how the client's choice ended (``choice_ended``), or as it is once ``until``
        has passed, or that router is gone (``expire``: the word never came)."""
        self.held[key] = (f, until, router)
        while len(self.held) > MAX_HELD_ENDS:
            self.finished(self.held.popitem(last=False)[1][0])

    def choice_ended(self, key: Hashable, finish: str) -> bool:
        """The router's word on a held end: "stop" counts it stop. False: none is held for ``key``."""
        held = self.held.pop(key, None)
        if held is None:
            return False
        self.finished(held[0]._replace(reason="stop") if finish == "stop" else held[0])
        return True

    def held_routers(self) -> set[bytes]:
        """The router connections whose word a held end waits for."""
        return {router for _, _, router in self.held.values()}

    def expire(self, now: float, gone: Optional[Callable[[bytes], bool]] = None) -> None:
        """Observe, as they are, the held ends whose wait has passed, and with ``gone`` every one whose router
        connection it says is gone (a router restarted at its place: it will never answer; a router elsewhere
        still will)."""
        if gone is not None:
            for key in [k for k, (_, _, router) in self.held.items() if gone(router)]:
                self.finished(self.held.pop(key)[0])
        while self.held:
            key, (f, until, _) = next(iter(self.held.items()))
            if until > now:
                return  # (held in order of their deadlines: each waits as long)
            del self.held[key]
            self.finished(f)

    def publish(self, snap: Snapshot) -> None:
        self.snap = snap  # one reference swap: the scrape's thread sees the old one or this one

    # -- the scrape -------------------------------------------------------------------------
    def describe(self) -> list:
        return []  # no fixed description: collect() is cheap and read at scrape time only

    def collect(self):
        s, name = self.snap, self.labels["model_name"]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name", "engine"])
            g.add_metric([name, ENGINE], value)
            return g

        yield gauge("vllm:num_requests_waiting", "Requests queued for KV blocks (D: and waiting for the KV)",
                    s.waiting)
        yield gauge("vllm:num_requests_running", "Requests prefilling or decoding", s.running)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full)", s.usage)
        info = GaugeMetricFamily("pushkv_instance_info", "This instance", labels=["model_name", "engine_id", "role"])
        info.add_metric([name, self.engine_id, self.role], 1)
        yield info
        yield gauge("pushkv_instance_kv_blocks", "KV blocks in this instance's pool", s.num_blocks)
        if s.lora is not None:
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            lora.add_metric([str(s.lora.max_lora), s.lora.running, s.lora.waiting], s.lora.wall)
            yield lora
        for key, doc in OWN_COUNTERS.items():
            c = CounterMetricFamily(f"pushkv_instance_{key}", doc, labels=["model_name", "engine"])
            c.add_metric([name, ENGINE], s.counters.get(key, 0))
            yield c
        preempted = CounterMetricFamily("vllm:num_preemptions", "Requests preempted: their blocks taken back when a "
                                        "running request needed one, to compute their tokens again later",
                                        labels=["model_name", "engine"])
        preempted.add_metric([name, ENGINE], s.counters.get("preemptions", 0))
        yield preempted
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   labels=["model_name", "engine"])
        hits.add_metric([name, ENGINE], s.counters.get("prefix_hit_tokens", 0))
        yield hits
        queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels=["model_name", "engine"])
        queries.add_metric([name, ENGINE], s.counters.get("prefix_query_tokens", 0))
        yield queries
