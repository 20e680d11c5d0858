"""Prometheus collectors of the router, on a registry of their own.

Add a collector as an attribute in ``RouterMetrics.__init__`` with
``registry=self.registry``; ``/metrics`` exposes everything on it.

Per-request values (latencies, each transfer's bytes, descriptors, time and
rendezvous order) are observed here when a request ends. What only the
instances know (block usage, their own and their writers' counters: lease
expiries, aborts, bytes moved) is asked from each scheduler (``GetStats``)
at scrape time and exposed by ``InstanceCollector`` under ``pushkv_instance_*``.
"""
from __future__ import annotations

from typing import Iterable, Literal, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pushkv import messages as m
from pushkv.config import Mode, Role
from pushkv.router import policy as P
from pushkv.router.ledger import Ledger, posted_kv

# Seconds; spans sub-ms ITLs on GPU to minute-long TTFTs of 16k prompts on CPU.
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
TRANSFER_BUCKETS_S = (0.0001, 0.00025, 0.0005) + LATENCY_BUCKETS_S
BYTES_BUCKETS = tuple(float(4096 * 4**i) for i in range(13))  # 4 KiB .. 64 GiB
DESC_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
BLOCK_S_BUCKETS = (0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0, 25000.0)
RENDEZVOUS_ORDERS = ("registration_first", "prefill_first")


