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


def conversation(dep) -> list[list[int]]:
    """The requests, in order; later prompts are built from earlier answers as a chat would."""
    q1, q2 = SYSTEM + prompt(20, 11), SYSTEM + prompt(37, 12)
    out = [dep.tokens(q1, MAX_TOKENS), dep.tokens(q2, MAX_TOKENS), dep.tokens(q1, MAX_TOKENS)]
    turn2 = q1 + out[0] + prompt(30, 13)
    out.append(dep.tokens(turn2, MAX_TOKENS))
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
        assert conversation(dep) == reference
        stats = wait_pools_free(dep)
        c = stats[computes].counters
        assert c["prefix_queries"] == 6, c
        # q2 hits the system prompt's 6 blocks, q1 again its 7, turn 2 its first turn's 8 (of
        # 128 tokens with KV), the two at once at least turn 2's 9 each (one may compute them
        # beside the other)
        assert c["prefix_hits"] >= 4 and c["prefix_hit_tokens"] >= (6 + 7 + 8) * 16, c
        assert stats[computes].cached_blocks > 0
        if computes == "prefill":  # D keeps the prompts that arrived (for a later turn)
            assert stats["decode"].cached_blocks > 0
