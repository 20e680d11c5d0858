"""The planner's link model (pushkv/plan/link.py) and the simulation over it: transfers that share
a link's rate, the writer's window and order deciding which go when, and what that does to TTFT
(tables by hand). Pure: no processes."""
from __future__ import annotations

import dataclasses
import json

import pytest

from pushkv.plan import cli, sim
from pushkv.plan import profile as PR
from pushkv.plan import workload as W
from pushkv.plan.link import Link, LinkSpec, finish_times, path_rate
from pushkv.protocol.link_queue import LinkPost, Window
from pushkv.router.cost import Costs

pytestmark = pytest.mark.timeout(60)


def post(pid, nbytes, remaining=0, deadline=0.0):
    return LinkPost(pid, pid, nbytes, remaining, deadline)


# (window posts, overlap share, offers (t, id, size)) -> end of each post; rate 1 unit/ms
SHARING = [
    (0, 1.0, [(0, "a", 10), (0, "b", 10)], {"a": 20, "b": 20}),  # two at once share the rate
    (1, 1.0, [(0, "a", 10), (0, "b", 10)], {"a": 10, "b": 20}),  # one at a time: the first is done at 10
    (0, 0.5, [(0, "a", 10), (0, "b", 10)], {"a": 40, "b": 40}),  # overlapping, the link moves half
    (1, 0.5, [(0, "a", 10), (0, "b", 10)], {"a": 10, "b": 20}),  # the window keeps the link's whole rate
    (0, 1.0, [(0, "a", 10), (5, "b", 10)], {"a": 15, "b": 20}),  # b joins a with 5 left: both at half
    (2, 1.0, [(0, "a", 10), (0, "b", 10), (0, "c", 10)], {"a": 20, "b": 20, "c": 30}),
    (0, 1.0, [(0, "a", 0)], {"a": 0}),  # nothing to move ends at once
]


@pytest.mark.parametrize("window, share, offers, ends", SHARING)
def test_transfers_share_the_link(window, share, offers, ends):
    got = finish_times(LinkSpec(1.0, share), [(t, "w", post(i, n)) for t, i, n in offers],
                       {"w": (Window(window), "arrival")})
    assert got == pytest.approx(ends)


# a 30-unit post holds the link (window 1) while b (20 units, deadline 10) and c (5, deadline 5) queue
ORDERS = [("arrival", {"a": 30, "b": 50, "c": 55}),
          ("shortest", {"a": 30, "c": 35, "b": 55}),
          ("deadline", {"a": 30, "c": 35, "b": 55})]


@pytest.mark.parametrize("order, ends", ORDERS)
def test_the_order_picks_the_next_post(order, ends):
    offers = [(0, "w", post("a", 30, 30, 0.0)), (1, "w", post("b", 20, 20, 10.0)), (2, "w", post("c", 5, 5, 5.0))]
    assert finish_times(LinkSpec(1.0), offers, {"w": (Window(1), order)}) == pytest.approx(ends)


def test_lanes_share_one_rate_each_under_its_own_window():
    # WRITEs one at a time, READs all at once: the READ shares the rate with the WRITE in flight
    offers = [(0, "write", post("w1", 10)), (0, "write", post("w2", 10)), (0, "read", post("r", 10))]
    ends = finish_times(LinkSpec(1.0), offers, {"write": (Window(1), "arrival"), "read": (None, "arrival")})
    assert ends == pytest.approx({"w1": 20, "r": 20, "w2": 30})


# one stream of two lanes (P's WRITEs, window 1; D's READs), rate 1 unit/ms: (offers (t, lane, id,
# size), the lanes' streams) -> each post's end
STREAMS = [
    # the READ went on the wire after w1: it waits for w1, and w2 (on after it) waits for it
    ([(0, "write", "w1", 10), (0, "write", "w2", 10), (5, "read", "r", 10)], {"write": "s", "read": "s"},
     {"w1": 10, "r": 20, "w2": 30}),
    # the same lanes on streams of their own share the link (as test_lanes_share_one_rate...)
    ([(0, "write", "w1", 10), (0, "write", "w2", 10), (5, "read", "r", 10)], {},
     {"w1": 15, "r": 25, "w2": 30}),
    # the READ first: the WRITE waits for it
    ([(0, "read", "r", 10), (1, "write", "w1", 10)], {"write": "s", "read": "s"}, {"r": 10, "w1": 20}),
    # a lane's own posts (no window) move together; another lane's post waits for both
    ([(0, "all", "a", 10), (0, "all", "b", 10), (1, "read", "r", 10)], {"all": "s", "read": "s"},
     {"a": 20, "b": 20, "r": 30}),
    # two streams share the link: s's head and t's move at half the rate each
    ([(0, "write", "w1", 10), (0, "read", "r", 10), (0, "other", "o", 10)], {"write": "s", "read": "s"},
     {"w1": 20, "o": 20, "r": 30}),
]