class RouterMetrics:
    def __init__(self, mode: Mode | Literal[""] = "", pull_read: str = ""):
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
        self.auth_refused = Counter(
            "pushkv_router_auth_refused", "/v1/* requests refused for a missing or wrong API key", registry=r)
        self.connections_refused = Counter(
            "pushkv_router_connections_refused", "HTTP connections refused with 503 past the connection cap",
            registry=r)
        self.info = Gauge("pushkv_router_info", "Router deployment", ["mode"], registry=r)
        self.info.labels(mode=mode).set(1)
        self.mode, self.pull_read = mode, pull_read
        self.kv_bytes = Histogram(
            "pushkv_kv_transfer_bytes", "KV bytes moved P->D per request", buckets=BYTES_BUCKETS, registry=r)
        self.kv_seconds = Histogram(
            "pushkv_kv_transfer_seconds", "Per request: WRITE (push) or READ (pull) posted -> complete",
            buckets=TRANSFER_BUCKETS_S, registry=r)
        self.kv_descs = Histogram(
            "pushkv_kv_transfer_descriptors", "NIXL descriptors per request's transfer", buckets=DESC_BUCKETS,
            registry=r)
        self.rendezvous = Counter(
            "pushkv_kv_rendezvous", "Push: which half reached P's writer first", ["order"], registry=r)
        if mode == "push":
            for order in RENDEZVOUS_ORDERS:
                self.rendezvous.labels(order=order)
        self.reserved_block_s = Histogram(
            "pushkv_kv_reserved_block_seconds",
            "Per request: D blocks x seconds from their reservation until the KV had arrived "
            "(push: D holds them while P computes), by allocation (early = push, late = after P)",
            ["allocation"], buckets=BLOCK_S_BUCKETS, registry=r)
        self.refused = Counter(
            "pushkv_router_refused", "Requests refused at placement, by HTTP status", ["status"], registry=r)
        self.queued = Counter(
            "pushkv_router_queued", "Requests that waited at the router for a D that can hold them", registry=r)
        self.late_allocations = Counter(
            "pushkv_router_late_allocations",
            "Push requests that fell back to late allocation (D short of blocks)", registry=r)
        self.legs = Counter(
            "pushkv_router_legs", "Legs sent, per instance", ["role", "engine"], registry=r)
        self.instances_down = Counter(
            "pushkv_router_instances_down", "Instances that went down (registry or local events), per instance",
            ["role", "engine"], registry=r)
        self.failed_by_instance_down = Counter(
            "pushkv_router_failed_by_instance_down", "Requests failed because an instance they had a leg on went down",
            ["role", "engine"], registry=r)
        self.paths = Counter(
            "pushkv_router_paths", "Requests placed, by path (push, late, decode-local)", ["path"], registry=r)
        self.prefix_predicted = Counter(
            "pushkv_router_prefix_predicted_tokens",
            "Prompt tokens the router's prefix index said the instance holds, by the leg that took them",
            ["role"], registry=r)
        self.prefix_cached = Counter(
            "pushkv_router_prefix_cached_tokens", "Prompt tokens the instance reported taken from its cache",
            ["role"], registry=r)
        self.prefix_guess_error = Counter(
            "pushkv_router_prefix_guess_error_tokens",
            "|predicted - cached| summed: how far the router's approximate index was off", ["role"], registry=r)
        self.instances = InstanceCollector()
        r.register(self.instances)
        self.balance = BalanceCollector()
        r.register(self.balance)

    def instance_down(self, role: Role, engine: str, reason: str, failed: int) -> None:
        self.instances_down.labels(role=role, engine=engine).inc()
        self.failed_by_instance_down.labels(role=role, engine=engine).inc(failed)

    def prefix_guess(self, role: Role, predicted: int, cached: int) -> None:
        self.prefix_predicted.labels(role=role).inc(predicted)
        self.prefix_cached.labels(role=role).inc(cached)
        self.prefix_guess_error.labels(role=role).inc(abs(predicted - cached))

    def watch_balancer(self, balancer) -> None:
        self.balance.balancer = balancer

    def observe(self, rec: Ledger) -> None:
        """One request that ended, from its ledger."""
        timeline, kv = rec.timeline, rec.kv
        self.requests.labels(outcome=rec.outcome or "ok").inc()
        if kv:
            self.observe_transfer(kv, rec.path)
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

    def observe_transfer(self, kv: dict[str, m.KVTransferStats], path: str) -> None:
        """One request's transfer, as measured by the leg that posted it (push: P, pull: D; ledger.posted_kv)."""
        t, timed = posted_kv(kv, path, self.pull_read)
        assert t is not None
        self.kv_bytes.observe(t.nbytes)
        self.kv_descs.observe(t.num_descs)
        if timed and t.nbytes > 0:  # a transfer that ended in the pass that posted it measures 0.0 s
            self.kv_seconds.observe(t.transfer_s)
        if t.rendezvous in RENDEZVOUS_ORDERS:
            self.rendezvous.labels(order=t.rendezvous).inc()
        d = kv.get("decode")
        if d is not None and d.reserved_blocks:
            self.reserved_block_s.labels(allocation="late" if d.rendezvous == "pull" else "early").observe(
                d.reserved_block_s)

    def update_instances(self, stats: dict[tuple[str, str], Optional[m.Stats]]) -> None:
        """``stats`` by (role, engine id); None: the scheduler did not answer."""
        self.instances.stats = dict(stats)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# scheduler counter -> (metric, help) exposed on its own besides pushkv_instance_events_total
INSTANCE_COUNTERS = {
    "aborted": ("pushkv_instance_aborts", "Requests aborted on the instance (router Abort)"),
    "requests_failed": ("pushkv_instance_requests_failed", "Requests the instance failed"),
    "kv_transfers": ("pushkv_instance_kv_transfers", "KV transfers completed (P side)"),
    "kv_bytes": ("pushkv_instance_kv_bytes", "KV bytes sent (P) / received (D)"),
    "kv_descs": ("pushkv_instance_kv_descriptors", "NIXL descriptors of the KV transfers"),
    "prefix_queries": ("pushkv_instance_prefix_cache_queries", "Requests looked up in the prefix cache"),
    "prefix_hits": ("pushkv_instance_prefix_cache_hits", "Requests that found a cached prompt prefix"),
    "prefix_query_tokens": ("pushkv_instance_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache"),
    "prefix_hit_tokens": ("pushkv_instance_prefix_cache_hit_tokens", "Prompt tokens found cached (not computed again)"),
    "prefix_evictions": ("pushkv_instance_prefix_cache_evictions", "Cached blocks evicted for new requests"),
}
# writer counter -> metric, summed over the instance's ranks
WRITER_COUNTERS = {
    "lease_expired": ("pushkv_instance_lease_expiries", "Pull: P leases that expired before D's READ"),
    "expired_arrival": ("pushkv_instance_write_wait_expiries", "Push: D registrations whose WRITE never came"),
}


