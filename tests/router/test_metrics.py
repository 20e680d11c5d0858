"""/metrics against fake schedulers: per-transfer histograms from the legs'
KVTransferStats, and what the instances report through GetStats."""
from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pushkv import messages as m

from tests.support.router_fakes import Harness, make_cfg, stage, tokens

pytestmark = pytest.mark.timeout(30)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 25))


def samples(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def key(name: str, **labels) -> str:
    return name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


def stats(role: str, free: int, counters: dict[str, int]) -> m.Stats:
    return m.Stats(f"{role}-engine", role, 100, free, 1, 2, counters)


def test_pull_write_observes_bytes_and_no_transfer_time(tmp_path):
    """With --pull-read write P posts the WRITE after its leg has ended; D's report counts what landed, with 0 s.
    pushkv_kv_transfer_seconds observed that 0 for every such request; it now observes nothing there."""
    def p_script(g):
        pull = m.PullParams(m.PrefillSource("prefill-engine", 1, ("tcp://x",)), (1,), 1, 5, 0.0)
        return [(None, m.PrefillFinished(g.transfer_id, g.generation, 5, pull, (stage("prefill_end"),)))]

    def d_script(g):
        d_kv = m.KVTransferStats(8192, 1, 0.0, "pull")
        fin = m.TokensGenerated(g.transfer_id, g.generation, (6,), True, "length", 1, (stage("finished"),), d_kv)
        return [(None, tokens(g, [5])), (None, fin)]

    async def body():
        async with Harness(make_cfg(tmp_path, "pull", pull_read="write"), {"prefill": p_script, "decode": d_script}) as h:
            r = await h.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
            assert r.status == 200
            return samples(await (await h.http.get("/metrics")).text())

    got = asyncio.run(asyncio.wait_for(body(), 30))
    assert got["pushkv_kv_transfer_bytes_count"] == 1 and got["pushkv_kv_transfer_bytes_sum"] == 8192
    assert got["pushkv_kv_transfer_seconds_count"] == 0


@pytest.mark.parametrize("mode, p_kv, d_kv, want", [
    # push: P's WRITE counts (D's view has no time); pull: D's READ
    ("push", m.KVTransferStats(65536, 3, 0.002, "prefill_first"), m.KVTransferStats(65536, 3, 0.0),
     {"bytes": 65536, "descs": 3, "secs": 0.002, "order": "prefill_first"}),
    ("pull", None, m.KVTransferStats(8192, 1, 0.004, "pull"), {"bytes": 8192, "descs": 1, "secs": 0.004}),
])
def test_transfer_histograms_and_instance_stats(tmp_path, mode, p_kv, d_kv, want):
    def p_script(g):
        pull = None
        if mode == "pull":
            pull = m.PullParams(m.PrefillSource("prefill-engine", 1, ("tcp://x",)), (1,), 1, 5, 0.0)
        return [(None, m.PrefillFinished(g.transfer_id, g.generation, 5, pull, (stage("prefill_end"),), p_kv))]

    def d_script(g):
        fin = m.TokensGenerated(g.transfer_id, g.generation, (6,), True, "length", 1, (stage("finished"),), d_kv)
        return [(None, tokens(g, [5])), (None, fin)]

    async def body():
        h = Harness(make_cfg(tmp_path, mode), {"prefill": p_script, "decode": d_script})
        h.fakes["prefill"].stats = stats("prefill", 90, {
            "aborted": 1, "kv_transfers": 1, "kv_bytes": 65536, "kv_transfer_us": 2000,
            "writer.0.lease_expired": 2, "writer.1.lease_expired": 1, "writer.0.rendezvous_prefill_first": 1,
            "writer.0.writes": 1, "prefix_queries": 4, "prefix_hits": 3, "prefix_hit_tokens": 96})
        h.fakes["decode"].stats = msgspec.structs.replace(stats("decode", 75, {"requests": 1}), cached_blocks=12)
        async with h:
            r = await h.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
            assert r.status == 200
            got = samples(await (await h.http.get("/metrics")).text())
        assert got["pushkv_kv_transfer_bytes_count"] == 1 and got["pushkv_kv_transfer_bytes_sum"] == want["bytes"]
        assert got["pushkv_kv_transfer_descriptors_sum"] == want["descs"]
        assert got["pushkv_kv_transfer_seconds_sum"] == pytest.approx(want["secs"])
        if "order" in want:
            assert got[f"pushkv_kv_rendezvous_total{{order={want['order']}}}"] == 1
            assert got["pushkv_kv_rendezvous_total{order=registration_first}"] == 0
        lv = "engine=prefill-engine,role=prefill"
        assert got[f"pushkv_instance_blocks{{{lv}}}"] == 100 and got[f"pushkv_instance_blocks_free{{{lv}}}"] == 90
        assert got[f"pushkv_instance_block_usage{{{lv}}}"] == pytest.approx(0.1)
        assert got["pushkv_instance_block_usage{engine=decode-engine,role=decode}"] == pytest.approx(0.25)
        assert got[f"pushkv_instance_requests_waiting{{{lv}}}"] == 2
        assert got[f"pushkv_instance_aborts_total{{{lv}}}"] == 1
        assert got[f"pushkv_instance_lease_expiries_total{{{lv}}}"] == 3  # summed over writer ranks
        assert got[f"pushkv_instance_kv_transfer_seconds_total{{{lv}}}"] == pytest.approx(0.002)
        p = {"engine": "prefill-engine", "role": "prefill"}
        assert got[key("pushkv_instance_rendezvous_total", order="prefill_first", **p)] == 1
        assert got[key("pushkv_writer_events_total", event="lease_expired", rank="1", **p)] == 1
        assert got[key("pushkv_scheduler_events_total", event="kv_bytes", **p)] == 65536
        assert got["pushkv_instance_up{engine=prefill-engine,role=prefill}"] == 1
        assert got["pushkv_instance_up{engine=decode-engine,role=decode}"] == 1
        assert got[f"pushkv_instance_prefix_cache_queries_total{{{lv}}}"] == 4
        assert got[f"pushkv_instance_prefix_cache_hits_total{{{lv}}}"] == 3
        assert got[f"pushkv_instance_prefix_cache_hit_tokens_total{{{lv}}}"] == 96
        assert got["pushkv_instance_blocks_cached{engine=decode-engine,role=decode}"] == 12
    run(body())


def test_silent_scheduler_does_not_hold_the_scrape(tmp_path):
    async def body():
        async with Harness(make_cfg(tmp_path, "local"), {"local": None}) as h:
            t0 = time.monotonic()
            r = await h.http.get("/metrics")
            assert r.status == 200 and time.monotonic() - t0 < 3
            got = samples(await r.text())
        assert got["pushkv_instance_up{engine=local-engine,role=local}"] == 0
        assert not any(k.startswith("pushkv_instance_blocks") for k in got)
    run(body())
