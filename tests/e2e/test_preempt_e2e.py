"""Blocks as tokens need them, and preemption by recompute, over real processes: requests without max_tokens (the
room left to --max-model-len) on a pool of little more than one such request run together, in local mode and in
push mode, preempting one another (vllm:num_preemptions_total on /metrics), and every request's greedy tokens equal
those of the same request on a pool that holds them all; every block is free on every instance after."""
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.deploy import deployment, in_threads, wait_pools_free

pytestmark = pytest.mark.timeout(600)

MAX_LEN = 160  # 10 blocks of 16 a request, reserved whole before
SMALL, LARGE = 16, 128  # blocks: a pool of 1.6 such requests; one of all of them at once
N = 4  # requests at once
TEXTS = [f"Request {i}: " + "tell me more " * i for i in range(N)]
# one seeded and penalised, one with logprobs: the readmission's last chunk samples as a decode step would
SAMPLING = [{}, {"temperature": 0.9, "seed": 11, "presence_penalty": 0.5, "repetition_penalty": 1.2},
            {"logprobs": True, "top_logprobs": 2}, {}]
COMMON = ("--model", "small", "--max-model-len", str(MAX_LEN))


def run_all(dep) -> list[list[int]]:
    """Every chat at once, none with max_tokens (each gets the room left to --max-model-len), EOS ignored so each
    runs to that length: their tokens."""
    def one(i):
        status, body = dep.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": TEXTS[i]}], "ignore_eos": True, "return_token_ids": True,
            **SAMPLING[i]})
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == MAX_LEN, body["usage"]
        return body["choices"][0]["token_ids"]

    return in_threads(one, range(N), 500)


def preemptions(dep) -> float:
    """vllm:num_preemptions_total summed over the instances' /metrics."""
    total = 0.0
    for inst in dep.cfg.instances():
        with urllib.request.urlopen(f"http://{dep.cfg.metrics_host()}:{inst.metrics_port}/metrics", timeout=10) as r:
            for fam in text_string_to_metric_families(r.read().decode()):
                total += sum(s.value for s in fam.samples if s.name == "vllm:num_preemptions_total")
    return total


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with deployment(tmp_path_factory.mktemp("large"), "--mode", "local", "--num-blocks", str(LARGE), *COMMON) as dep:
        ref = run_all(dep)
        wait_pools_free(dep)
        assert preemptions(dep) == 0
    return ref


@pytest.mark.parametrize("mode", ["local", "push"])
def test_requests_without_max_tokens_share_a_small_pool_by_preemption_and_equal_a_large_pools(
        tmp_path_factory, reference, mode):
    with deployment(tmp_path_factory.mktemp(mode), "--mode", mode, "--num-blocks", str(SMALL), *COMMON) as dep:
        got = run_all(dep)
        st = wait_pools_free(dep)
        assert preemptions(dep) > 0
    for i, (g, want) in enumerate(zip(got, reference)):
        assert g == want, i
    role = "local" if mode == "local" else "decode"
    assert st[role].counters.get("preemptions", 0) > 0
