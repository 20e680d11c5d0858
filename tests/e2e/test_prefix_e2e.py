"""Prefix caching end to end: real processes over loopback, real NIXL, real torch compute.

A chat-like sequence of requests (a shared system prompt with different questions, a repeated
prompt, a second turn that repeats the first turn's prompt and answer, two identical prompts at
once) must give the same greedy tokens with the prefix cache on, in local, push (whole and
chunk-streamed) and pull, as local mode with the cache off; the instance that prefills must
have found the cached prefixes (its counters say how many tokens it did not compute again),
and every block must be allocatable again at the end.
"""
from __future__ import annotations

import pytest

from tests.support.deploy import concurrent, deployment, wait_pools_free
from tools.layout_report import prompt

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 8
NUM_BLOCKS = 64
SYSTEM = prompt(100, 5)  # six full blocks of 16 shared by every question


def conversation(dep, after=lambda: None) -> list[list[int]]:
    """The requests, in order; later prompts are built from earlier answers as a chat would.
    ``after()`` runs after each of the first four (one at a time)."""
    q1, q2 = SYSTEM + prompt(20, 11), SYSTEM + prompt(37, 12)
    out = []
    for q, n in ((q1, 24), (q2, MAX_TOKENS), (q1, MAX_TOKENS)):
        out.append(dep.tokens(q, n))
        after()
    turn2 = q1 + out[0] + prompt(30, 13)  # the first turn's prompt and answer, and a follow-up
    out.append(dep.tokens(turn2, MAX_TOKENS))
    after()
    out += concurrent(dep, [turn2 + prompt(5, 14)] * 2, MAX_TOKENS)
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """get(model, tp) -> the conversation's tokens in local mode with the cache off, each (model,
    tp) deployment started once (P's TP: the KV is then produced by the same per-rank computation)."""
    cache: dict = {}

    def get(model: str, tp: int) -> list[list[int]]:
        if (model, tp) not in cache:
            with deployment(tmp_path_factory.mktemp(f"local-{model}-tp{tp}"), "--mode", "local", "--model", model,
                            "--tp", str(tp), "--num-blocks", str(NUM_BLOCKS), "--no-prefix-cache") as dep:
                cache[(model, tp)] = conversation(dep)
                assert dep.stats("local").counters.get("prefix_queries", 0) == 0
        return cache[(model, tp)]

    return get


def shape(p_tp: int, d_tp: int, p_bs: int, d_bs: int) -> tuple[str, ...]:
    return ("--prefill-tp", str(p_tp), "--decode-tp", str(d_tp),
            "--prefill-block-size", str(p_bs), "--decode-block-size", str(d_bs))


PUSH_CHUNK = ("--mode", "push", "--push-stream", "chunk", "--prefill-chunk", "32", "--push-pin-fraction", "1")
PULL = ("--mode", "pull", "--pull-read", "background")
# id, model, flags, TP of the reference, who computes the prompt, exact hits (block size 16 on both sides)
CASES = [
    ("local", "small", ("--mode", "local"), 1, "local", True),
    ("push", "small", ("--mode", "push"), 1, "prefill", True),
    ("push-chunk", "small", PUSH_CHUNK, 1, "prefill", True),
    ("pull", "small", PULL, 1, "prefill", True),
    ("push tp2->1 p16/d32", "small", ("--mode", "push") + shape(2, 1, 16, 32), 2, "prefill", False),
    ("pull tp1->2 p32/d16", "small", PULL + shape(1, 2, 32, 16), 1, "prefill", False),
    ("push-chunk mla tp2->1", "mla", PUSH_CHUNK + shape(2, 1, 16, 16), 2, "prefill", True),
    ("local hybrid", "hybrid", ("--mode", "local"), 1, "local", True),
    ("push hybrid", "hybrid", ("--mode", "push"), 1, "prefill", True),  # D neither hits nor keeps
]


@pytest.mark.parametrize("name,model,flags,ref_tp,computes,exact", CASES, ids=[c[0] for c in CASES])
def test_cached_prefixes_give_the_tokens_of_local_without_cache(name, model, flags, ref_tp, computes, exact,
                                                                 references, tmp_path):
    reference = references(model, ref_tp)
    with deployment(tmp_path, *flags, "--model", model, "--num-blocks", str(NUM_BLOCKS)) as dep:
        roles = [computes] + (["decode"] if computes == "prefill" else [])
        seen = []  # counters of each role after each request

        def after():
            seen.append({role: dict(dep.stats(role).counters) for role in roles})

        assert conversation(dep, after) == reference
        stats = wait_pools_free(dep)

        def per_request(role, key):
            return [b[role].get(key, 0) - a[role].get(key, 0) for a, b in zip([{role: {}}] + seen, seen)]

        d_reuses = computes == "prefill" and model != "hybrid"
        hits = per_request(computes, "prefix_hit_tokens")
        if exact:
            # q1 (120 tokens) misses; q2 hits the system prompt's 6 blocks; q1 again 7 (its last token
            # is computed or moved); turn 2 hits turn 1's prompt, and where turn 1 decoded (local, D)
            # also its first answer tokens: block 8 holds prompt tokens 112-119 and answer tokens 0-7
            assert hits == [0, 96, 112, 128 if computes == "local" else 112], seen
        else:
            assert hits[0] == 0 and min(hits[1:]) > 0, hits
        if computes == "prefill":
            d_hits = per_request("decode", "prefix_hit_tokens")
            if not d_reuses:  # window layers move only the window: D keeps nothing
                assert d_hits == [0] * 4 and stats["decode"].cached_blocks == 0, seen
            else:
                if exact:
                    assert d_hits == [0, 96, 112, 128], seen  # D keeps turn 1's prompt and answer
                else:
                    assert d_hits[0] == 0 and min(d_hits[1:]) > 0, d_hits
                side = "decode" if "pull" in flags else "prefill"  # who measured the transfer (P: parts too)
                moved = per_request(side, "kv_bytes")
                assert moved[2] * 3 < moved[0], moved  # q1 again: only its tail moves
                assert stats["decode"].cached_blocks > 0
        c = stats[computes].counters
        assert c["prefix_queries"] == 6 and c["prefix_hits"] >= 5, c
        assert stats[computes].cached_blocks > 0