@pytest.mark.parametrize("offers, streams, ends", STREAMS)
def test_a_stream_moves_its_lanes_in_the_order_they_went_on_the_wire(offers, streams, ends):
    lanes = {"write": (Window(1), "arrival"), "read": (None, "arrival"), "all": (None, "arrival"),
             "other": (None, "arrival")}
    got = finish_times(LinkSpec(1.0), [(t, lane, post(i, n)) for t, lane, i, n in offers], lanes, streams)
    assert got == pytest.approx(ends)


# (the cap, (size, ms) of a mode's lone transfers) -> the rate its transfers move at (units per ms)
PATH_RATES = [
    (1.0, [], 1.0),  # nothing measured: the cap
    (1.0, [(100, 400)], 1.0),  # one size: a slow lone transfer may be its fixed cost, not its path
    (1.0, [(100, 400), (400, 1600)], 0.25),  # a quarter of the cap at every size: the path bounds it
    (1.0, [(100, 130), (400, 430)], 1.0),  # 30 ms at each size over the cap's time: a fixed cost
    (0.5, [(100, 120), (400, 420)], 0.5),  # a path faster than the cap: the cap
    (1.0, [(100, 300), (400, 1200), (400, 1000)], 3 / 8),  # least squares over every transfer (8/3 ms a unit)
    (1.0, [(100, 500), (400, 300)], 1.0),  # longer for fewer bytes: nothing tells a slow path
    # the H200 runs over a veth capped at 10 Gbit/s (9.565 of payload), 144 KiB per token:
    # push-layer's last WRITE (768 and 3072 tokens) at the cap, pull's READ (1024, 4096) at 4.1 (bits per ms)
    (9.565e6, [(768 * 147456 * 8, 95.0), (3072 * 147456 * 8, 379.1)], 9.565e6),
    (9.565e6, [(1024 * 147456 * 8, 272.8), (4096 * 147456 * 8, 1151.9)], 4.1235e6),
]


@pytest.mark.parametrize("cap, lone, rate", PATH_RATES)
def test_a_mode_moves_at_the_lower_of_the_cap_and_its_path(cap, lone, rate):
    assert path_rate(cap, lone) == pytest.approx(rate, rel=1e-3)


@pytest.mark.parametrize("bad", [dict(rate=0.0), dict(rate=1.0, overlap_share=0.0),
                                 dict(rate=1.0, overlap_share=1.5)])
def test_a_link_refuses_what_cannot_be(bad):
    with pytest.raises(ValueError):
        LinkSpec(**bad)


def test_time_never_runs_backwards_on_a_link():
    link = Link(LinkSpec(1.0))
    link.lane("w")
    link.offer(5.0, "w", post("a", 1))
    with pytest.raises(ValueError, match="backwards"):
        link.offer(4.0, "w", post("b", 1))


# --- the simulation over the link model ---------------------------------------------------
def test_a_held_link_moves_nothing_until_every_hold_is_released():
    link = Link(LinkSpec(1.0))
    link.lane("w")
    link.offer(0.0, "w", post("a", 10))
    link.hold(4.0)
    link.hold(5.0)  # two prefills at once: both must end
    assert link.next_end() is None
    link.release(8.0)
    assert link.next_end() is None and link.ended(9.0) == ([], [])
    link.release(9.0)  # 6 left, moving again from 9
    assert link.next_end() == pytest.approx(15.0)
    assert link.ended(15.0)[0] == ["a"] and link.busy_ms == pytest.approx(15.0)
    with pytest.raises(ValueError, match="released more often"):
        link.release(16.0)


