"""P's steps in the planner: which waiting prompts the next step takes (the rule against the
scheduler's own ``build_batch``), a step's prompts waiting for all of it in the simulation, and P's
and D's steps sharing one device. Pure: no processes."""
from __future__ import annotations

import json

import pytest

from pushkv.plan import profile as PR
from pushkv.plan import sim
from pushkv.plan import workload as W
from pushkv.plan.prefill_step import next_step
from pushkv.router.cost import Costs
from pushkv.scheduler.requests import Request, State, build_batch

# name, tokens each waiting prompt computes (arrival order), max_batch_tokens, max_num_seqs, taken
STEPS = [
    ("nothing_waits", [], 8192, 64, 0),
    ("one_prompt", [320], 8192, 64, 1),
    ("three_that_arrived_during_a_step_go_together", [320, 320, 320], 8192, 64, 3),
    ("the_budget_is_inclusive", [4096, 4096, 4096, 4096], 16384, 64, 4),
    ("the_budget_cuts_the_fourth", [4096, 4096, 4096, 4096, 1], 12288, 64, 3),
    ("the_first_goes_whole_past_the_budget", [20000, 10], 16384, 64, 1),
    ("a_prompt_that_does_not_fit_holds_the_ones_behind_it", [100, 900, 10], 1000, 64, 2),
    ("fifo_not_best_fit", [600, 600, 10], 1000, 64, 1),
    ("max_num_seqs", [10, 10, 10, 10], 8192, 2, 2),
    ("budget_0_one_a_step", [10, 10], 0, 64, 1),
]


@pytest.mark.parametrize("name,waiting,budget,seqs,taken", STEPS, ids=[s[0] for s in STEPS])
def test_next_step(name, waiting, budget, seqs, taken):
    assert next_step(waiting, budget, seqs) == taken


@pytest.mark.parametrize("name,waiting,budget,seqs,taken", [s for s in STEPS if s[2] and s[1]],
                         ids=[s[0] for s in STEPS if s[2] and s[1]])
def test_next_step_is_the_schedulers_rule(name, waiting, budget, seqs, taken):
    """P's scheduler (no decodes, no chunking) takes the same prompts: the planner's rule is its."""
    pre = [Request(f"t{i}", 0, "prefill", tuple(range(n)), 1, b"", seq_id=i, state=State.PREFILL, blocks=[i])
           for i, n in enumerate(waiting)]
    assert len(build_batch(pre, [], seqs, budget, 0)) == taken


def test_next_step_refuses_a_budget_that_takes_nothing():
    with pytest.raises(ValueError, match="max_num_seqs >= 1"):
        next_step([10], 8192, 0)
    with pytest.raises(ValueError, match="max_batch_tokens -1 < 0"):
        PR.Profile("t", Costs(), max_batch_tokens=-1)


# a prompt of 320 tokens: 2 + 160 = 162 ms; the handoff 3 + 20 blocks = 23 ms; a decode step of one 11 ms
C = Costs(prefill_ms_fixed=2.0, prefill_ms_per_token=0.5, prefill_ms_per_cached_token=0.0,
          handoff_ms_fixed=3.0, handoff_ms_per_block=1.0, step_ms_fixed=10.0, step_ms_per_seq=1.0,
          step_ms_per_kctx=0.0)


def ends(budget: int, starts=(0.0, 0.010, 0.020, 0.030), **kw) -> list[float]:
    wl = W.Arrivals(starts, (320,) * len(starts), 2)
    reqs = sim.simulate(wl, PR.Profile("t", C, max_batch_tokens=budget, **kw), "push", 1, 4)
    return [r.prefill_end for r in sorted(reqs, key=lambda r: r.arrival)]


@pytest.mark.parametrize("budget, expected", [
    # the three that arrive during the first prefill go in the next step together: one fixed part,
    # 960 tokens, and each waits for all of it
    (8192, [162, 162 + 482, 162 + 482, 162 + 482]),
    # a budget of two prompts: the third waits for a step of its own
    (640, [162, 162 + 322, 162 + 322, 162 + 322 + 162]),
    # one prompt a step: FIFO
    (0, [162, 324, 486, 648]),
])
def test_prompts_that_wait_during_a_step_share_the_next(budget, expected):
    assert ends(budget) == pytest.approx(expected, abs=1e-6)


def test_p_and_d_on_one_device_share_it():
    # A's KV lands at 185 and D decodes its 19 steps of 11 ms (209 ms of compute); B arrives at 200
    # and prefills (162 ms) while D steps: the device time-slices, each at half speed, so B's prefill
    # ends at 200 + 2 x 162 = 524 and D's last step at 524 + (194 - 162) = 556
    wl = W.Arrivals((0.0, 0.2), (320, 320), 20)
    a, b = sorted(sim.simulate(wl, PR.Profile("t", C, one_device=True), "push", 1, 1), key=lambda r: r.arrival)
    assert b.prefill_end == pytest.approx(524.0, abs=0.01) and b.prefill_ms == pytest.approx(324.0, abs=0.01)
    assert a.last == pytest.approx(556.0, abs=0.01) and a.tpot_ms > 11.0
    a, b = sorted(sim.simulate(wl, PR.Profile("t", C), "push", 1, 1), key=lambda r: r.arrival)
    assert b.prefill_end == pytest.approx(362.0) and a.tpot_ms == pytest.approx(11.0)  # apart: each alone


def test_push_layer_stores_its_groups_at_the_devices_pace():
    # alone on the device a step's groups are stored at its quarters, so the link model's answer is
    # the same with one device as without
    wl = W.Arrivals((0.0,), (320,), 2)
    prof = PR.Profile("t", C, layer_groups=4, link_window=1)
    (alone,) = sim.simulate(wl, prof, "push-layer", 1, 1)
    (shared,) = sim.simulate(wl, PR.Profile("t", C, layer_groups=4, link_window=1, one_device=True),
                             "push-layer", 1, 1)
    assert shared.ttft_ms == pytest.approx(alone.ttft_ms, abs=0.01) and shared.prefill_end == pytest.approx(162.0)


def test_plan_takes_the_step_budget_and_the_device_from_its_flags(tmp_path):
    from pushkv.plan import cli

    out = tmp_path / "plan.json"
    wl = json.dumps({"kind": "poisson", "qps": 50, "requests": 8, "prompt": [320, 320], "output": 4})
    args = ["--workload", wl, "--profile", "qwen3-32b-tp8-tcp", "--modes", "push", "--out", str(out)]
    assert cli.main(args) == 0
    prof = json.loads(out.read_text())["profile"]
    assert (prof["max_batch_tokens"], prof["one_device"]) == (0, False)  # the profile's: one prompt a step
    assert cli.main([*args, "--max-batch-tokens", "8192", "--max-num-seqs", "4", "--one-device"]) == 0
    prof = json.loads(out.read_text())["profile"]
    assert (prof["max_batch_tokens"], prof["max_num_seqs"], prof["one_device"]) == (8192, 4, True)
    assert cli.main([*args, "--max-num-seqs", "0"]) == 2  # a step that takes nothing: refused