class InstanceCollector:
    """Exposes the last ``Stats`` of each scheduler (set at scrape time)."""

    def __init__(self):
        self.stats: dict[tuple[str, str], Optional[m.Stats]] = {}

    def describe(self):
        return []  # values change with the deployment; nothing to check at registration

    def collect(self):
        labels = ["role", "engine"]
        up = GaugeMetricFamily("pushkv_instance_up", "Scheduler answered GetStats at this scrape", labels=labels)
        blocks = GaugeMetricFamily("pushkv_instance_blocks", "KV blocks of the instance", labels=labels)
        free = GaugeMetricFamily("pushkv_instance_blocks_free", "Free KV blocks", labels=labels)
        cached = GaugeMetricFamily("pushkv_instance_blocks_cached", "KV blocks in the prefix cache (held or evictable)",
                                   labels=labels)
        usage = GaugeMetricFamily("pushkv_instance_block_usage", "Fraction of KV blocks in use", labels=labels)
        running = GaugeMetricFamily("pushkv_instance_requests_running", "Requests decoding", labels=labels)
        waiting = GaugeMetricFamily("pushkv_instance_requests_waiting", "Requests waiting for blocks", labels=labels)
        secs = CounterMetricFamily("pushkv_instance_kv_transfer_seconds", "Summed transfer time", labels=labels)
        named = {c: CounterMetricFamily(name, doc, labels=labels)
                 for c, (name, doc) in {**INSTANCE_COUNTERS, **WRITER_COUNTERS}.items()}
        rdv = CounterMetricFamily("pushkv_instance_rendezvous", "Push rendezvous order, per writer rank",
                                  labels=labels + ["order"])
        events = CounterMetricFamily("pushkv_scheduler_events", "Every scheduler counter",
                                     labels=labels + ["event"])
        wevents = CounterMetricFamily("pushkv_writer_events", "Every writer counter",
                                      labels=labels + ["rank", "event"])
        reserved = CounterMetricFamily(
            "pushkv_instance_reserved_block_seconds",
            "D: blocks x seconds reserved before their KV arrived, summed", labels=labels)
        for (role, engine), st in sorted(self.stats.items()):
            up.add_metric([role, engine], 0.0 if st is None else 1.0)
            if st is None:
                continue
            lv = [role, st.engine_id]
            if role == "decode":
                reserved.add_metric(lv, st.counters.get("reserved_block_ms", 0) / 1000.0)
            blocks.add_metric(lv, st.num_blocks)
            free.add_metric(lv, st.free_blocks)
            cached.add_metric(lv, st.cached_blocks)
            usage.add_metric(lv, (st.num_blocks - st.free_blocks) / st.num_blocks if st.num_blocks else 0.0)
            running.add_metric(lv, st.running)
            waiting.add_metric(lv, st.waiting)
            secs.add_metric(lv, st.counters.get("kv_transfer_us", 0) / 1e6)
            writer_sum: dict[str, int] = {}
            for key, v in sorted(st.counters.items()):
                if key.startswith("writer."):
                    _, rank, name = key.split(".", 2)
                    wevents.add_metric(lv + [rank, name], v)
                    writer_sum[name] = writer_sum.get(name, 0) + v
                else:
                    events.add_metric(lv + [key], v)
            for c in INSTANCE_COUNTERS:
                named[c].add_metric(lv, st.counters.get(c, 0))
            for c in WRITER_COUNTERS:
                named[c].add_metric(lv, writer_sum.get(c, 0))
            if st.role == "prefill":
                for order in RENDEZVOUS_ORDERS:
                    rdv.add_metric(lv + [order], writer_sum.get(f"rendezvous_{order}", 0))
        yield from (up, blocks, free, cached, usage, running, waiting, secs, reserved, *named.values(),
                    rdv, events, wevents)


