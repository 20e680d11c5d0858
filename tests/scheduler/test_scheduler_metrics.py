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
from tests.scheduler.test_scheduler_roles import P_SRC, make, step_done

ROUTER = Peer.router(b"router")
WORKER = Peer("worker", 0)


def scrape(core) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from the text a scrape returns."""
    core.publish_metrics()
    text = generate_latest(core.metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples, name: str, **labels) -> float:
    want = tuple(sorted({"model_name": "small", "engine": "0", **labels}.items()))
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
    # the request's mean interval, one observation a request: 0 for a request of one token, as vLLM's (P's legs
    # are all such: vLLM's P observes each, and a dashboard's sum / count divides by them)
    assert value(got, "vllm:request_time_per_output_token_seconds_count") == 1
    assert value(got, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.25 if max_tokens > 1 else 0)
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


REASONS = ("stop", "length", "abort", "error", "repetition")


def ended(core) -> dict[str, float]:
    """vllm:request_success_total by finished_reason, and how many requests the per-request histograms took."""
    got = scrape(core)
    out = {r: value(got, "vllm:request_success_total", finished_reason=r) for r in REASONS}
    out["e2e"] = value(got, "vllm:e2e_request_latency_seconds_count")
    return out


def role_core(role: str, mode: str = "push"):
    return make(role, mode=mode, tp=1)


def run_local(core, how: str) -> None:
    """A local request of 3 tokens, ended ``how``."""
    core.handle(m.Generate("t", 0, "local", (1, 2, 3), 3), ROUTER, 1.0, 1.0)
    step(core, 1.5)  # its first token
    if how in ("stop string", "client gone"):  # aborted mid-step: freed when the step answers
        # a stop string the router matched completes the choice; a disconnect, /v1/abort or the router's deadline
        # aborts it, which vLLM counts nowhere
        finish = "stop" if how == "stop string" else ""
        core.handle(m.Abort("t", 0, how, finish=finish), ROUTER, 1.6, 1.6)
        step(core, 1.7)
    elif how == "step failed":
        sent = [e.msg for e in core.take_outbox() if isinstance(e, Send) and isinstance(e.msg, m.ExecuteStep)]
        core.handle(m.StepFailed(sent[0].step_id, "CUDA error"), WORKER, 1.6, 1.6)
    elif how == "step timed out":
        core.tick(1.5 + core.cfg.timeouts.step_s + 1, 100.0)
    else:
        step(core, 1.6)
        step(core, 1.7)


@pytest.mark.parametrize("how, reason", [
    ("to max_tokens", "length"),
    ("stop string", "stop"),  # vLLM's frontend matches stop strings and counts them "stop": so do instances
    ("client gone", None),
    ("step failed", "error"),  # vLLM's engine counts a request it fails "error" (a KV load's failure)
    ("step timed out", "error"),
])
def test_a_local_request_is_counted_once_by_how_it_ended(how, reason):
    core = local_core()
    run_local(core, how)
    want = {r: int(r == reason) for r in REASONS}
    want["e2e"] = int(reason is not None)
    assert ended(core) == want
    assert not core.reqs


def test_max_num_generation_tokens_is_what_the_request_generated_not_its_max_tokens():
    """vLLM's vllm:request_max_num_generation_tokens is the most tokens any of a request's n choices generated
    (ParentRequest.observe_finished_request); it observed max_tokens here, so a request stopped early read as long as
    it was allowed to be."""
    core = local_core()
    run_local(core, "stop string")  # max_tokens 3, stopped after its first tokens
    got = scrape(core)
    generated = value(got, "vllm:request_generation_tokens_sum")
    assert 0 < generated < 3 and value(got, "vllm:request_params_max_tokens_sum") == 3
    assert value(got, "vllm:request_max_num_generation_tokens_sum") == generated


@pytest.mark.parametrize("word, reason", [("stop", "stop"), ("length", "length"), (None, "length")])
def test_an_end_by_length_waits_for_the_routers_word_where_it_searches_for_stop_strings(word, reason):
    """vLLM's frontend counts a stop string its detokenizer matches on the token that reached max_tokens as "stop"
    (it overrides the engine's length). The router searches the text here: a leg that ends by length while it does
    (Generate.stop_strings) is counted once the router says how the client's choice ended (ChoiceEnded), or as
    "length" once the request's deadline has passed without a word."""
    core = local_core()
    core.handle(m.Generate("t", 0, "local", (1, 2, 3), 3, stop_strings=True), ROUTER, 1.0, 1.0)
    for t in (1.5, 1.6, 1.7):
        step(core, t)
    assert not core.reqs and ended(core) == {r: 0 for r in REASONS} | {"e2e": 0}  # its blocks are free, its end held
    if word is None:
        core.tick(1.7 + core.cfg.timeouts.request_s - 1, 100.0)
        assert ended(core)["e2e"] == 0
        core.tick(1.7 + core.cfg.timeouts.request_s + 1, 100.0)
    else:
        core.handle(m.ChoiceEnded("t", 0, word), ROUTER, 2.0, 2.0)
    assert ended(core) == {r: int(r == reason) for r in REASONS} | {"e2e": 1}
    core.handle(m.ChoiceEnded("t", 0, "stop"), ROUTER, 3.0, 3.0)  # once
    assert ended(core)["stop"] == int(reason == "stop") and core.counters["choice_end_unknown"] == 1


def test_a_held_end_is_counted_stop_by_the_routers_abort_for_a_stop_string_matched_before_its_last_token():
    """The router matched a stop string on a token before the last and aborted the leg (Abort finish "stop"), while
    the leg reached max_tokens here: the router, closed, drops the leg's last message and says nothing more, so its
    Abort is the word on the held end (vLLM counts it stop: its frontend's match ends the request)."""
    core = local_core()
    core.handle(m.Generate("t", 0, "local", (1, 2, 3), 3, stop_strings=True), ROUTER, 1.0, 1.0)
    for t in (1.5, 1.6, 1.7):
        step(core, t)
    assert not core.reqs
    core.handle(m.Abort("t", 0, "stop string matched", finish="stop"), ROUTER, 2.0, 2.0)
    assert ended(core) == {r: int(r == "stop") for r in REASONS} | {"e2e": 1}
    assert core.counters["abort_unknown"] == 0
    core.tick(1.7 + core.cfg.timeouts.request_s + 1, 100.0)  # counted once
    assert ended(core)["e2e"] == 1


def test_an_end_by_a_stop_id_is_counted_at_once_and_a_new_router_releases_the_held_ones():
    core = local_core()
    core.handle(m.RouterEpoch(1), ROUTER, 0.5, 0.5)
    core.handle(m.Generate("s", 0, "local", (1, 2, 3), 3, stop_token_ids=(7,), stop_strings=True), ROUTER, 1.0, 1.0)
    step(core, 1.5, tok=7)
    assert ended(core)["stop"] == 1
    core.handle(m.Generate("t", 0, "local", (1, 2, 3), 1, stop_strings=True), ROUTER, 2.0, 2.0)
    step(core, 2.5)
    assert ended(core)["length"] == 0
    core.handle(m.RouterEpoch(2), Peer.router(b"router2"), 3.0, 3.0)  # it restarted: the router that would say is gone
    assert ended(core)["length"] == 1


def test_a_prefill_leg_is_counted_once_though_its_kv_fails_after():
    """Pull: P's leg ends ("length", its one token) when it holds the KV for D; a READ that fails after, or the lease
    running out, fails the transfer but not the leg a second time (vLLM's P counts its max_tokens=1 request once)."""
    s, wire = role_core("prefill", "pull")
    s.handle(m.Generate("t", 0, "prefill", (1, 2, 3), 1), ROUTER, 1.0, 1.0)
    step_done(s, wire, (42,))
    assert ended(s)["length"] == 1
    s.handle(m.KVFailed("t", 0, "lease expired"), s.writers[0], 2.0, 2.0)
    assert ended(s) == {"stop": 0, "length": 1, "abort": 0, "error": 0, "repetition": 0, "e2e": 1}


def test_a_push_prefill_leg_whose_write_fails_is_an_error():
    s, wire = role_core("prefill")
    s.handle(m.Generate("t", 0, "prefill", (1, 2, 3), 1), ROUTER, 1.0, 1.0)
    step_done(s, wire, (42,))
    s.handle(m.KVFailed("t", 0, "UCX error"), s.writers[0], 2.0, 2.0)
    assert ended(s)["error"] == 1 and ended(s)["length"] == 0


@pytest.mark.parametrize("reason", ["request complete", "client disconnected"])
def test_a_decode_leg_whose_kv_fails_is_an_error_and_an_aborted_p_leg_with_its_token_out_ends_as_length(reason):
    """D's KV that never lands fails D's leg ("error", as vLLM's D counts a KV load failure); P's leg aborted once its
    one token is out (the request complete, or the client gone after it) has ended as vLLM's P ends it, "length",
    once, whatever its writers answer after."""
    d, _ = role_core("decode")
    d.handle(m.Generate("t", 0, "decode", (1, 2, 3), 4, source=P_SRC), ROUTER, 1.0, 1.0)
    d.handle(m.KVFailed("t", 0, "peer died"), d.writers[0], 2.0, 2.0)
    assert ended(d)["error"] == 1
    p, wire = role_core("prefill")
    p.handle(m.Generate("t", 0, "prefill", (1, 2, 3), 1), ROUTER, 1.0, 1.0)
    step_done(p, wire, (42,))
    p.handle(m.Abort("t", 0, reason), ROUTER, 2.0, 2.0)
    p.handle(m.KVSent("t", 0), p.writers[0], 2.1, 2.1)
    assert ended(p) == {"stop": 0, "length": 1, "abort": 0, "error": 0, "repetition": 0, "e2e": 1}
    assert not p.reqs


def test_a_prefill_leg_aborted_before_its_token_is_not_counted():
    s, wire = role_core("prefill")
    s.handle(m.Generate("t", 0, "prefill", (1, 2, 3), 1), ROUTER, 1.0, 1.0)
    s.handle(m.Abort("t", 0, "client disconnected"), ROUTER, 1.1, 1.1)
    step_done(s, wire, (42,))  # (its streamed layers wait for the writers' answers to the cancel)
    s.handle(m.KVFailed("t", 0, "cancelled"), s.writers[0], 1.2, 1.2)
    assert ended(s) == {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0, "e2e": 0}
    assert not s.reqs


def by_source(core) -> dict[str, float]:
    got = scrape(core)
    out = {s: value(got, "vllm:prompt_tokens_by_source_total", source=s)
           for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    out["cached"] = value(got, "vllm:prompt_tokens_cached_total")
    return out


def test_prompt_tokens_by_source_as_vllm_counts_them():
    """vLLM 0.32: a prompt's tokens are computed here, found in the prefix cache here, or moved here by a KV transfer
    (vllm:prompt_tokens_by_source), and vllm:prompt_tokens_cached is the last two (a D's loaded prompt is cached)."""
    core = local_core()
    run_local(core, "to max_tokens")
    assert by_source(core) == {"local_compute": 3, "local_cache_hit": 0, "external_kv_transfer": 0, "cached": 0}
    p, wire = role_core("prefill")
    p.handle(m.Generate("t", 0, "prefill", (1, 2, 3), 1), ROUTER, 1.0, 1.0)
    step_done(p, wire, (42,))
    assert by_source(p) == {"local_compute": 3, "local_cache_hit": 0, "external_kv_transfer": 0, "cached": 0}
    d, _ = role_core("decode")
    d.handle(m.Generate("t", 0, "decode", (1, 2, 3), 4, source=P_SRC), ROUTER, 1.0, 1.0)
    assert by_source(d)["external_kv_transfer"] == 0  # not before its first token
    for w in d.writers:
        d.handle(m.KVReceived("t", 0, 42, nbytes=100, num_descs=1), w, 2.0, 2.0)
    assert by_source(d) == {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 3, "cached": 3}


def test_a_router_elsewhere_leaves_the_other_routers_held_ends_to_its_word():
    """A second router (another place: a replica, a rolling update's new pod) announces its epoch while the first
    router's leg that ended by length waits for its word on a stop string: the first router is alive and still says
    how its client's choice ended, so its held end waits for that word (counted stop), as its requests run on; a
    restart at the first router's place releases what it held, as before."""
    core = local_core()
    a, b, a_again = Peer.router(b"router-a"), Peer.router(b"router-b"), Peer.router(b"router-a2")
    core.handle(m.RouterEpoch(100, "10.0.0.9:8000"), a, 0.5, 0.5)
    for tid in ("t", "u"):
        core.handle(m.Generate(tid, 0, "local", (1, 2, 3), 3, stop_strings=True), a, 1.0, 1.0)
        for t in (1.5, 1.6, 1.7):
            step(core, t)
    assert not core.reqs and ended(core)["e2e"] == 0  # both ends held for router a's word
    core.handle(m.RouterEpoch(200, "10.0.0.10:8000"), b, 2.0, 2.0)  # router b starts elsewhere
    assert ended(core)["e2e"] == 0
    core.handle(m.ChoiceEnded("t", 0, "stop"), a, 2.5, 2.5)  # router a's word on t
    assert ended(core) == {r: int(r == "stop") for r in REASONS} | {"e2e": 1}
    assert core.counters["choice_end_unknown"] == 0
    core.handle(m.RouterEpoch(300, "10.0.0.9:8000"), a_again, 3.0, 3.0)  # router a restarted: nobody will say of u
    assert ended(core) == {"stop": 1, "length": 1, "abort": 0, "error": 0, "repetition": 0, "e2e": 2}
