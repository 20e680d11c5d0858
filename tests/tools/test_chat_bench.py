"""The chat workload (tools/chat_bench.py): the conversations it makes, what it counts as
reusable, its per-turn summary, and a real run against a local deployment."""
from __future__ import annotations

import asyncio

import pytest

from tools import chat_bench as cb


def test_conversations_are_seeded_and_within_their_ranges():
    a = cb.make_conversations(20, 2.0, (2, 8), (4, 9), 0.5, 100, seed=3)
    b = cb.make_conversations(20, 2.0, (2, 8), (4, 9), 0.5, 100, seed=3)
    assert [c.user_turns for c in a] == [c.user_turns for c in b]
    assert all(2 <= len(c.user_turns) <= 8 and all(4 <= len(u) <= 9 for u in c.user_turns) for c in a)
    assert all(0 < tok < 100 for c in a for u in c.user_turns for tok in u)
    starts = [c.start_s for c in a]
    assert starts == sorted(starts) and starts[0] > 0
    assert cb.make_conversations(3, 0.0, (2, 2), (1, 1), 0.0, 10, 0)[2].start_s == 0.0  # rate 0: all at once


@pytest.mark.parametrize("prompt, sent, want", [
    ([1, 2, 3], [], 0),
    ([1, 2, 3], [[1, 2, 9]], 2),
    ([1, 2, 3], [[1, 2, 3, 4], [1]], 3),
    ([5, 2, 3], [[1, 2, 3]], 0),
])
def test_longest_sent_prefix(prompt, sent, want):
    assert cb.longest_sent_prefix(prompt, sent) == want


def _r(turn, prompt_len, reusable, ttft, tpot=0.01, cached=None, ok=True, path="local"):
    return cb.TurnResult(0, turn, prompt_len, reusable, ok=ok, ttft_s=ttft, tpot_s=tpot, cached=cached, path=path)


def test_summary_per_turn_and_for_every_later_turn():
    rows = cb.summarize([_r(1, 100, 50, 0.2), _r(2, 200, 150, 0.05, cached=100), _r(2, 200, 150, 0.07, cached=120),
                         _r(3, 300, 280, 0.04, ok=False)])
    by = {r["turn"]: r for r in rows}
    assert [r["turn"] for r in rows] == ["1", "2", "3", ">=2"]
    assert by["1"]["reusable"] == 0.5 and by["1"]["cached"] is None
    assert by["2"]["ttft_p50"] == pytest.approx(60.0) and by["2"]["cached"] == pytest.approx(220 / 400)
    assert by["3"]["failed"] == 1 and by[">=2"]["requests"] == 3 and by[">=2"]["failed"] == 1
    assert "turn" in cb.format_rows(rows)


def test_request_path():
    assert cb.request_path({"instances": {"local": "e"}}) == "local"
    ext = {"instances": {"prefill": "p", "decode": "d"}, "allocation": "early", "kv": {"prefill": {"stream": "layer"}}}
    assert cb.request_path(ext) == "P->D push (layer)"
    assert cb.request_path({"instances": {"prefill": "p", "decode": "d"}, "allocation": "late"}) == "P->D pull"
    assert cb.request_path({"instances": {"prefill": "p", "decode": "d"}, "path": "late"}) == "P->D late"
    assert cb.request_path({"instances": {"decode": "d"}, "path": "decode-local"}) == "D only"


@pytest.mark.timeout(180)
def test_a_chat_run_against_a_deployment(tmp_path):
    """Every turn answers; turn k's prompt begins with turn k-1's prompt and answer, so the
    reusable share of later turns is at least what the conversation repeats."""
    from tools.launch import launched

    convs = cb.make_conversations(3, 0.0, (2, 3), (4, 8), 0.0, 200, seed=1)
    system = cb.system_prompt(48, 200, 1)
    with launched("--mode", "local", "--model", "small", "--num-blocks", "256", start_timeout_s=120) as dep:
        results = asyncio.run(cb.run_chat(dep.url, convs, system, 4))
    assert len(results) == sum(len(c.user_turns) for c in convs) and all(r.ok for r in results)
    for r in results:
        assert len(r.output) == 4 and r.ttft_s > 0
        if r.turn >= 2:  # the system prompt, the earlier turns and their answers
            assert r.reusable >= r.prompt_len - 8
    # every first turn but the very first request repeats the shared system prompt
    assert sum(r.reusable < 48 for r in results if r.turn == 1) == 1
    rows = {row["turn"]: row for row in cb.summarize(results)}
    assert rows[">=2"]["failed"] == 0 and rows[">=2"]["reusable"] > 0.8


def test_a_turns_tpot_is_on_the_routers_clock_as_its_ttft():
    """TTFT came from the router's timeline and TPOT from the client's wall time less that TTFT, so the HTTP round
    trip and the answer's serialisation (here 40 ms) were spread over the tokens as if decoding."""
    tl = {"router.arrival": 100.0, "router.first_token": 100.05, "router.finish": 100.25}
    ttft, tpot = cb.turn_times(tl, wall_s=0.29, n=5)
    assert ttft == pytest.approx(0.05) and tpot == pytest.approx(0.05)
    assert cb.turn_times({}, wall_s=0.29, n=1) == (0.29, None)  # no timeline: the client's wall time
