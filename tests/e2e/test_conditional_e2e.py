"""Conditional disaggregation end to end: real processes over loopback, real NIXL, real torch.

With ``--conditional-disagg`` the router sends each request either to P then D (push, late
or pull) or to D alone, which prefills it itself. A chat-like sequence (a shared system prompt,
a second turn built from the first turn's answer, requests at once so that D is busy) must give
the greedy tokens of local mode with the prefix cache off, on every path, with the cache on and
off; both paths must have been taken, D's counters must say it prefilled the decode-local ones,
and every block must be free at the end.
"""
from __future__ import annotations

import threading

import pytest

from tests.support.deploy import deployment, wait_pools_free
from tools.layout_report import prompt

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 8
NUM_BLOCKS = 96
SYSTEM = prompt(100, 5)


def chat(dep) -> tuple[list[list[int]], list[str]]:
    """Tokens of each request and the path the router says it took."""
    out, paths = [], []

    def one(p, n):
        body = dep.complete(p, n)
        return body["choices"][0]["token_ids"], body["pushkv"]["path"]

    q1 = SYSTEM + prompt(20, 11)
    for q, n in ((q1, 24), (SYSTEM + prompt(37, 12), MAX_TOKENS)):
        toks, path = one(q, n)
        out.append(toks)
        paths.append(path)
    turn2 = q1 + out[0] + prompt(30, 13)
    toks, path = one(turn2, MAX_TOKENS)
    out.append(toks)
    paths.append(path)
    # three at once: the later ones find D busy decoding the first
    prompts = [SYSTEM + prompt(150, 20 + i) for i in range(3)]
    got: list = [None] * 3
    errs: list = []

    def run(i):
        try:
            got[i] = one(prompts[i], 24)
        except Exception as e:  # surfaced below
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(240)
    assert not errs, errs
    out += [g[0] for g in got]
    paths += [g[1] for g in got]
    return out, paths


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with deployment(tmp_path_factory.mktemp("local"), "--mode", "local", "--model", "small",
                    "--num-blocks", str(NUM_BLOCKS), "--no-prefix-cache") as dep:
        toks, paths = chat(dep)
    assert set(paths) == {"local"}
    return toks


CASES = [
    ("push cache", ("--mode", "push", "--push-pin-fraction", "1")),
    ("push no cache", ("--mode", "push", "--push-pin-fraction", "1", "--no-prefix-cache")),
    ("pull cache", ("--mode", "pull", "--pull-read", "background")),
]


@pytest.mark.parametrize("name,flags", CASES, ids=[c[0] for c in CASES])
def test_every_path_gives_the_tokens_of_local(name, flags, reference, tmp_path):
    with deployment(tmp_path, *flags, "--conditional-disagg", "--model", "small",
                    "--num-blocks", str(NUM_BLOCKS)) as dep:
        toks, paths = chat(dep)
        assert toks == reference, paths
        split = "pull" if "pull" in flags else "push"
        assert "decode-local" in paths and split in paths, paths
        stats = wait_pools_free(dep)
        assert stats["decode"].counters.get("local_prefills", 0) == paths.count("decode-local")
        health = dep.health()
        assert health["conditional_disagg"] is True
        costs = health["costs"]
        split_n = sum(p != "decode-local" for p in paths)
        assert costs["prefill_samples"] == split_n and costs["local_samples"] == len(paths) - split_n, costs
        # a request whose decode steps also ran a prefill on D is no step sample; the rest are
        assert 1 <= costs["step_samples"] <= len(paths), costs
        assert costs["handoff_samples"] == split_n, costs
        if "--no-prefix-cache" not in flags:
            # turn 2 went to D alone, which held turn 1's prompt and answer
            assert paths[2] == "decode-local", paths
            assert stats["decode"].counters.get("prefix_hit_tokens", 0) >= 112