C = Costs(prefill_ms_fixed=2.0, prefill_ms_per_token=0.5, prefill_ms_per_cached_token=0.0,
          handoff_ms_fixed=3.0, handoff_ms_per_block=1.0, step_ms_fixed=10.0, step_ms_per_seq=1.0,
          step_ms_per_kctx=0.0)
BASE = PR.Profile("t", C, block_size=16, relay_ms=4.0, layer_groups=4)
LONE = W.Poisson(1.0, 1, (320, 320), 5)  # prefill 162 ms, 20 blocks: 20 ms on the wire


def linked(window=1, order="arrival", share=1.0):
    return dataclasses.replace(BASE, link_window=window, link_order=order, link_overlap_share=share)


@pytest.mark.parametrize("mode", ["push", "push-layer", "pull", "pull-inline"])
def test_a_lone_request_costs_the_same_with_the_link_model(mode):
    (old,) = sim.simulate(LONE, BASE, mode, 1, 1)
    (new,) = sim.simulate(LONE, linked(), mode, 1, 1)
    assert new.ttft_ms == pytest.approx(old.ttft_ms) and new.tpot_ms == pytest.approx(old.tpot_ms)


# two requests at once on one P whose prefill costs 2 ms each (they end at 2 and 4), one D, 20 ms
# of KV each on one link
BURST = [
    (None, 1.0, [25, 27]),  # no link model: each alone at the link's rate
    (1, 1.0, [25, 45]),  # one at a time: the second waits for the first
    (0, 1.0, [43, 45]),  # both at once from 4 ms, sharing: the first has 18 left, the second 20
    (0, 0.5, [79, 81]),  # both at once on a link that overlaps badly: it moves half its rate
    (1, 0.5, [25, 45]),  # the window keeps the link's whole rate
]


@pytest.mark.parametrize("window, share, ttfts", BURST)
def test_a_burst_queues_on_the_link(window, share, ttfts):
    quick = dataclasses.replace(C, prefill_ms_per_token=0.0)
    prof = dataclasses.replace(BASE, costs=quick, link_window=window, link_overlap_share=share)
    reqs = sim.simulate(W.Poisson(1e6, 2, (320, 320), 2), prof, "push", 1, 1)
    assert sorted(r.ttft_ms for r in reqs) == pytest.approx(ttfts, abs=0.01)


def test_writers_of_two_p_share_the_link_into_one_d():
    # each P's writer has its own window of 1, so both WRITEs go at once into D's one link
    reqs = sim.simulate(W.Poisson(1e6, 2, (320, 320), 2), linked(1), "push", 2, 1)
    assert sorted(r.ttft_ms for r in reqs) == pytest.approx([162 + 40 + 3] * 2, abs=0.01)


def test_pull_inline_reads_one_at_a_time_and_d_waits():
    reqs = sim.simulate(W.Poisson(1e6, 2, (320, 320), 2), linked(), "pull-inline", 2, 1)
    # relay 4 after the prefill (162): READs 166-186 and 186-206, each landing 3 ms later
    assert sorted(r.ttft_ms for r in reqs) == pytest.approx([189, 209], abs=0.01)


def test_pull_reads_posted_together_move_one_after_another():
    # D's writer posts both READs to one P at once, over one TCP stream: the second waits for the
    # first (as pull inline's), not both sharing the link and ending together at 6 + 40
    quick = dataclasses.replace(C, prefill_ms_per_token=0.0)
    prof = dataclasses.replace(linked(), costs=quick)
    reqs = sim.simulate(W.Poisson(1e6, 2, (320, 320), 2), prof, "pull", 1, 1)
    # prefills end at 2 and 4, READs after the relay (4): 6-26 and 26-46, each landing 3 ms later
    assert sorted(r.ttft_ms for r in reqs) == pytest.approx([29, 49], abs=0.01)


def test_reads_from_two_p_share_the_link():
    # one endpoint per P: D's READs from two P move at once, each at half the link's rate (166-206)
    reqs = sim.simulate(W.Poisson(1e6, 2, (320, 320), 2), linked(), "pull", 2, 1)
    assert sorted(r.ttft_ms for r in reqs) == pytest.approx([209, 209], abs=0.01)


