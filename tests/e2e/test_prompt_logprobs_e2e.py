"""Prompt logprobs end to end: real processes over loopback, the real router's HTTP server, real NIXL.

The same requests in local, push and pull, on the per-sequence and the batched engine, whole and in
prefill chunks, with the prefix cache on, give what one local instance without a cache gives: lm-eval's
loglikelihood request (echo, logprobs 1, max_tokens 1) and its scoring one (max_tokens 0), vLLM's
``prompt_logprobs`` on completions and chat, and echo streamed; the same tokens, the same logprobs to
1e-4. The second prompt shares the first's prefix, which the cache holds by then: a request that
asks is computed whole anyway (the instance counts the hit it skipped), and one that does not
still takes it. Requests that do not ask answer as they did.
"""
from __future__ import annotations

import http.client
import json
import socket
import urllib.parse

import pytest

from tests.support.deploy import deployment, wait_pools_free

pytestmark = pytest.mark.timeout(600)

A = "The quick brown fox jumps over the lazy dog, then rests."
B = A + " Later the fox runs off into the woods."  # A's prefix: two blocks of 16 and more
COMMON = ("--model", "tiny", "--num-blocks", "128")
TOL = 1e-4


def stream(dep, path: str, body: dict) -> list[dict]:
    """A streamed request's chunks, in order (without [DONE])."""
    u = urllib.parse.urlsplit(dep.url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=120)
    try:
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        lines = r.read().decode().splitlines()
    finally:
        conn.close()
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def post(dep, path: str, body: dict) -> dict:
    status, out = dep.post(path, body)
    assert status == 200, out
    return out


