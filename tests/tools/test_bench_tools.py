"""Bench result naming and aggregation, the plot on synthetic results, and
one bench run against the real router with a fake local scheduler."""
from __future__ import annotations

import asyncio
import json
import math
import os

import pytest

from tools import bench, plot, sweep

from tests.support.router_fakes import Harness, make_cfg, stage, tokens

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("qps,text", [(1.0, "1"), (2, "2"), (0.5, "0.5"), (math.inf, "inf")])
def test_fmt_qps(qps, text):
    assert bench.fmt_qps(qps) == text


def test_result_name_roundtrip(tmp_path):
    name = bench.result_name("pull-inline", 0.5, 1024, 128, 3)
    assert name == "pull-inline_qps0.5_in1024_out128_iter3.json"
    assert bench.parse_result_name(str(tmp_path / name)) == {
        "mode": "pull-inline", "qps": 0.5, "input_len": 1024, "output_len": 128, "iter": 3}
    assert bench.parse_result_name("ttft_tpot.png") is None
    assert bench.next_iter(str(tmp_path), "push", 1, 256, 128) == 0
    (tmp_path / bench.result_name("push", 1, 256, 128, 0)).write_text("{}")
    assert bench.next_iter(str(tmp_path), "push", 1, 256, 128) == 1


def test_aggregate():
    ok1 = bench.RequestResult(True, 100, 5, ttft=0.1, itl=[0.02] * 4, latency=0.18,
                              timeline={"router.arrival": 10.0, "decode.kv_received": 10.05, "router.finish": 10.18})
    ok2 = bench.RequestResult(True, 100, 3, ttft=0.3, itl=[0.05] * 2, latency=0.4,
                              timeline={"router.arrival": 20.0, "decode.kv_received": 20.25, "router.finish": 20.4})
    bad = bench.RequestResult(False, 100, error="HTTP 503")
    s = bench.aggregate([ok1, ok2, bad], duration=2.0, meta={"mode": "push"})
    assert (s["completed"], s["failed"], s["mode"]) == (2, 1, "push")
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (200, 8)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 4.0 and s["total_token_throughput"] == 104.0
    assert s["median_ttft_ms"] == pytest.approx(200.0) and s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["std_ttft_ms"] == pytest.approx(100.0)
    assert s["median_tpot_ms"] == pytest.approx((20.0 + 50.0) / 2)
    assert s["mean_itl_ms"] == pytest.approx((4 * 20 + 2 * 50) / 6)
    assert s["median_e2el_ms"] == pytest.approx(290.0)
    assert s["errors"] == ["", "", "HTTP 503"] and len(s["ttfts"]) == 3
    assert list(s["stages"]) == ["router.arrival", "decode.kv_received", "router.finish"]
    assert s["stages"]["decode.kv_received"] == pytest.approx(150.0)  # median of 50 and 250
    assert s["stage_offsets"]["router.finish"] == pytest.approx(290.0)
    for k in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{k}_ms", f"median_{k}_ms", f"std_{k}_ms", f"p99_{k}_ms"} <= set(s)


def test_aggregate_all_failed():
    s = bench.aggregate([bench.RequestResult(False, 10, error="x")], 1.0, {})
    assert s["completed"] == 0 and s["median_ttft_ms"] == 0.0 and s["stages"] == {}


def test_arrivals_and_prompts_are_seeded():
    assert bench.make_prompts(2, 8, 256, 1) == bench.make_prompts(2, 8, 256, 1)
    assert all(0 <= t < 256 for p in bench.make_prompts(3, 50, 256, 0) for t in p)
    gaps = bench.arrival_gaps(2000, 4.0, 0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)
    assert bench.arrival_gaps(3, math.inf, 0) == [0.0, 0.0, 0.0]


def write_result(d, mode, qps, inp, ttft, tpot, it=0):
    body = {"completed": 4, "median_ttft_ms": ttft, "median_tpot_ms": tpot}
    (d / bench.result_name(mode, qps, inp, 128, it)).write_text(json.dumps(body))


