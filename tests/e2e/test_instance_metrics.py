"""Each P and D instance's /metrics, scraped over HTTP as llm-d and Prometheus scrape a vLLM
model server, parsed with prometheus_client's parser and checked against the load sent."""
import json
import os
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.deploy import deployment, wait_pools_free

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[3 + i] * n for i, n in enumerate((5, 17, 40))]
MAX_TOKENS = 4


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def with_label(label: tuple, **more) -> tuple:
    """``label`` and ``more``, sorted as ``scrape``'s keys."""
    return tuple(sorted(label + tuple(more.items())))


def test_each_instance_serves_vllm_metrics(tmp_path):
    with deployment(tmp_path, "--mode", "push", "--model", "small", "--num-blocks", "64") as dep:
        urls = {i.role: f"http://{dep.cfg.metrics_host()}:{i.metrics_port}/metrics" for i in dep.cfg.instances()}
        idle = {role: scrape(u) for role, u in urls.items()}
        env = dict(os.environ, PUSHKV_REGISTRY_DIR=str(tmp_path / "registry"))
        st = subprocess.run([sys.executable, "-m", "processes.cli", "status", "--json"], env=env,
                            capture_output=True, text=True, timeout=60)
        (entry,) = json.loads(st.stdout)
        assert {i["role"]: i["metrics_url"] for i in entry["instances"]} == urls  # `pushkv status` shows them
        for p in PROMPTS:
            assert len(dep.tokens(p, MAX_TOKENS)) == MAX_TOKENS
        wait_pools_free(dep)
        after = {role: scrape(u) for role, u in urls.items()}
        info = {(s.labels["engine_id"], s.labels["role"]) for fam in text_string_to_metric_families(
            urllib.request.urlopen(urls["decode"], timeout=10).read().decode()) for s in fam.samples
            if s.name == "pushkv_instance_info"}
    assert info == {(dep.cfg.decode.engine_id, "decode")}
    n, prompt_tokens = len(PROMPTS), sum(len(p) for p in PROMPTS)
    label = (("engine", "0"), ("model_name", "small"))  # as vLLM labels them
    for role, got in after.items():
        before = idle[role]
        success = ("vllm:request_success_total", with_label(label, finished_reason="length"))
        assert before.get(success, 0) == 0 and got[success] == n, role
        assert before[("vllm:prompt_tokens_total", label)] == 0
        assert got[("vllm:prompt_tokens_total", label)] == prompt_tokens, role
        assert got[("vllm:time_to_first_token_seconds_count", label)] == n, role
        assert got[("vllm:e2e_request_latency_seconds_count", label)] == n, role
        assert got[("pushkv_instance_requests_total", label)] == n, role
        assert got[("pushkv_instance_kv_bytes_total", label)] > 0, role
        for gauge in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            assert before[(gauge, label)] == 0 and got[(gauge, label)] == 0, (role, gauge)
        assert got[("pushkv_instance_kv_blocks", label)] == 64
    # P's leg makes the first token; D sends every token (P's first among them) and times the rest
    assert after["prefill"][("vllm:generation_tokens_total", label)] == n
    assert after["decode"][("vllm:generation_tokens_total", label)] == n * MAX_TOKENS
    assert after["decode"][("vllm:time_per_output_token_seconds_count", label)] == n * (MAX_TOKENS - 1)
    assert after["prefill"][("pushkv_instance_kv_transfers_total", label)] == n
    assert after["decode"][("pushkv_instance_kv_waits_total", label)] == n


def _a_stop_string(text: str) -> str:
    """A character of ``text`` past its first two that appears nowhere before it: a stop string that ends a greedy
    rerun of the same request there, mid-output."""
    for i in range(2, len(text)):
        if text[i].isalnum() and text[i] not in text[:i]:
            return text[i]
    raise AssertionError(f"no stop string in {text!r}")


def _a_last_token_stop(choice: dict) -> tuple[str, int]:
    """A stop string of ``choice``'s text (as ``_a_stop_string``) and the max_tokens whose last token completes it
    (its ``text_offset``s say which token holds it)."""
    stop = _a_stop_string(choice["text"])
    i = choice["text"].index(stop)
    return stop, sum(1 for off in choice["logprobs"]["text_offset"] if off <= i)


def test_how_a_request_ended_is_counted_on_each_instance(tmp_path):
    """As vLLM's instances count them: a stop string the router matches ends D's leg "stop" (vLLM's frontend matches
    them), also where it matches on the token that reached max_tokens (D's leg ended by length: the router says how
    the client's choice ended, ChoiceEnded), P's leg "length" (its one token); a client that goes away mid-stream is
    counted on no instance's D (vLLM's frontend drops an abort uncounted), while P's leg, whose token was out, is
    "length"."""
    with deployment(tmp_path, "--mode", "push", "--model", "small", "--num-blocks", "64") as dep:
        urls = {i.role: f"http://{dep.cfg.metrics_host()}:{i.metrics_port}/metrics" for i in dep.cfg.instances()}
        first = dep.complete("hello there", 12, temperature=0, logprobs=0)["choices"][0]
        assert first["finish_reason"] == "length"
        stopped = dep.complete("hello there", 12, temperature=0, stop=[_a_stop_string(first["text"])])["choices"][0]
        assert stopped["finish_reason"] == "stop"
        stop, n = _a_last_token_stop(first)
        last = dep.complete("hello there", n, temperature=0, stop=[stop])["choices"][0]
        assert (last["finish_reason"], last["stop_reason"], len(last["token_ids"])) == ("stop", stop, n)
        conn = dep.connection(60)  # a stream read to its first token, then dropped
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "hello there", "max_tokens": 900, "temperature": 0, "stream": True,
             "ignore_eos": True}).encode(), headers={"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        conn.close()
        wait_pools_free(dep)
        got = {role: scrape(u) for role, u in urls.items()}
    label = (("engine", "0"), ("model_name", "small"))  # as vLLM labels them

    def ends(role: str) -> dict[str, float]:
        return {r: got[role][("vllm:request_success_total", with_label(label, finished_reason=r))]
                for r in ("stop", "length", "abort", "error", "repetition")}

    assert ends("decode") == {"stop": 2, "length": 1, "abort": 0, "error": 0, "repetition": 0}
    assert ends("prefill") == {"stop": 0, "length": 4, "abort": 0, "error": 0, "repetition": 0}
    assert got["decode"][("vllm:e2e_request_latency_seconds_count", label)] == 3
    assert got["decode"][("pushkv_instance_aborted_total", label)] == 2  # the stop string's and the dropped stream's
