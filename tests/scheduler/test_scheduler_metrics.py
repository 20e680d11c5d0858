"""An instance's /metrics values (vLLM's names) from its core, driven by plain calls and read back
through prometheus_client's own exposition and parser, as a scraper reads them."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig
from pushkv.scheduler import scheduler_for
from pushkv.scheduler.outbox import Peer, Send
from pushkv.scheduler.requests import blocks_needed

ROUTER = Peer.router(b"router")
WORKER = Peer("worker", 0)


def scrape(core) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from the text a scrape returns."""
    core.publish_metrics()
    text = generate_latest(core.metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples, name: str, **labels) -> float:
    want = tuple(sorted({"model_name": "small", **labels}.items()))
    return samples[(name, want)]


def local_core(num_blocks: int = 8):
    inst = InstanceConfig(role="local", engine_id="local-engine", num_blocks=num_blocks, worker_endpoints=("w0",))
    return scheduler_for(DeploymentConfig(mode="local", local=inst), inst)


def step(core, now: float, tok: int = 7) -> None:
    """Answer the ExecuteStep in the outbox with one token per sampled sequence."""
    sent = [e.msg for e in core.take_outbox() if isinstance(e, Send) and isinstance(e.msg, m.ExecuteStep)]
    assert len(sent) == 1, sent
    n = sum(1 for w in sent[0].seqs if w.sample)
    core.handle(m.StepDone(sent[0].step_id, (tok,) * n), WORKER, now, now)


@pytest.mark.parametrize("prompt_len,max_tokens", [(5, 1), (20, 3), (33, 4)])
def test_local_request_counts_and_usage(prompt_len, max_tokens):
    core = local_core()
    need = blocks_needed("local", prompt_len, max_tokens, 16)
    core.handle(m.Generate("t1", 0, "local", tuple(range(1, prompt_len + 1)), max_tokens), ROUTER, 10.0, 10.0)
    got = scrape(core)
    # admitted at once: its blocks are held and it is running (prefilling)
    assert value(got, "vllm:num_requests_running") == 1
    assert value(got, "vllm:num_requests_waiting") == 0
    assert value(got, "vllm:kv_cache_usage_perc") == pytest.approx(need / 8)
    t = 10.5
    for _ in range(max_tokens):
        step(core, t)
        t += 0.25
    got = scrape(core)
    assert value(got, "vllm:kv_cache_usage_perc") == 0
    assert value(got, "vllm:num_requests_running") == 0
    assert value(got, "vllm:request_success_total", finished_reason="length") == 1
    assert value(got, "vllm:prompt_tokens_total") == prompt_len
    assert value(got, "vllm:generation_tokens_total") == max_tokens
    assert value(got, "vllm:time_to_first_token_seconds_count") == 1
    assert value(got, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(got, "vllm:time_per_output_token_seconds_count") == max_tokens - 1
    assert value(got, "vllm:time_per_output_token_seconds_sum") == pytest.approx(0.25 * (max_tokens - 1))
    assert value(got, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(0.5 + 0.25 * (max_tokens - 1))
    assert value(got, "vllm:request_generation_tokens_sum") == max_tokens
    assert value(got, "pushkv_instance_requests_total") == 1
    # vLLM 0.32's per-request phases and parameters (its Grafana dashboard's panels read these)
    decode_s = 0.25 * (max_tokens - 1)
    assert value(got, "vllm:request_prefill_time_seconds_sum") == pytest.approx(0.5)  # admitted at 10.0
    assert value(got, "vllm:request_decode_time_seconds_sum") == pytest.approx(decode_s)
    assert value(got, "vllm:request_inference_time_seconds_sum") == pytest.approx(0.5 + decode_s)
    assert value(got, "vllm:request_time_per_output_token_seconds_count") == (max_tokens > 1)
    if max_tokens > 1:  # the request's mean interval, one observation a request
        assert value(got, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.25)
    assert value(got, "vllm:request_params_max_tokens_sum") == max_tokens
    assert value(got, "vllm:request_max_num_generation_tokens_sum") == max_tokens
    assert value(got, "vllm:request_params_n_sum") == 1
    assert value(got, "vllm:iteration_tokens_total_sum") == prompt_len + max_tokens - 1  # the prompt, then one a step
    assert value(got, "vllm:prompt_tokens_cached_total") == 0
    for reason in ("stop", "abort", "error", "repetition"):  # every reason's series from the start, as vLLM's
        assert value(got, "vllm:request_success_total", finished_reason=reason) == 0
    buckets = sorted(float(dict(k[1])["le"]) for k in got if k[0] == "vllm:request_prompt_tokens_bucket")
    assert buckets[:4] == [1, 2, 5, 10] and buckets[-2] <= core.cfg.model.max_position < buckets[-2] * 2.5


def test_a_request_that_does_not_fit_waits():
    core = local_core(num_blocks=4)
    core.handle(m.Generate("big", 0, "local", tuple(range(1, 50)), 10), ROUTER, 1.0, 1.0)  # 4 blocks
    core.handle(m.Generate("next", 0, "local", (1, 2, 3), 2), ROUTER, 1.0, 1.0)
    got = scrape(core)
    assert value(got, "vllm:num_requests_running") == 1
    assert value(got, "vllm:num_requests_waiting") == 1
    assert value(got, "vllm:kv_cache_usage_perc") == 1.0
    core.handle(m.Generate("bad", 0, "local", (), 2), ROUTER, 1.0, 1.0)  # refused: an empty prompt
    got = scrape(core)
    assert value(got, "pushkv_instance_rejected_total") == 1
    assert value(got, "vllm:num_requests_waiting") == 1
