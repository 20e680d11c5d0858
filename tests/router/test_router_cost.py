"""The router's cost model: fits (tables of synthetic deployments), priors, outliers, and what a
timeline yields. Pure: no processes."""
from __future__ import annotations

import random

import pytest

from pushkv.router import cost as C


def test_no_samples_gives_the_prior():
    c = C.CostModel().costs
    assert c == C.Costs()
    assert c.prefill_ms(100, 50) == pytest.approx(5.0 + 100 * 1.0 + 50 * 0.01)


# (true parameters of one fit, regressor generator) -> the fit recovers them within 3 %
TRUTHS = [
    ("prefill", (3.0, 0.4, 0.002), lambda r: (1.0, r.randint(16, 4096), r.randint(0, 4096))),
    ("prefill", (40.0, 2.5, 0.0), lambda r: (1.0, r.randint(16, 2048), r.choice((0, 512, 1024)))),
    ("handoff", (1.5, 0.05), lambda r: (1.0, r.randint(1, 512))),
    ("handoff", (30.0, 3.0), lambda r: (1.0, r.randint(1, 64))),
    ("step", (12.0, 2.0, 0.5), lambda r: (1.0, (b := r.randint(1, 16)), b * r.randint(100, 8000) / 1000)),
    ("local", (8.0, 0.05), lambda r: (1.0, r.randint(16, 1024))),
]


@pytest.mark.parametrize("fit,truth,gen", TRUTHS)
def test_fit_recovers_a_synthetic_deployment(fit, truth, gen):
    r = random.Random(7)
    model = C.CostModel()
    for _ in range(200):
        x = gen(r)
        ms = sum(a * b for a, b in zip(truth, x)) + r.uniform(-0.02, 0.02)
        model.add([C.Sample(fit, x, ms)])
    names = C.PRIORS[fit][0]
    got = model.costs.as_dict()
    for name, want in zip(names, truth):
        scale = max(abs(want), 0.05 * max(truth))  # a zero coefficient: within 3 % of the largest
        assert abs(got[name] - want) <= 0.03 * scale, (name, got[name], want)
    assert got[f"{fit}_samples"] == 200


def test_a_few_samples_move_the_fit_and_enough_of_them_decide_it():
    prior = C.Costs().handoff_ms(32)
    model = C.CostModel()
    # every sample at one size: the data say the total there, the prior the split with the intercept
    model.add([C.Sample("handoff", (1.0, 32.0), 40.0) for _ in range(6)])
    few = model.costs.handoff_ms(32)
    assert prior < few < 40.0 and few == pytest.approx(40.0, rel=0.15)
    model.add([C.Sample("handoff", (1.0, 32.0), 40.0) for _ in range(C.ENOUGH)])
    c = model.costs
    assert c.handoff_ms(32) == pytest.approx(40.0, rel=0.01)
    assert c.handoff_ms_fixed >= 0 and c.handoff_ms_per_block >= 0


def test_outliers_do_not_move_the_fit():
    r = random.Random(3)
    model = C.CostModel()
    for i in range(100):
        n = r.randint(64, 2048)
        ms = 2.0 + 0.5 * n
        if i % 25 == 0:
            ms *= 20  # a stall
        model.add([C.Sample("prefill", (1.0, float(n), 0.0), ms)])
    assert model.costs.prefill_ms_per_token == pytest.approx(0.5, rel=0.02)


def test_bad_samples_are_ignored_and_the_window_is_bounded():
    model = C.CostModel(window=10)
    model.add([C.Sample("prefill", (1.0, 10.0, 0.0), float("nan")), C.Sample("prefill", (1.0, 10.0, 0.0), -1.0),
               C.Sample("nonsense", (1.0,), 1.0)])
    assert model.costs.prefill_samples == 0
    model.add([C.Sample("prefill", (1.0, 100.0, 0.0), 50.0) for _ in range(30)])
    assert len(model.windows["prefill"]) == 10 and model.costs.prefill_samples == 30