def test_push_layer_parts_start_with_the_first_group_stored():
    # 200 ms of KV in four parts of 50 ms as each quarter of the prefill is stored (40.5, 81, 121.5,
    # 162): the link starts at 40.5, so 78.5 ms are left at prefill end; without the link model
    # the rule of thumb (max(a quarter, transfer - prefill)) says 50
    slow = dataclasses.replace(C, handoff_ms_per_block=10.0)
    (r,) = sim.simulate(LONE, dataclasses.replace(linked(), costs=slow), "push-layer", 1, 1)
    assert r.ttft_ms == pytest.approx(162 + 78.5 + 3)
    (old,) = sim.simulate(LONE, dataclasses.replace(BASE, costs=slow), "push-layer", 1, 1)
    assert old.ttft_ms == pytest.approx(162 + 50 + 3)


def test_a_push_layer_part_waits_in_the_queue_while_the_one_before_it_is_on_the_wire():
    # 400 ms of KV, a group's part 100 ms: part 1 (group 1) 40.5-140.5; group 2's part is offered at
    # 81 while part 1 flies (two parts ahead) and waits in P's link queue (window 1): 140.5-240.5;
    # group 3's (121.5) waits for a part to land, and goes at 240.5, group 4's at 340.5: four WRITEs
    slow = dataclasses.replace(C, handoff_ms_per_block=20.0)
    s = sim.Simulation(LONE, dataclasses.replace(linked(), costs=slow), "push-layer", 1, 1)
    (r,) = s.run()
    assert r.ttft_ms == pytest.approx(440.5 + 3) and s.links[0].started == 4 and s.links[0].peak == 1


def test_a_third_part_waits_for_a_landing_and_carries_every_group_stored_meanwhile():
    # a group's part 200 ms: part 1 (group 1) 40.5-240.5, group 2's queued behind it at 81; groups 3
    # (121.5) and 4 (162) wait, two parts being out, and go as one part once part 1 lands: 440.5-840.5
    slow = dataclasses.replace(C, handoff_ms_per_block=40.0)
    s = sim.Simulation(LONE, dataclasses.replace(linked(), costs=slow), "push-layer", 1, 1)
    (r,) = s.run()
    assert r.ttft_ms == pytest.approx(840.5 + 3) and s.links[0].started == 3


def test_two_parts_of_a_request_share_a_link_without_a_window():
    # no window: group 2's part goes on the wire beside part 1 (and at the prefill's end the rest
    # beside both), and on a link that overlaps badly (half its rate with several in flight) the
    # request ends later than one part at a time
    slow = dataclasses.replace(C, handoff_ms_per_block=20.0)
    s = sim.Simulation(LONE, dataclasses.replace(linked(0, share=0.5), costs=slow), "push-layer", 1, 1)
    (r,) = s.run()
    assert s.links[0].peak == 3 and r.ttft_ms > 440.5 + 3


def test_a_prefix_p_and_d_already_hold_is_neither_computed_nor_moved():
    # 320 tokens, 160 of them held from an earlier run: P computes 160 (80 ms), 10 blocks move
    wl = W.Arrivals(starts=(0.0,), prompts=(320,), output=2, cached=(160,))
    (r,) = sim.simulate(wl, linked(), "push", 1, 1)
    assert r.ttft_ms == pytest.approx(2 + 160 * 0.5 + 10 + 3)
    with pytest.raises(ValueError, match="cached"):
        W.Arrivals(starts=(0.0,), prompts=(320,), output=2, cached=(400,))


def test_a_late_allocation_is_ds_read_after_ps_write_on_their_stream():
    # D holds one request pinned (capacity 700 tokens, half of it for pushes): the second goes late,
    # D READs its 20 blocks after the relay (4 ms) from the same P, whose WRITE went on the wire
    # first: the READ waits for it on their one stream instead of sharing the link
    quick = dataclasses.replace(C, prefill_ms_per_token=0.0)
    prof = dataclasses.replace(linked(1), costs=quick, d_capacity_tokens=700)
    reqs = sim.simulate(W.Poisson(1e6, 2, (320, 320), 2), prof, "push", 1, 1)
    assert sorted(r.path for r in reqs) == ["late", "push"]
    # WRITE 2-22 alone (the READ, posted at 8, waits), then the READ 22-42
    by = {r.path: r.ttft_ms for r in reqs}
    assert by["push"] == pytest.approx(22 + 3, abs=0.01) and by["late"] == pytest.approx(42 + 3, abs=0.01)