# an instance's state as the router chooses it, each a value of pushkv_router_instances' state label
INSTANCE_STATES = {
    "serving": "chosen for new requests",
    "unhealthy": "a process of it hangs: chosen only where no other is",
    "draining": "its host stops: its legs go on, chosen for none",
    "down": "gone, or still joining: chosen for none",
}


def instance_state(load: P.Load) -> str:
    """One of INSTANCE_STATES: down before draining, draining before unhealthy (a draining instance is chosen for none,
    healthy or not)."""
    if not load.up:
        return "down"
    if load.draining:
        return "draining"
    return "serving" if load.healthy else "unhealthy"


def count_states(loads: Iterable[P.Load]) -> dict[tuple[str, str], int]:
    """Instances by (role, state): every state of each role present, 0 included, so a dashboard's series exist before
    the first drain."""
    counts: dict[tuple[str, str], int] = {}
    for load in loads:
        for state in INSTANCE_STATES:
            counts.setdefault((load.role, state), 0)
        counts[load.role, instance_state(load)] += 1
    return counts


class BalanceCollector:
    """The router's own view of each instance (its accounting of the legs it sent)."""

    def __init__(self):
        self.balancer = None

    def describe(self):
        return []

    def collect(self):
        labels = ["role", "engine"]
        fams = {
            "up": GaugeMetricFamily("pushkv_router_instance_up", "Instance linked and live (a draining one too)",
                                    labels=labels),
            "draining": GaugeMetricFamily(
                "pushkv_router_instance_draining", "The instance's host stops (--shutdown-timeout): its legs go on, "
                "and it is chosen for no new request", labels=labels),
            "healthy": GaugeMetricFamily(
                "pushkv_router_instance_healthy", "Every process of the instance answers its supervisor's pings "
                "(0: one is hung, and the instance is chosen only where no other is)", labels=labels),
            "legs": GaugeMetricFamily("pushkv_router_instance_legs",
                                      "Legs in flight on the instance (P's until D has the KV)", labels=labels),
            "queued_tokens": GaugeMetricFamily(
                "pushkv_router_instance_queued_prefill_tokens",
                "P: prompt tokens sent and still to compute (each prompt less its expected cached prefix)",
                labels=labels),
            "committed": GaugeMetricFamily(
                "pushkv_router_instance_blocks_committed", "D: blocks the legs sent to it take at admission",
                labels=labels),
            "pinned": GaugeMetricFamily(
                "pushkv_router_instance_blocks_pinned", "D: blocks reserved early whose KV has not arrived",
                labels=labels),
        }
        states = GaugeMetricFamily(
            "pushkv_router_instances", "Instances the router knows, by role and state (" + ", ".join(
                f"{k}: {v}" for k, v in INSTANCE_STATES.items()) + ")", labels=["role", "state"])
        depth = GaugeMetricFamily("pushkv_router_queue_depth", "Requests waiting at the router for a D")
        costs = GaugeMetricFamily("pushkv_router_cost", "The cost model's fitted parameters (ms; *_samples: count)",
                                  labels=["param"])
        b = self.balancer
        if b is not None:
            depth.add_metric([], b.waiting)
            for name, value in b.cost.costs.as_dict().items():
                costs.add_metric([name], value)
            for (role, state), n in sorted(count_states(b.loads.values()).items()):
                states.add_metric([role, state], n)
            for engine, load in sorted(b.loads.items()):
                lv = [load.role, engine]
                fams["up"].add_metric(lv, 1.0 if load.up else 0.0)
                fams["draining"].add_metric(lv, 1.0 if load.up and load.draining else 0.0)
                fams["healthy"].add_metric(lv, 1.0 if load.healthy else 0.0)
                fams["legs"].add_metric(lv, load.legs)
                if load.role == "prefill":
                    fams["queued_tokens"].add_metric(lv, load.queued_tokens)
                else:
                    fams["committed"].add_metric(lv, load.committed)
                    fams["pinned"].add_metric(lv, load.pinned)
        yield from (states, depth, costs, *fams.values())