# (timeline, kwargs) -> the samples (fit, x, ms)
T0 = 1000.0
SAMPLES = [
    # push: P prefilled 300 of 320 tokens (20 cached), 2 blocks moved, D decoded 9 tokens at batch 2
    ({"prefill.prefill_start": T0, "prefill.prefill_end": T0 + 0.2, "decode.kv_received": T0 + 0.25,
      "decode.first_token": T0 + 0.26, "decode.finished": T0 + 0.66},
     dict(prompt_tokens=320, output_tokens=9, prefill_leg="prefill", cached_tokens=20, moved_blocks=2,
          decode_batch=2.0),
     [("prefill", (1.0, 300.0, 20.0), 200.0), ("handoff", (1.0, 2.0), 50.0),
      ("step", (1.0, 2.0, 2 * (320 + 4.5) / 1000), 50.0)]),
    # D prefilled it itself: no handoff, and a local prefill sample, not a prefill one
    ({"decode.prefill_start": T0, "decode.prefill_end": T0 + 0.1, "decode.first_token": T0 + 0.1,
      "decode.finished": T0 + 0.2},
     dict(prompt_tokens=64, output_tokens=2, prefill_leg="decode", cached_tokens=48, moved_blocks=0,
          decode_batch=0.5),
     [("local", (1.0, 16.0), 100.0), ("step", (1.0, 1.0, (64 + 1) / 1000), 100.0)]),
    # D registered after P's prefill ended (D's queue): the handoff counts from the registration
    ({"prefill.prefill_start": T0, "prefill.prefill_end": T0 + 0.2, "decode.registration_sent": T0 + 1.2,
      "decode.kv_received": T0 + 1.23},
     dict(prompt_tokens=320, output_tokens=1, prefill_leg="prefill", cached_tokens=0, moved_blocks=20,
          decode_batch=1.0),
     [("prefill", (1.0, 320.0, 0.0), 200.0), ("handoff", (1.0, 20.0), 30.0)]),
    # pull: from D's READ post
    ({"prefill.prefill_start": T0, "prefill.prefill_end": T0 + 0.2, "decode.read_posted": T0 + 0.21,
      "decode.kv_received": T0 + 0.25},
     dict(prompt_tokens=320, output_tokens=1, prefill_leg="prefill", cached_tokens=0, moved_blocks=20,
          decode_batch=1.0),
     [("prefill", (1.0, 320.0, 0.0), 200.0), ("handoff", (1.0, 20.0), 40.0)]),
    # a failed request: P's prefill only
    ({"prefill.prefill_start": T0, "prefill.prefill_end": T0 + 0.01},
     dict(prompt_tokens=10, output_tokens=0, prefill_leg="prefill", cached_tokens=0, moved_blocks=1,
          decode_batch=1.0),
     [("prefill", (1.0, 10.0, 0.0), 10.0)]),
    # one output token: no step sample; nothing moved: no handoff sample
    ({"prefill.prefill_start": T0, "prefill.prefill_end": T0 + 0.01, "decode.kv_received": T0 + 0.02,
      "decode.first_token": T0 + 0.02, "decode.finished": T0 + 0.02},
     dict(prompt_tokens=10, output_tokens=1, prefill_leg="prefill", cached_tokens=0, moved_blocks=0,
          decode_batch=1.0),
     [("prefill", (1.0, 10.0, 0.0), 10.0)]),
]


@pytest.mark.parametrize("timeline,kw,want", SAMPLES)
def test_samples_from_a_timeline(timeline, kw, want):
    got = C.samples(timeline, **kw)
    assert [s.fit for s in got] == [f for f, _, _ in want]
    for s, (_, x, ms) in zip(got, want):
        assert s.x == pytest.approx(x) and s.ms == pytest.approx(ms)


def test_samples_use_what_the_steps_computed_when_the_instances_report_it():
    tl = {"prefill.prefill_start": T0, "prefill.prefill_end": T0 + 0.3, "decode.kv_received": T0 + 0.31,
          "decode.first_token": T0 + 0.31, "decode.finished": T0 + 0.71}
    got = C.samples(tl, 100, 5, prefill_leg="prefill", cached_tokens=50, moved_blocks=4, decode_batch=9.0,
                    prefill_work=(2, 600, 1500), decode_work=(4, 12, 6000, 0))
    pre, _, step = got
    # two steps computed 600 tokens over 1,500 cached ones (other prompts shared them)
    assert pre.x == (2.0, 600.0, 1500.0) and pre.ms == pytest.approx(300.0)
    # 100 ms a token over 4 steps of 3 sequences with 1.5k of context each
    assert step.x == pytest.approx((1.0, 3.0, 1.5)) and step.ms == pytest.approx(100.0)
    # steps that also prefilled a prompt on D: no step sample (the prefill is not the batch's cost)
    got = C.samples(tl, 100, 5, prefill_leg="prefill", cached_tokens=50, moved_blocks=4, decode_batch=9.0,
                    prefill_work=(2, 600, 1500), decode_work=(4, 12, 6000, 200))
    assert [s.fit for s in got] == ["prefill", "handoff"]


def test_a_prefill_on_d_is_priced_at_ds_own_prices_once_d_has_prefilled():
    r = random.Random(3)
    model = C.CostModel()
    for _ in range(40):  # P prefills at 5 ms + 0.2 ms a token
        n = r.randint(64, 4096)
        model.add([C.Sample("prefill", (1.0, n, 0.0), 5.0 + 0.2 * n)])
    c = model.costs
    assert c.local_samples == 0 and c.local_prefill_ms(1000) == pytest.approx(205.0, rel=0.03)
    for _ in range(40):  # D prefills at 8 ms + 0.05 ms a token
        n = r.randint(16, 1024)
        model.add([C.Sample("local", (1.0, n), 8.0 + 0.05 * n)])
    c = model.costs
    assert c.local_samples == 40 and c.local_prefill_ms(1000, 4096) == pytest.approx(58.0, rel=0.05)
    assert c.local_ms_per_token == pytest.approx(0.05, rel=0.05)
    assert c.prefill_ms(1000) == pytest.approx(205.0, rel=0.03)  # P's own prices stay P's


def test_p_is_priced_at_ds_prices_while_p_has_prefilled_nothing():
    model = C.CostModel()  # every request so far prefilled on D (conditional disaggregation)
    r = random.Random(4)
    for _ in range(40):
        n = r.randint(16, 1024)
        model.add([C.Sample("local", (1.0, n), 8.0 + 0.05 * n)])
    c = model.costs
    assert c.prefill_samples == 0 and c.prefill_ms(1000) == pytest.approx(58.0, rel=0.05)


def test_pushkv_status_prints_the_cost_model_on_one_line():
    from pushkv.supervisor.deployments import format_costs

    line = format_costs(C.Costs(prefill_samples=3).as_dict())
    assert line.startswith("cost model: prefill 5.00 + 1.0000/token") and "(3 samples)" in line
    assert "\n" not in line and "decode step 20.00" in line and "D's own prefill 5.00" in line