def scenario(dep) -> dict:
    """The requests, in order (A first, alone, so the cache holds its prefix when B comes)."""
    role = "local" if dep.cfg.mode == "local" else "prefill"
    before = dict(dep.stats(role).counters)
    out: dict = {"plain_a": post(dep, "/v1/completions", {"prompt": A, "max_tokens": 6})}
    lm_eval = {"max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    out["loglikelihood_b"] = post(dep, "/v1/completions", {"prompt": B, **lm_eval})
    out["scoring_b"] = post(dep, "/v1/completions", {"prompt": B, "max_tokens": 0, "logprobs": 2, "echo": True})
    out["prompt_logprobs_a"] = post(dep, "/v1/completions", {"prompt": A, "max_tokens": 4, "prompt_logprobs": 3,
                                                             "logprobs": 2})
    out["chat"] = post(dep, "/v1/chat/completions", {"messages": [{"role": "user", "content": B}], "max_tokens": 3,
                                                     "prompt_logprobs": 2})
    out["streamed_b"] = stream(dep, "/v1/completions", {"prompt": B, "max_tokens": 3, "logprobs": 1, "echo": True})
    out["plain_b"] = post(dep, "/v1/completions", {"prompt": B, "max_tokens": 6})
    out["logprobs_b"] = post(dep, "/v1/completions", {"prompt": B, "max_tokens": 4, "logprobs": 2})
    after = dep.stats(role).counters
    out["skipped"] = after.get("prefix_skipped_prompt_logprobs", 0) - before.get("prefix_skipped_prompt_logprobs", 0)
    wait_pools_free(dep)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One local instance, the per-sequence engine, no prefix cache, whole prompts."""
    with deployment(tmp_path_factory.mktemp("local-ref"), "--mode", "local", *COMMON, "--no-prefix-cache") as dep:
        return scenario(dep)


def close_logprobs(got: dict, want: dict) -> None:
    """Completions' logprobs objects: the same tokens, offsets and top entries, values to TOL."""
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    for g, w in zip(got["token_logprobs"], want["token_logprobs"], strict=True):
        assert (g is None and w is None) or g == pytest.approx(w, abs=TOL)
    for g, w in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
        assert (g is None and w is None) or (list(g) == list(w) and list(g.values()) == pytest.approx(
            list(w.values()), abs=TOL))


def close_vllm(got: list, want: list) -> None:
    """vLLM's prompt_logprobs: the same ids, ranks and decoded tokens, logprobs to TOL."""
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert list(g) == list(w)
        for k in g:
            assert (g[k]["rank"], g[k]["decoded_token"]) == (w[k]["rank"], w[k]["decoded_token"])
            assert g[k]["logprob"] == pytest.approx(w[k]["logprob"], abs=TOL)


CONFIGS = {
    "local batched chunked": ("--mode", "local", "--engine", "batched", "--prefill-chunk", "8"),
    "push": ("--mode", "push"),
    "push batched chunk-streamed": ("--mode", "push", "--engine", "batched", "--prefill-chunk", "8",
                                    "--push-stream", "chunk"),
    "pull chunked": ("--mode", "pull", "--pull-read", "background", "--prefill-chunk", "8"),
    "pull batched": ("--mode", "pull", "--pull-read", "background", "--engine", "batched"),
    "push P tp2 chunked": ("--mode", "push", "--prefill-tp", "2", "--prefill-chunk", "8"),  # rank 0 scores
}


def test_the_reference_answers_as_vllm_shapes_them(reference):
    ll = reference["loglikelihood_b"]["choices"][0]
    lp = ll["logprobs"]
    n = reference["plain_b"]["usage"]["prompt_tokens"]
    assert ll["text"].startswith(B) and len(ll["token_ids"]) == 1
    assert len(lp["tokens"]) == n + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    # lm-eval reads the continuation's positions: each a logprob and a top entry holding the top-1 and the token
    assert all(len(t) in (1, 2) and max(t.values()) >= v for t, v in zip(lp["top_logprobs"][1:n],
                                                                         lp["token_logprobs"][1:n]))
    assert lp["text_offset"][:3] == [0, 1, 2]
    assert len(ll["prompt_logprobs"]) == n  # vLLM's, beside it
    score = reference["scoring_b"]
    sc = score["choices"][0]
    assert (sc["text"], sc["token_ids"], sc["finish_reason"]) == (B, [], "length")
    assert len(sc["logprobs"]["tokens"]) == n and score["usage"]["completion_tokens"] == 1
    pl = reference["prompt_logprobs_a"]["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and all(3 <= len(d) <= 4 for d in pl[1:])
    assert reference["chat"]["prompt_logprobs"][0] is None and "prompt_logprobs" not in reference["chat"]["choices"][0]
    chunks = reference["streamed_b"]
    first = chunks[0]["choices"][0]  # the prompt with the first tokens, as vLLM's stream sends it: no chunk its own
    assert first["text"].startswith(B) and first["token_ids"]
    assert len(first["logprobs"]["tokens"]) == n + len(first["token_ids"])
    assert first["logprobs"]["token_logprobs"][0] is None
    assert all(c["choices"][0]["token_ids"] for c in chunks if c["choices"])
    assert "prompt_logprobs" not in reference["plain_b"]["choices"][0]
    assert reference["plain_b"]["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_mode_and_engine_gives_the_local_answer(name, reference, tmp_path):
    with deployment(tmp_path, *CONFIGS[name], *COMMON) as dep:
        got = scenario(dep)
    for key in ("plain_a", "loglikelihood_b", "scoring_b", "prompt_logprobs_a", "plain_b", "logprobs_b"):
        g, w = got[key]["choices"][0], reference[key]["choices"][0]
        assert (g["text"], g["token_ids"], g["finish_reason"]) == (w["text"], w["token_ids"], w["finish_reason"]), key
        assert (g["logprobs"] is None) == (w["logprobs"] is None), key
        if w["logprobs"] is not None:
            close_logprobs(g["logprobs"], w["logprobs"])
        assert ("prompt_logprobs" in g) == ("prompt_logprobs" in w), key
        if "prompt_logprobs" in w:
            close_vllm(g["prompt_logprobs"], w["prompt_logprobs"])
        assert got[key]["usage"]["completion_tokens"] == reference[key]["usage"]["completion_tokens"], key
    assert got["chat"]["choices"][0]["message"] == reference["chat"]["choices"][0]["message"]
    close_vllm(got["chat"]["prompt_logprobs"], reference["chat"]["prompt_logprobs"])
    # streamed: the prompt's part first, with the first tokens; joined, the unary answer
    chunks = got["streamed_b"]
    assert chunks[0]["choices"][0]["token_ids"] and chunks[0]["choices"][0]["text"].startswith(B)
    joined: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for ch in c["choices"]:
            for k in joined:
                joined[k] += (ch["logprobs"] or {}).get(k, [])
    want = {k: [] for k in joined}
    for c in reference["streamed_b"]:
        for ch in c["choices"]:
            for k in want:
                want[k] += (ch["logprobs"] or {}).get(k, [])
    close_logprobs(joined, want)
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]) == 3
    # the prefix cache: every request that asked was computed whole, and A's blocks still served B without
    assert got["skipped"] == 5, got["skipped"]
    for key in ("loglikelihood_b", "scoring_b", "prompt_logprobs_a", "chat"):
        assert got[key]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, key
    assert got["plain_b"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