def test_a_p_full_of_prompts_whose_kv_has_not_left_admits_no_more():
    # P holds one 320-token prompt (20 blocks): the second's prefill waits until D's READ of the
    # first has moved it (pull keeps P's blocks for the READ): prefill 0-2, READ 6-26, then the
    # second's prefill 26-28, its READ 32-52
    quick = dataclasses.replace(C, prefill_ms_per_token=0.0)
    wl = W.Poisson(1e6, 2, (320, 320), 2)
    held = dataclasses.replace(linked(), costs=quick, p_capacity_tokens=320)
    reqs = sim.simulate(wl, held, "pull", 1, 1)
    assert sorted(r.ttft_ms for r in reqs) == pytest.approx([29, 55], abs=0.01)
    # room for both: the second prefills at once (as before P's pool was modelled)
    roomy = sim.simulate(wl, dataclasses.replace(held, p_capacity_tokens=640), "pull", 1, 1)
    assert sorted(r.ttft_ms for r in roomy) == pytest.approx([29, 49], abs=0.01)


def test_a_prompt_larger_than_p_is_admitted_alone():
    quick = dataclasses.replace(C, prefill_ms_per_token=0.0)
    prof = dataclasses.replace(linked(), costs=quick, p_capacity_tokens=16)
    reqs = sim.simulate(W.Poisson(1e6, 2, (320, 320), 2), prof, "push", 1, 1)
    # each goes alone: prefill, WRITE (20), landing; the second's prefill after the first's WRITE
    assert sorted(r.ttft_ms for r in reqs) == pytest.approx([25, 47], abs=0.01)


# one P whose prefill costs 2 ms: a long WRITE (200 blocks, on the wire 2-202) while B (100 blocks,
# ready at 12) and then C (20 blocks, ready at 22) queue behind it: the order decides who goes next
ARRIVALS = W.Arrivals(starts=(0.0, 0.010, 0.020), prompts=(3200, 1600, 320), output=2)
ORDER_TTFT = [("arrival", 302 + 20 + 3 - 20), ("shortest", 202 + 20 + 3 - 20),
              ("deadline", 302 + 20 + 3 - 20)]  # B was first queued, so its deadline is first


@pytest.mark.parametrize("order, ttft_c", ORDER_TTFT)
def test_the_order_decides_whether_a_short_request_waits(order, ttft_c):
    quick = dataclasses.replace(C, prefill_ms_per_token=0.0)
    reqs = sim.simulate(ARRIVALS, dataclasses.replace(linked(1, order), costs=quick), "push", 1, 1)
    c = next(r for r in reqs if r.turn.prompt == 320)
    assert c.ttft_ms == pytest.approx(ttft_c, abs=0.01)


@pytest.mark.parametrize("flags, p50", [(["--link-window", "1"], "35.0"),  # TTFT 25 and 45 (the burst above)
                                         (["--link-window", "0"], "44.0"),  # 43 and 45
                                         (["--link-overlap", "0.5"], "80.0")])  # 79 and 81: every WRITE at once
def test_the_cli_models_the_link_from_its_flags(capsys, flags, p50):
    wl = '{"kind": "arrivals", "starts": [0, 0], "prompts": [320, 320], "output": 2}'
    costs = dict(C.as_dict(), prefill_ms_per_token=0.0)
    prof = json.dumps({"name": "t", "costs": costs, "relay_ms": 4})
    assert cli.main(["--workload", wl, "--profile", prof, "--modes", "push", "--pd", "1:1", *flags]) == 0
    out = capsys.readouterr().out
    assert "link per P -> D" in out and f" {p50} " in out.splitlines()[-1]


def test_the_cli_refuses_a_link_that_cannot_be(capsys):
    wl = '{"kind": "arrivals", "starts": [0], "prompts": [320], "output": 2}'
    prof = json.dumps({"name": "t", "costs": C.as_dict()})
    assert cli.main(["--workload", wl, "--profile", prof, "--link-overlap", "1.5"]) == 2
    assert "link_overlap_share" in capsys.readouterr().err