def test_plot_and_ratio_table(tmp_path, capsys):
    for qps in (1, 2):
        for inp in (256, 1024):
            write_result(tmp_path, "push", qps, inp, ttft=100.0 * qps, tpot=10.0)
            write_result(tmp_path, "pull-inline", qps, inp, ttft=150.0 * qps, tpot=12.0)
            write_result(tmp_path, "pull-inline", qps, inp, ttft=250.0 * qps, tpot=12.0, it=1)
    write_result(tmp_path, "pull-background", 1, 256, ttft=120.0, tpot=11.0)
    cells = plot.load(str(tmp_path))
    assert cells[("pull-inline", 1.0, 256)]["median_ttft_ms"] == 200.0  # median over iterations
    rows = plot.ratio_rows(cells)
    assert len(rows) == 5
    r = next(r for r in rows if r["mode"] == "pull-inline" and r["qps"] == 2.0 and r["input_len"] == 1024)
    assert r["ttft_ratio"] == pytest.approx(2.0) and r["tpot_ratio"] == pytest.approx(1.2)
    out = tmp_path / "fig.png"
    assert plot.main([str(tmp_path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "pull-background" in table and "2.000" in table and "1.200" in table


def test_plot_says_when_the_baseline_has_no_runs(tmp_path, capsys):
    """A sweep of --modes push-layer pull-inline has no "push" runs: the ratio table came out empty, without a word."""
    write_result(tmp_path, "push-layer", 1, 256, ttft=100.0, tpot=10.0)
    write_result(tmp_path, "pull-inline", 1, 256, ttft=150.0, tpot=12.0)
    assert plot.main([str(tmp_path), "--out", str(tmp_path / "f.png")]) == 0
    err = capsys.readouterr().err
    assert "no 'push' runs" in err and "pull-inline, push-layer" in err
    assert plot.main([str(tmp_path), "--out", str(tmp_path / "f.png"), "--baseline", "push-layer"]) == 0
    assert "1.500" in capsys.readouterr().out


def test_sweep_grid_defaults():
    small = sweep.parse_args([])
    assert len(sweep.grid(small)) == 16 and small.num_prompts <= 10  # 4 modes x 2 QPS x 2 inputs
    full = sweep.parse_args(["--full"])
    assert full.inputs[0] == 1024 and full.inputs[-1] == 16384 and full.qps == [1.0, 2.0, 4.0, 8.0]
    assert sweep.MODES["pull-inline"] == ["--mode", "pull", "--pull-read", "inline"]


def test_no_sweep_run_resends_an_earlier_runs_prompts():
    """A mode's runs share one deployment and its prefix cache: a run whose prompts (or their first block) an earlier
    run sent measures cache hits (the sweep's QPS 2 cells moved one block of KV, their TTFT a tenth of QPS 1's). Each
    run gets prompts of its own, the same for every mode."""
    args = sweep.parse_args(["--iters", "2"])
    seen: dict[tuple, tuple] = {}
    for mode, qps, inp in sweep.grid(args):
        for it in range(args.iters):
            b = sweep.bench_args(args, mode, "http://x", qps, inp, it)
            if mode != args.modes[0]:
                continue
            prompts = (bench.make_prompts(b.num_prompts, b.input_len, b.vocab_size, b.seed)
                       + bench.make_prompts(b.warmup, b.input_len, b.vocab_size, b.seed + 1000))
            for p in prompts:
                first_block = tuple(p[:16])
                assert first_block not in seen, f"qps {qps} in {inp} iter {it} resends {seen[first_block]}'s prompt"
                seen[first_block] = (qps, inp, it)
    assert sweep.bench_args(args, "push", "u", 2.0, 1024, 1).seed == sweep.bench_args(
        args, "pull-inline", "u", 2.0, 1024, 1).seed


def test_bench_against_router(tmp_path):
    def script(g):
        n = g.max_tokens
        out = [(None, tokens(g, [65 + i])) for i in range(n - 1)]
        out.append((None, tokens(g, [90], True, "length", (stage("scheduled"), stage("finished")))))
        return out

    async def body():
        async with Harness(make_cfg(tmp_path, "local"), {"local": script}) as h:
            prompts = bench.make_prompts(3, 16, 256, 0)
            return await bench.run_load(h.router.url, prompts, [0.0] * 3, 4, warmup=prompts[:1], progress=False)

    results, duration = asyncio.run(asyncio.wait_for(body(), 30))
    assert all(r.success for r in results), [r.error for r in results]
    assert [r.output_len for r in results] == [4, 4, 4]
    assert all(len(r.itl) == 3 and r.ttft > 0 and r.latency >= r.ttft for r in results)
    assert all("local.scheduled" in r.timeline and r.transfer_id for r in results)
    s = bench.aggregate(results, duration, {"mode": "local"})
    assert s["completed"] == 3 and "local.finished" in s["stages"]


@pytest.mark.parametrize("stream,label", [("layer", "push-layer"), ("chunk", "push-chunk"), ("off", "push")])
def test_bench_labels_a_push_deployment_by_its_streaming(tmp_path, stream, label):
    """`pushkv up --mode push` streams per layer group; its runs were labelled "push", the label the sweep, `pushkv
    plot`'s baseline and the result pages give push with --push-stream off, so a streamed run was read as the
    unstreamed baseline. The router's /health says the streaming, and the label follows it."""
    async def body():
        async with Harness(make_cfg(tmp_path, "push", push_stream=stream), {"prefill": None, "decode": None}) as h:
            return await asyncio.to_thread(bench.detect_mode, h.router.url)

    assert asyncio.run(asyncio.wait_for(body(), 30)) == label
    assert bench.mode_label({"mode": "pull", "pull_read": "inline"}) == "pull-inline"
    assert bench.mode_label({"mode": "local"}) == "local"


def test_a_bench_run_again_or_at_another_length_sends_prompts_no_earlier_run_began_with(tmp_path):
    """`pushkv bench` twice against one deployment sent the same prompts (seed 0 both times), and a run at 1024
    tokens after one at 256 sent prompts beginning with the shorter run's (one stream of draws): the deployment's
    prefix cache answered them (a 256-token push: one block of KV moved). A run's seed is now its --iter unless
    given, and each prompt length draws from its own stream."""
    def script(g):
        return [(None, tokens(g, [65 + i], i == g.max_tokens - 1, "length" if i == g.max_tokens - 1 else "",
                              (stage("finished"),) if i == g.max_tokens - 1 else ())) for i in range(g.max_tokens)]

    async def body():
        async with Harness(make_cfg(tmp_path, "local"), {"local": script}) as h:
            out = []
            for inp in (16, 16, 64):
                a = bench.parse_args(["--url", h.router.url, "--mode", "local", "--qps", "inf", "--num-prompts", "3",
                                      "--input-len", str(inp), "--output-len", "2", "--warmup", "1", "--result-dir",
                                      str(tmp_path / "r"), "--no-progress"])
                out.append(await asyncio.to_thread(bench.run, a))
            return out

    runs = asyncio.run(asyncio.wait_for(body(), 60))
    assert [os.path.basename(p) for p, _ in runs] == [
        "local_qpsinf_in16_out2_iter0.json", "local_qpsinf_in16_out2_iter1.json",
        "local_qpsinf_in64_out2_iter0.json"]
    assert all(s["completed"] == 3 for _, s in runs) and [s["seed"] for _, s in runs] == [0, 1, 0]
    firsts: set[tuple] = set()
    for _, s in runs:
        sent = bench.make_prompts(3, s["input_len"], bench.DEFAULT_VOCAB, s["seed"]) + bench.make_prompts(
            1, s["input_len"], bench.DEFAULT_VOCAB, s["seed"] + 1000)
        starts = {tuple(p[:16]) for p in sent}
        assert not starts & firsts
        firsts |= starts


def test_busy_devices_need_cuda():
    """The writers-only bench's --busy keeps GPUs computing: on the CPU it refuses, clearly."""
    from tools import transfer_report
    from tools.transfer_writers import devices_busy

    with pytest.raises(ValueError, match="needs CUDA"):
        with devices_busy(["cpu"]):
            pass
    with devices_busy([]):  # nothing to keep busy: a no-op
        pass
    with pytest.raises(SystemExit) as e:
        transfer_report.main(["--writers-only", "--busy", "--device", "cpu"])
    assert e.value.code == 2


def test_transfer_report_prints_no_negative_fixed_cost():
    """A WRITE's time that does not grow with its bytes (here the 16k row's slow rep) put the line's intercept below
    0: the report printed "fixed cost ... -1586 us". It says the cost is not resolved instead."""
    from tools.transfer_report import fixed_cost_line

    mib = 2**20
    noisy = [{"kv_bytes": 4 * mib, "write_ms": 0.62}, {"kv_bytes": 16 * mib, "write_ms": 0.61},
             {"kv_bytes": 64 * mib, "write_ms": 13.83}]
    line = fixed_cost_line(noisy)
    assert "not resolved" in line and "fixed cost (intercept" not in line
    linear = [{"kv_bytes": n * mib, "write_ms": 0.05 + n * mib / 4e9 * 1e3} for n in (4, 16, 64)]
    assert fixed_cost_line(linear).startswith("fixed cost (intercept of WRITE time vs bytes over these lengths): 50 us")
    assert "slope 4.00 GB/s" in fixed_cost_line(linear)


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_transfer_report_times_one_write_per_request(tmp_path, capsys):
    """`pushkv transfer-report` times "the WRITE" against a plain copy of its bytes, but started `pushkv up --mode
    push`, which streams per layer group: its "WRITE ms" summed parts posted during the prefill (5 to 8 per request,
    the last one's time on the wire). It now starts push with --push-stream off: one WRITE, one descriptor here."""
    from tools import transfer_report

    out = tmp_path / "tr.json"
    assert transfer_report.main(["--model", "tiny", "--lengths", "64", "256", "--reps", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["prompt_tokens"] for r in rows] == [64, 256]
    assert all(r["kv_bytes"] > 0 and r["descs"] == 1 for r in rows), rows
    assert "--push-stream off" in capsys.readouterr().out


def test_writers_only_prints_no_negative_intercept_as_a_cost():
    """`transfer-report --writers-only` printed "fixed cost: ... intercept of post->done vs bytes -573 us"."""
    from tools.transfer_writers import intercept_text

    assert intercept_text(120.4) == "120 us"
    assert intercept_text(-573.0).startswith("not resolved") and "-573 us" in intercept_text(-573.0)
