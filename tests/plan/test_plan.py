"""pushkv plan: the simulation's arithmetic on lone requests (tables against the cost model by
hand), its queueing and memory, prefix reuse in chats, and the CLI. Pure: no processes."""
from __future__ import annotations

import json

import pytest

from pushkv.plan import cli, sim
from pushkv.plan import profile as PR
from pushkv.plan import workload as W
from pushkv.router.cost import Costs

C = Costs(prefill_ms_fixed=2.0, prefill_ms_per_token=0.5, prefill_ms_per_cached_token=0.0,
          handoff_ms_fixed=3.0, handoff_ms_per_block=1.0, step_ms_fixed=10.0, step_ms_per_seq=1.0,
          step_ms_per_kctx=0.0)
PROF = PR.Profile("t", C, block_size=16, relay_ms=4.0, layer_groups=4)
LONE = W.Poisson(1.0, 1, (320, 320), 5)  # 320 tokens: 20 blocks; 5 tokens out


# mode -> (TTFT, TPOT) of one lone request, by hand:
# prefill 2 + 160 = 162; handoff 3 + 20 = 23; a decode step of one: 11
LONE_CASES = [
    ("push", 162 + 23, 11.0),
    ("push-layer", 162 + 3 + 5, 11.0),  # a quarter of the 20 ms is left after the prefill
    ("pull", 162 + 23 + 4, 11.0),  # the relay through the router
    ("pull-inline", 162 + 23 + 4, 11.0),  # D's engine waits for the READ, but nothing else runs
    ("local", 162, 11.0),  # the first token at the end of the prefill's step
    ("conditional", 162, 11.0),  # an idle D: it prefills itself (at P's prices: D has not prefilled yet)
]


@pytest.mark.parametrize("mode,ttft,tpot", LONE_CASES)
def test_a_lone_request(mode, ttft, tpot):
    (r,) = sim.simulate(LONE, PROF, mode, 1, 1)
    assert r.ttft_ms == pytest.approx(ttft) and r.tpot_ms == pytest.approx(tpot)
    assert r.tokens == 5


def test_pull_inline_stalls_what_d_is_decoding():
    two = W.Poisson(1e6, 2, (320, 320), 64)  # both at once: the second's READ lands while the first decodes
    inline = sim.simulate(two, PROF, "pull-inline", 2, 1)
    background = sim.simulate(two, PROF, "pull", 2, 1)
    assert sum(r.tpot_ms for r in inline) > sum(r.tpot_ms for r in background)


def test_p_queues_fifo_and_more_p_shortens_the_queue():
    burst = W.Poisson(1e6, 4, (320, 320), 2)  # four at once
    one = sorted(r.ttft_ms for r in sim.simulate(burst, PROF, "push", 1, 4))
    assert one == pytest.approx([162 * k + 23 for k in range(1, 5)], abs=0.01)
    two = sorted(r.ttft_ms for r in sim.simulate(burst, PROF, "push", 2, 4))
    assert two == pytest.approx([185, 185, 162 * 2 + 23, 162 * 2 + 23], abs=0.01)


def test_d_memory_makes_requests_wait_and_push_pins_it_earlier():
    prof = PR.Profile("t", C, block_size=16, relay_ms=4.0, d_capacity_tokens=325)  # one request at a time
    burst = W.Poisson(1e6, 2, (320, 320), 5)
    reqs = sim.simulate(burst, prof, "pull", 2, 1)
    first, second = sorted(reqs, key=lambda r: r.ttft_ms)
    # both prefill at once on two P; the second's D leg waits until the first has finished on D
    assert first.ttft_ms == pytest.approx(189)
    assert second.ttft_ms == pytest.approx(189 + 4 * 11 + 23 + 4)
    pushed = sim.simulate(burst, prof, "push", 2, 1, pin_fraction=1.0)
    assert {r.path for r in pushed} == {"push", "late"}  # the second could not pin D at arrival


def test_chat_reuse_lowers_later_turns_and_the_cache_off_does_not():
    chat = W.Chat(rate=1.0, conversations_n=6, turns=(3, 3), system=512, user=(32, 32), output=8, think_s=0.5)
    on = sim.summary(sim.simulate(chat, PROF, "push", 1, 1), ">=2")
    off = sim.summary(sim.simulate(chat, PROF, "push", 1, 1, prefix_cache=False), ">=2")
    assert on["requests"] == off["requests"] == 12
    assert on["ttft_p50"] * 5 < off["ttft_p50"]


def test_conditional_splits_when_d_is_busy():
    busy = W.Poisson(50.0, 40, (320, 320), 32)
    paths = sim.summary(sim.simulate(busy, PROF, "conditional", 1, 1))["paths"]
    assert paths.get("decode-local", 0) > 0 and paths.get("push", 0) > 0, paths


def test_workloads_are_seeded_and_chat_prompts_grow_from_the_last_answer():
    chat = W.Chat(2.0, 3, (2, 4), 100, (10, 20), 5, 0.1, seed=3)
    a, b = chat.conversations(), chat.conversations()
    assert [[t.prompt for t in c] for c in a] == [[t.prompt for t in c] for c in b]
    for turns in a:
        for prev, t in zip(turns, turns[1:]):
            assert t.history == prev.prompt + prev.output and t.prompt > t.history
    with pytest.raises(ValueError):
        W.from_dict({"kind": "nonsense"})
    with pytest.raises(ValueError):
        sim.simulate(LONE, PROF, "teleport", 1, 1)


def test_cli_prints_every_mode_and_ratio(tmp_path, capsys):
    prof = tmp_path / "health.json"
    prof.write_text(json.dumps({"costs": C.as_dict()}))  # a router's /health body is a profile
    out = tmp_path / "plan.json"
    wl = json.dumps({"kind": "poisson", "qps": 5, "requests": 20, "prompt": [320, 640], "output": 8})
    assert cli.main(["--workload", wl, "--profile", str(prof), "--instances", "4", "--modes", "push", "pull",
                     "local", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["mode"], r["p"], r["d"]) for r in rows} == {
        ("push", 1, 3), ("push", 2, 2), ("push", 3, 1), ("pull", 1, 3), ("pull", 2, 2), ("pull", 3, 1), ("local", 0, 4)}
    assert "push" in capsys.readouterr().out
    assert cli.main(["--workload", "{", "--profile", str(prof)]) == 2