def test_the_cli_sizes_p_and_d_from_num_blocks(tmp_path, capsys):
    # two 320-token prompts at once, pull: with 21 blocks (336 tokens) a side P holds one prompt and D one
    # request, so the second waits for the first's READ on P and for its decode on D
    wl = '{"kind": "arrivals", "starts": [0, 0], "prompts": [320, 320], "output": 2}'
    costs = dict(C.as_dict(), prefill_ms_per_token=0.0)
    prof = json.dumps({"name": "t", "costs": costs, "relay_ms": 4})
    base = ["--workload", wl, "--profile", prof, "--modes", "pull", "--pd", "1:1", "--link-window", "1"]
    p50 = {}
    for blocks in (None, 21):
        out = tmp_path / f"{blocks}.json"
        assert cli.main(base + ["--out", str(out)] + (["--num-blocks", str(blocks)] if blocks else [])) == 0
        got = json.loads(out.read_text())
        p50[blocks] = got["rows"][0]["ttft_p50"]
        if blocks:
            assert got["profile"]["p_capacity_tokens"] == got["profile"]["d_capacity_tokens"] == 21 * 16
    assert p50[21] > p50[None]
    capsys.readouterr()
    assert cli.main(base + ["--num-blocks", "0"]) == 2 and "--num-blocks" in capsys.readouterr().err
    # a request no D could hold (322 tokens in 20 blocks of 16): refused by name, not left waiting forever
    assert cli.main(base + ["--num-blocks", "20"]) == 2 and "322 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("mode", sim.MODES)
@pytest.mark.parametrize("order", ["arrival", "shortest", "deadline"])
def test_every_request_of_every_mode_finishes_over_the_link(mode, order):
    # mixed lengths at a load past the link's rate, two P, two D, D memory for a few requests only
    # (push's late allocation and the router's queue both run): nothing is lost or stuck
    wl = W.Poisson(20.0, 40, (64, 1024), 4, seed=3)
    prof = dataclasses.replace(linked(2, order, 0.7), d_capacity_tokens=3000)
    reqs = sim.simulate(wl, prof, mode, 2, 2)
    assert len(reqs) == 40 and all(r.tokens == 4 and r.ttft_ms > 0 for r in reqs)


def test_the_rest_leaves_at_the_prefills_end_only_where_the_run_did_so():
    # no window, two parts already on the link when the last group is stored: the rest goes beside
    # them at once (a third on the link), or, as P asked it before 2026-12-03, waits for one to land
    slow = dataclasses.replace(C, handoff_ms_per_block=20.0)
    peaks = {}
    for rest in (True, False):
        prof = dataclasses.replace(linked(0, share=0.5), costs=slow, rest_at_end=rest)
        s = sim.Simulation(LONE, prof, "push-layer", 1, 1)
        s.run()
        peaks[rest] = s.links[0].peak
    assert peaks == {True: 3, False: 2}


@pytest.mark.parametrize("one_device", [False, True])  # P's step on the device P and D share, or alone
def test_a_transport_staged_read_waits_while_a_prefill_computes(one_device):
    # pull's READs staged by UCX through the GPU P and D share (staged_holds): the first prompt's
    # READ (after its prefill 0-162 and the relay: 166-186 alone) stops while the second prompt's
    # prefill computes (170-332), so 16 of its 20 ms are left at 332: it ends at 348; the second's
    # READ (relay at 336) waits for it on their stream: 348-368. Each lands 3 ms later.
    wl = W.Arrivals(starts=(0.0, 0.170), prompts=(320, 320), output=2)
    free = sim.simulate(wl, linked(), "pull", 1, 1)
    assert [r.ttft_ms for r in sorted(free, key=lambda r: r.arrival)] == pytest.approx([189, 359 - 170], abs=0.01)
    held = sim.simulate(wl, dataclasses.replace(linked(), staged_holds=True, one_device=one_device), "pull", 1, 1)
    assert [r.ttft_ms for r in sorted(held, key=lambda r: r.arrival)] == pytest.approx([351, 371 - 170], abs=0.01)


def test_pull_reads_two_at_a_time_share_the_link():
    # D's read queue with a window of two (pull's auto over TCP): the READs posted at 6 and 8 share the
    # link from 8 (the first has 18 left, each moves at half): 8 + 36 = 44 and 46, each landing 3 ms later
    quick = dataclasses.replace(C, prefill_ms_per_token=0.0)
    prof = dataclasses.replace(linked(), costs=quick, read_window=2)
    reqs = sim.simulate(W.Poisson(1e6, 2, (320, 320), 2), prof, "pull", 1, 1)
    assert sorted(r.ttft_ms for r in reqs) == pytest.approx([47, 49], abs=0.01)
