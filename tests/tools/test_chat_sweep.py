"""pushkv chat-sweep's pure parts: the planner's twin of a chat bench's arguments, and one run's line.
(The sweep itself starts deployments: docs/results/chat_gpu is what it measured.)"""
from __future__ import annotations

from tools import chat_bench as CB
from tools import chat_sweep as CS

ARGS = "--conversations 6 --rate 3 --turns 2 4 --system-len 256 --user-len 16 32 --output-len 8 --think-s 0.1"


def test_the_planner_simulates_the_workload_the_bench_sends():
    b = CB.parse_args(ARGS.split() + ["--seed", "5"])
    sim_convs = CS.workload_of(b).conversations()
    bench = CB.make_conversations(6, 3.0, (2, 4), (16, 32), 0.1, b.vocab, 5)
    assert len(sim_convs) == len(bench) == 6
    for turns, conv in zip(sim_convs, bench):  # the very conversations the bench sends
        assert len(turns) == len(conv.user_turns) and turns[0].start_s == conv.start_s
        prompt = 256
        for k, (t, user) in enumerate(zip(turns, conv.user_turns), start=1):
            prompt = (prompt + 8 if k > 1 else 256) + len(user)  # the history, its answer and the new turn
            assert (t.index, t.prompt, t.shared) == (k, prompt, 256)
            assert t.think_s == (conv.think_s[k - 2] if k > 1 else 0.0)


def test_a_runs_line_sets_measured_against_simulated():
    b = CB.parse_args(ARGS.split())
    costs = {"prefill_ms_fixed": 1.0, "prefill_ms_per_token": 0.1, "step_ms_fixed": 5.0, "step_ms_per_seq": 0.5}
    simulated = CS.simulated(b, {"costs": costs}, 1, 1, cache=True, cond=False)
    assert simulated["1"]["requests"] == 6 and simulated[">=2"]["requests"] > 0
    measured = {"1": {"ttft_p50": 50.0, "failed": 0},
                ">=2": {"ttft_p50": 2 * simulated[">=2"]["ttft_p50"], "ttft_p99": 99.0,
                        "tpot_p50": simulated[">=2"]["tpot_p50"], "reusable": 0.9, "cached": 0.8,
                        "paths": {"P->D push": 7}, "failed": 0}}
    line = CS.format_run({"layout": "1p1d", "cache": True, "conditional": False, "rep": 0,
                          "measured": measured, "simulated": simulated})
    assert "  -50%" in line  # the simulation's TTFT on turns >= 2 is half the measured one
    assert "   +0%" in line  # its TPOT equals it
    assert "P->D push: 7" in line and "90%" in line
