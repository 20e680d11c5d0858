"""pushkv link-plan: a link-bench run's lone figures made into the planner's profile, a loaded
run's arrivals (and, replayed, its compute) read from its timelines, and the rows it prints.
A synthetic run folder: no processes."""
from __future__ import annotations

import json

import pytest

from pushkv.config import DeploymentConfig
from tools import bench
from tools import link_plan as LP

pytestmark = pytest.mark.timeout(60)

KV_PER_TOKEN = 16384  # 16 blocks of 16 tokens: 256 KiB per block
RATE = "100mbit"
PER_BLOCK_MS = 16 * KV_PER_TOKEN * 8 / (100e6 * LP.TCP_PAYLOAD_SHARE) * 1e3  # ~21.9 ms


def lone(prefill, tail, ttft, tpot=10.0, **kw):
    return {"lone": dict(prefill_ms=prefill, pend_to_kv_ms=tail, ttft_ms=ttft, tpot_ms=tpot, **kw)}


GROUPS = DeploymentConfig().push_stream_groups  # pushkv up's default


def results(up_flags=(), num_layers=4, groups=GROUPS):
    return {"model": {"kv_bytes_per_token": KV_PER_TOKEN, "num_layers": num_layers}, "push_stream_groups": groups,
            "layer_cut": "short_ends",
            "up_flags": ["--model", "small", *up_flags],
            "mode_flags": {"push": ["--mode", "push", "--push-stream", "off"],
                           "push-layer": ["--mode", "push", "--push-stream", "layer", "--link-window", "4"]},
            "regimes": {RATE: {"push": {"256": lone(100.0, 16 * PER_BLOCK_MS + 5.0, 16 * PER_BLOCK_MS + 110.0)},
                               # 4 groups stored at 30, 60, 90, 120 ms: parts of 4, 8 and 4 blocks from 30 on
                               # leave 16 blocks on the link less the 90 ms after the first group, + 5 fixed
                               "push-layer": {"256": lone(120.0, 16 * PER_BLOCK_MS - 90.0 + 5.0, 500.0, parts=2,
                                                          stream="layer")}}}}


def test_the_profile_is_the_lone_figures_and_the_cap():
    prof = LP.profile_for(results(), RATE, "push", 256)
    c = prof.costs
    assert c.handoff_ms_per_block == pytest.approx(PER_BLOCK_MS)
    assert c.handoff_ms_fixed == pytest.approx(5.0)  # the lone tail less 16 blocks on the capped link
    assert c.prefill_ms_per_token * 256 == pytest.approx(110.0)  # the median over both modes' prefill
    assert c.prefill_ms_fixed == 0.0  # a step's: TTFT's rest (less the prefill and the tail) is each request's
    assert LP.lone_rest_ms(results(), RATE, "push", 256) == pytest.approx(5.0)
    # auto over TCP: window 1; the default groups, at most one a layer of the 4-layer model
    assert (prof.link_window, prof.link_order, prof.layer_groups) == (1, "arrival", 4)
    # P's step budget and its device as pushkv up ran them: its defaults, the CPU
    assert (prof.max_batch_tokens, prof.max_num_seqs, prof.one_device) == (8192, 32, False)
    gpu = LP.profile_for(results(["--device", "cuda:0", "--max-batch-tokens", "16384", "--max-num-seqs", "64"]),
                         RATE, "push", 256)
    assert (gpu.max_batch_tokens, gpu.max_num_seqs, gpu.one_device) == (16384, 64, True)
    # P's pool and D's as the deployment ran them (one --num-blocks for both), unbounded where none was given
    pooled = LP.profile_for(results(["--num-blocks", "3072", "--block-size", "16"]), RATE, "push", 256)
    assert (pooled.p_capacity_tokens, pooled.d_capacity_tokens) == (3072 * 16, 3072 * 16)
    assert prof.p_capacity_tokens == prof.d_capacity_tokens == 1 << 30
    assert not LP.one_device(["--device", "cuda:0", "--decode-device", "cuda:1"])  # one GPU each
    # UCX stages the transfers through the GPU (the link is held while a prefill computes there):
    # pull's READs, and push's WRITEs where --staging transport; push's own staging on the GPU does not
    assert not gpu.staged_holds and not prof.staged_holds
    assert LP.transport_staged(["--mode", "pull", "--device", "cuda:0"])
    assert LP.transport_staged(["--mode", "push", "--staging", "transport", "--device", "cuda:0"])
    assert not LP.transport_staged(["--mode", "push", "--device", "cuda:0"])
    assert not LP.transport_staged(["--mode", "pull", "--device", "cpu"])  # a host pool: nothing to stage
    # D's READs from one P: the window link-bench recorded as auto (pull's READs two at a time), one
    # where it recorded none (before D's READ queue: posted at once, moving about one after another)
    assert LP.link_setting(results(), "push", "read") == (1, "arrival")
    assert LP.link_setting(dict(results(), auto_windows={"write": 1, "read": 2}), "push", "read") == (2, "arrival")
    assert LP.link_setting(results(["--link-window", "3"]), "push", "read") == (3, "arrival")  # the flag wins
    assert prof.read_window == 1  # push: its late allocations' READs, one at a time
    # a streamed mode's fixed cost: its own lone tail less what the model puts there (its parts)
    assert LP.profile_for(results(), RATE, "push-layer", 256).costs.handoff_ms_fixed == pytest.approx(5.0)
    layer = LP.profile_for(results(["--link-order", "shortest", "--push-stream-groups", "3"]), RATE, "push-layer", 256)
    assert (layer.link_window, layer.link_order, layer.layer_groups) == (4, "shortest", 3)
    assert LP.profile_for(results(), "none", "push", 256) is None  # no cap: no link to model
    assert LP.profile_for(results(), RATE, "push", 512) is None  # no lone figures there


