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

from tests.deploy import concurrent, deployment, wait_pools_free
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
def reference(tmp_path_factory):
    with deployment(tmp_path_factory.mktemp("local-nocache"), "--mode", "local", "--num-blocks", str(NUM_BLOCKS),
                    "--no-prefix-cache") as dep:
        got = conversation(dep)
        assert dep.stats("local").counters.get("prefix_queries", 0) == 0
    return got


CASES = [
    ("local", ("--mode", "local"), "local"),
    ("push", ("--mode", "push"), "prefill"),
    ("push-chunk", ("--mode", "push", "--push-stream", "chunk", "--prefill-chunk", "32",
                    "--push-pin-fraction", "1"), "prefill"),
    ("pull", ("--mode", "pull", "--pull-read", "background"), "prefill"),
]


@pytest.mark.parametrize("name,flags,computes", CASES, ids=[c[0] for c in CASES])
def test_cached_prefixes_give_the_tokens_of_local_without_cache(name, flags, computes, reference, tmp_path):
    with deployment(tmp_path, *flags, "--num-blocks", str(NUM_BLOCKS)) as dep:
        roles = [computes] + (["decode"] if computes == "prefill" else [])
        seen = []  # counters of each role after each request

        def after():
            seen.append({role: dict(dep.stats(role).counters) for role in roles})

        assert conversation(dep, after) == reference
        stats = wait_pools_free(dep)

        def hits(role):  # prompt tokens found cached, per request
            return [b[role].get("prefix_hit_tokens", 0) - a[role].get("prefix_hit_tokens", 0)
                    for a, b in zip([{role: {}}] + seen, seen)]

        # q1 (120 tokens) misses; q2 hits the system prompt's 6 blocks; q1 again 7 (its last token
        # is computed or moved); turn 2 hits turn 1's prompt, and where turn 1 decoded (local, D)
        # also its first answer tokens: block 8 holds prompt tokens 112-119 and answer tokens 0-7
        assert hits(computes) == [0, 96, 112, 128 if computes == "local" else 112], seen
        if computes == "prefill":
            assert hits("decode") == [0, 96, 112, 128], seen  # D keeps turn 1's prompt and answer
            side = "decode" if "pull" in flags else "prefill"  # who measured the transfer (P: parts too)
            moved = [b[side]["kv_bytes"] - a[side].get("kv_bytes", 0) for a, b in zip([{side: {}}] + seen, seen)]
            assert moved[2] * 4 < moved[0], moved  # q1 again: only its last block moves
            assert stats["decode"].cached_blocks > 0
        c = stats[computes].counters
        assert c["prefix_queries"] == 6 and c["prefix_hits"] >= 5, c
        assert stats[computes].cached_blocks > 0