def run_json(starts, pre=(1.0, 101.0), tail=400.0, land=10.0):
    tls = []
    for t in starts:
        t0 = 1000.0 + t
        p0, p1 = t0 + pre[0] / 1e3, t0 + pre[1] / 1e3
        tls.append({"router.arrival": t0, "prefill.prefill_start": p0, "prefill.prefill_end": p1,
                    "decode.kv_received": p1 + tail / 1e3, "router.first_token": p1 + (tail + land) / 1e3})
    ttfts = [tl["router.first_token"] - tl["router.arrival"] for tl in tls]
    return {"timelines": tls, "input_lens": [256] * len(starts), "output_lens": [8] * len(starts),
            "median_ttft_ms": sorted(ttfts)[len(ttfts) // 2] * 1e3, "request_rate": 2.0, "failed": 0}


def test_arrivals_and_the_replayed_compute_come_from_the_timelines():
    wl = LP.arrivals(run_json([0.5, 0.0]), replay=True)
    assert wl.starts == pytest.approx((0.5, 0.0)) and wl.prompts == (256, 256) and wl.output == 8
    assert wl.prefills_ms[0] == pytest.approx((1.0, 101.0)) and wl.lands_ms == pytest.approx((10.0, 10.0))
    with pytest.raises(ValueError, match="router.arrival"):
        LP.arrivals({"timelines": [{}], "input_lens": [1], "output_lens": [1]})


def test_check_replays_each_loaded_run(tmp_path):
    (tmp_path / RATE).mkdir()
    (tmp_path / "link_bench.json").write_text(json.dumps(results()))
    # two requests at once whose KV (16 blocks, ~350 ms on the link each) queues one behind the other
    run = run_json([0.0, 0.0], tail=16 * PER_BLOCK_MS + 5.0)
    (tmp_path / RATE / bench.result_name("push", 2.0, 256, 8, 0)).write_text(json.dumps(run))
    (row,) = LP.check(str(tmp_path))
    assert (row["mode"], row["tokens"], row["window"]) == ("push", 256, 1)
    # replayed: the two prefills end together; one WRITE waits for the other, the p50 of the two
    # TTFTs is half a transfer over the measured (which queued nothing): the link model shows it
    ttft_1 = 101.0 + 16 * PER_BLOCK_MS + 5.0 + 10.0
    assert row["replayed"] == pytest.approx(ttft_1 + 16 * PER_BLOCK_MS / 2)
    assert row["replayed_no_link_model"] == pytest.approx(ttft_1)
    # at 2 QPS: the link busy 2 x 16 blocks x ~21.9 ms, P 2 x 110 ms (the lone prefill's median)
    assert row["link_busy"] == pytest.approx(2 * 16 * PER_BLOCK_MS / 1e3) and row["p_busy"] == pytest.approx(0.22)
    assert "| push | 256 |" in LP.table([row])


def test_a_mode_whose_lone_transfers_move_slower_than_the_cap_at_every_length_takes_its_path_rate():
    # pull's READ at a third of the cap at 256 and 512 tokens (16 and 32 blocks): the path bounds it;
    # push's WRITE 5 ms over the cap's time at both: a fixed cost, the cap stays its rate
    res = results()
    res["regimes"][RATE]["pull-inline"] = {
        str(n): lone(100.0, 3 * b * PER_BLOCK_MS + 2.0, 3 * b * PER_BLOCK_MS + 110.0,
                     kv_bytes=b * 16 * KV_PER_TOKEN, wire_ms=3 * b * PER_BLOCK_MS) for n, b in ((256, 16), (512, 32))}
    for n, b in ((256, 16), (512, 32)):
        res["regimes"][RATE]["push"][str(n)] = lone(100.0, b * PER_BLOCK_MS + 5.0, b * PER_BLOCK_MS + 110.0,
                                                     kv_bytes=b * 16 * KV_PER_TOKEN, wire_ms=b * PER_BLOCK_MS + 5.0)
    pull = LP.profile_for(res, RATE, "pull-inline", 256).costs
    assert pull.handoff_ms_per_block == pytest.approx(3 * PER_BLOCK_MS) and pull.handoff_ms_fixed == pytest.approx(2.0)
    push = LP.profile_for(res, RATE, "push", 256).costs
    assert push.handoff_ms_per_block == pytest.approx(PER_BLOCK_MS) and push.handoff_ms_fixed == pytest.approx(5.0)


@pytest.mark.parametrize("prompt, kv, cached", [
    (256, {"prefill": {"bytes": 256 * KV_PER_TOKEN}}, 0),  # P wrote every token
    (256, {"prefill": {"bytes": 192 * KV_PER_TOKEN}, "decode": {"bytes": 1}}, 64),  # P's count wins
    (256, {"decode": {"bytes": 128 * KV_PER_TOKEN}}, 128),  # pull (or a late push): what D read
    (256, None, 0), (256, {}, 0)])  # no count kept
def test_a_replayed_request_holds_the_prefix_it_did_not_move(prompt, kv, cached):
    assert LP.cached_tokens(prompt, kv, KV_PER_TOKEN) == cached


def test_without_batching_p_runs_one_prompt_a_step(tmp_path):
    # a 10 Gbit/s link moves the KV in ~3.5 ms (the lone tail's rest is a fixed cost): P sets the pace
    res = results()
    res["regimes"] = {"10gbit": res["regimes"][RATE]}
    (tmp_path / "10gbit").mkdir()
    (tmp_path / "link_bench.json").write_text(json.dumps(res))
    # three at once: the first computes alone (110 ms), the other two wait and share P's next step,
    # each waiting for both (220 ms more), so the middle prefill ends at 330, not at 220
    run = run_json([0.0, 0.0, 0.0])
    (tmp_path / "10gbit" / bench.result_name("push", 2.0, 256, 8, 0)).write_text(json.dumps(run))
    (batched,) = LP.check(str(tmp_path))
    (alone,) = LP.check(str(tmp_path), ("batching",))
    assert batched["predicted"] - alone["predicted"] == pytest.approx(110.0)
    assert batched["replayed"] == alone["replayed"]  # the replay keeps P's compute as it ran
    with pytest.raises(SystemExit):
        LP.main([str(tmp_path), "--without", "nothing"])


def test_the_profile_streams_the_default_groups_or_one_a_layer():
    assert GROUPS == 10
    prof = LP.profile_for(results(num_layers=36), RATE, "push", 256)
    assert prof.layer_groups == 10 and prof.group_layers == (2, 4, 4, 4, 4, 4, 4, 4, 4, 2)
    assert prof.stored_share(1) == (2, 36) and prof.stored_share(9) == (34, 36)
    assert prof.rest_at_end  # the short-ends cut came with the rest sent at once at the prefill's end
    assert LP.profile_for(results(num_layers=4), RATE, "push", 256).layer_groups == 4
    assert LP.profile_for(results(["--push-stream-groups", "2"], num_layers=36), RATE, "push", 256).layer_groups == 2
    old = results(num_layers=36)
    del old["push_stream_groups"], old["layer_cut"]  # a run that did not record its default ran the old one
    prof = LP.profile_for(old, RATE, "push", 256)
    assert prof.layer_groups == LP.LEGACY_GROUPS == 4 and prof.group_layers == ()  # equal groups then
    assert not prof.rest_at_end  # and the rest waited for the last WRITE
    assert prof.stored_share(1) == (1, 4)


def probe(*sizes_ms, error=False):
    """A link-bench probe: (blocks, ms) per size, each block 16 tokens of KV."""
    if error:
        return {"at": 0.0, "error": "RuntimeError('initiator failed')"}
    return {"at": 0.0, "sizes": [{"bytes": b * 16 * KV_PER_TOKEN, "nixl_s": ms / 1e3, "nixl_min_s": ms / 1e3,
                                  "tcp_s": ms / 1e3} for b, ms in sizes_ms]}


def test_the_link_s_rate_is_the_probe_s_slope_and_the_cap_at_most():
    res = results()
    assert LP.link_rate(res, RATE)[1] == "cap"  # no probe: the cap less the headers
    # the probe's WRITEs at 1.25x the cap's time a block, plus 3 ms each: the slope, not one size's rate
    res["probes"] = {RATE: [probe((16, 16 * 1.25 * PER_BLOCK_MS + 3.0), (64, 64 * 1.25 * PER_BLOCK_MS + 3.0)),
                            probe(error=True)]}
    assert LP.link_rate(res, RATE)[1] == "probe"
    assert LP.link_ms_per_block(res, RATE) == pytest.approx(1.25 * PER_BLOCK_MS)
    assert LP.profile_for(res, RATE, "push", 256).costs.handoff_ms_per_block == pytest.approx(1.25 * PER_BLOCK_MS)
    # a probe faster than the cap (tbf's burst on a short one): the cap
    res["probes"] = {RATE: [probe((16, 16 * 0.5 * PER_BLOCK_MS), (64, 64 * 0.5 * PER_BLOCK_MS))]}
    assert LP.link_ms_per_block(res, RATE) == pytest.approx(PER_BLOCK_MS)
    # one size only, or only failed probes: nothing to take a slope from
    for probes in ([probe((64, 100.0))], [probe(error=True)]):
        res["probes"] = {RATE: probes}
        assert LP.link_rate(res, RATE)[1] == "cap" and LP.link_ms_per_block(res, RATE) == pytest.approx(PER_BLOCK_MS)


def test_the_report_says_which_rate_the_link_takes():
    res = results()
    assert LP.link_lines(res) == [f"{RATE}: the link at 0.10 Gbit/s (cap); the cap less the headers 0.10; "
                                  "the probes' largest WRITE alone none Gbit/s"]
    res["probes"] = {RATE: [probe((16, 16 * 1.25 * PER_BLOCK_MS + 3.0), (64, 64 * 1.25 * PER_BLOCK_MS)),
                            probe(error=True)]}
    (line,) = LP.link_lines(res)
    assert line.startswith(f"{RATE}: the link at 0.08 Gbit/s (probe); the cap less the headers 0.10; "
                           "the probes' largest WRITE alone 0.08 Gbit/s") and line.endswith("1 probe(s) failed"), line


def parts_cell(part_blocks, span_ms, idle_ms=-10.0, prefill=100.0, chunk1=5.0, lag=1.0):
    """A lone push-layer cell whose parts (``part_blocks`` blocks) went from the first part's post
    (``chunk1 + lag`` after the prefill began) to the last part's end ``-idle_ms`` after it ended,
    ``span_ms`` in all: ``prefill`` is set so that the span comes out right."""
    prefill = span_ms + chunk1 + lag + idle_ms
    return lone(prefill, 20.0, prefill + 30.0, parts=4, stream="layer", part_bytes=part_blocks * 16 * KV_PER_TOKEN,
                parts_idle_ms=idle_ms, chunk1_ms=chunk1, part_lag_ms=lag)


def test_the_link_moves_at_least_what_the_deployment_s_lone_parts_moved():
    # the probe (one TCP flow) at half the cap; the deployment's own parts at 0.8 of it: the parts' rate
    res = results()
    res["probes"] = {RATE: [probe((16, 16 * 2 * PER_BLOCK_MS), (64, 64 * 2 * PER_BLOCK_MS))]}
    res["regimes"][RATE]["push-layer"]["512"] = parts_cell(30, 30 * PER_BLOCK_MS / 0.8)
    assert LP.link_rate(res, RATE)[1] == "lone parts"
    assert LP.link_ms_per_block(res, RATE) == pytest.approx(PER_BLOCK_MS / 0.8)
    # a run whose parts all landed before its prefill ended (P behind, the link idle): no floor from it
    res["regimes"][RATE]["push-layer"]["512"] = parts_cell(30, 30 * PER_BLOCK_MS / 0.8, idle_ms=5.0)
    assert LP.link_rate(res, RATE)[1] == "probe"
    assert LP.link_ms_per_block(res, RATE) == pytest.approx(2 * PER_BLOCK_MS)
    # parts faster than the cap (tbf's burst): the cap; no probe: the parts' floor all the same
    res["regimes"][RATE]["push-layer"]["512"] = parts_cell(30, 30 * PER_BLOCK_MS / 1.2)
    assert LP.link_rate(res, RATE)[1] == "cap" and LP.link_ms_per_block(res, RATE) == pytest.approx(PER_BLOCK_MS)
    del res["probes"]
    res["regimes"][RATE]["push-layer"]["512"] = parts_cell(30, 30 * PER_BLOCK_MS / 0.5)
    assert LP.link_rate(res, RATE)[1] == "lone parts"
    assert LP.link_ms_per_block(res, RATE) == pytest.approx(2 * PER_BLOCK_MS)


def test_one_length_of_a_whole_transfer_gives_its_path_rate():
    # pull's READ at one length only, at a third of the cap: no slope to take, its own rate is the path's
    res = results()
    read_ms = 3 * 16 * PER_BLOCK_MS
    res["regimes"][RATE]["pull-inline"] = {"256": lone(100.0, read_ms + 2.0, read_ms + 110.0,
                                                       kv_bytes=16 * 16 * KV_PER_TOKEN, wire_ms=read_ms)}
    assert LP.profile_for(res, RATE, "pull-inline", 256).costs.handoff_ms_per_block == pytest.approx(3 * PER_BLOCK_MS)
    # a streamed mode's last WRITE (one block of the prompt's 16) says nothing of the path: the link's rate
    res["regimes"][RATE]["push-layer"]["256"]["lone"].update(kv_bytes=16 * KV_PER_TOKEN, wire_ms=5.0)
    assert LP.whole_transfer(res["regimes"][RATE], "push-layer", 256, KV_PER_TOKEN) is None
    assert LP.profile_for(res, RATE, "push-layer", 256).costs.handoff_ms_per_block == pytest.approx(PER_BLOCK_MS)


def test_a_run_with_failed_requests_is_reported_not_checked(tmp_path, capsys):
    (tmp_path / RATE).mkdir()
    (tmp_path / "link_bench.json").write_text(json.dumps(results()))
    run = dict(run_json([0.0, 0.0]), failed=1)
    run["timelines"][1] = {"prefill.prefill_start": 1.0}  # a failed request's timeline: no arrival, no first token
    (tmp_path / RATE / bench.result_name("push", 2.0, 256, 8, 0)).write_text(json.dumps(run))
    skipped: list[str] = []
    assert LP.check(str(tmp_path), skipped=skipped) == []
    assert skipped == [f"{RATE} push 256 tokens at QPS 2: 1 of 2 failed, not checked"]
    assert LP.main([str(tmp_path)]) == 0
    assert "1 of 2 failed, not checked" in capsys.readouterr().out


def test_the_path_takes_the_fastest_lone_rep_where_the_run_folder_has_them(tmp_path):
    # two lone reps of pull inline at 256 tokens (16 blocks), one slowed by something else: 16 and 20
    # blocks' time; the profile's path takes the faster (the median in link_bench.json says 18)
    res = results()
    res["mode_flags"]["pull-inline"] = ["--mode", "pull", "--pull-read", "inline"]
    res["regimes"][RATE]["pull-inline"] = {"256": lone(100.0, 18 * PER_BLOCK_MS, 18 * PER_BLOCK_MS + 110.0,
                                                        kv_bytes=16 * 16 * KV_PER_TOKEN, wire_ms=18 * PER_BLOCK_MS)}
    (tmp_path / RATE).mkdir()
    tls = [{"decode.read_posted": 10.0, "decode.read_done": 10.0 + k * PER_BLOCK_MS / 1e3} for k in (16, 20)]
    (tmp_path / RATE / "pull-inline_qps0_in256_out8_iter0.json").write_text(
        json.dumps({"input_len": 256, "timelines": tls}))
    assert LP.fastest_wire_ms(str(tmp_path), RATE, "pull-inline") == {256: pytest.approx(16 * PER_BLOCK_MS)}
    median = LP.profile_for(res, RATE, "pull-inline", 256).costs.handoff_ms_per_block
    fastest = LP.profile_for(res, RATE, "pull-inline", 256, str(tmp_path)).costs.handoff_ms_per_block
    assert median == pytest.approx(18 / 16 * PER_BLOCK_MS) and fastest == pytest.approx(PER_BLOCK_MS)
