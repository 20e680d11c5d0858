"""tools/link_bench.py's pure parts: the model's KV per token as `pushkv up` would run it, the
wire time at a rate, the pool size, what a run's summary becomes in the tables, and the
arguments it refuses. The bench itself (namespaces, tc, etcd) is run by hand; the cap it relies
on is tests/hosts/test_link_cap.py's."""
from __future__ import annotations

import pytest

from tools import bench, link_bench as lb

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("model, geometry, per_token", [
    ("small", "", 4 * 2 * 4 * 32 * 4),
    ("small", "--num-kv-heads 8 --head-dim 64", 4 * 2 * 8 * 64 * 4),  # the default
    ("medium", "", 8 * 2 * 4 * 64 * 4),
    ("small", "--dtype bfloat16", 4 * 2 * 4 * 32 * 2),
])
def test_kv_per_token_is_what_pushkv_up_runs(model, geometry, per_token):
    m = lb.model_config(model, geometry)
    assert m.kv_bytes_per_token() == per_token
    assert lb.kv_formula(m).endswith(f"= {per_token} B/token")


@pytest.mark.parametrize("tokens, rate, ms", [
    (1024, "1gbit", 16 * 2**20 * 8 / 1e9 * 1e3),  # 16 MiB at 1 Gbit/s: 134 ms
    (1009, "1gbit", 16 * 2**20 * 8 / 1e9 * 1e3),  # whole blocks move: 64 of them
    (1024, "10gbit", 16 * 2**20 * 8 / 1e10 * 1e3),
    (1024, "none", None),
])
def test_wire_time_of_a_prompt(tokens, rate, ms):
    m = lb.model_config("small", lb.DEFAULT_GEOMETRY)
    assert lb.wire_ms(lb.kv_bytes(m, tokens), rate) == ms


def test_pool_holds_the_loaded_run_below_the_pin_cap():
    args = lb.parse_args(["--lengths", "512", "4096", "--load-lengths", "1024", "--num-prompts", "8"])
    per_req = (1024 + args.output_len + 15) // 16
    assert lb.num_blocks(args) >= 2 * 8 * per_req  # pinned at most half of D: no late allocation
    assert lb.num_blocks(args) >= (4096 + args.output_len) // 16


def _summary(timelines, kv, errors=None):
    res = [bench.RequestResult(not e, 100, 4, ttft=0.2, itl=[0.01] * 3, latency=0.23, timeline=tl, kv=k, error=e)
           for tl, k, e in zip(timelines, kv, errors or [""] * len(timelines))]
    return bench.aggregate(res, 1.0, {"mode": "x"})


def test_cell_push_pull_and_local():
    push = {"router.arrival": 0.0, "prefill.prefill_start": 0.01, "prefill.prefill_end": 0.11,
            "prefill.write_posted": 0.112, "prefill.write_done": 0.182, "decode.kv_received": 0.185}
    pull = {"router.arrival": 0.0, "prefill.prefill_start": 0.01, "prefill.prefill_end": 0.11,
            "decode.read_posted": 0.115, "decode.read_done": 0.175, "decode.kv_received": 0.18}
    local = {"router.arrival": 0.0, "local.prefill_start": 0.01, "local.prefill_end": 0.21}
    kv = {"decode": {"bytes": 8 << 20, "descs": 1, "transfer_s": 0.0, "rendezvous": ""}}
    c = lb.cell(_summary([push, pull, push], [kv, kv, kv], ["", "", "HTTP 503"]))
    assert (c["completed"], c["failed"]) == (2, 1)
    assert c["prefill_ms"] == pytest.approx(100.0)
    assert c["pend_to_kv_ms"] == pytest.approx(72.5)  # median of 75 (push) and 70 (pull)
    assert c["wire_ms"] == pytest.approx(65.0)  # WRITE 70, READ 60
    assert c["kv_bytes"] == 8 << 20 and c["wire_gbit_s"] == pytest.approx((8 << 20) * 8 / 65e6)
    loc = lb.cell(_summary([local], [{}]))
    assert loc["prefill_ms"] == pytest.approx(200.0)
    assert loc["pend_to_kv_ms"] is None and loc["wire_ms"] is None and loc["kv_bytes"] is None


def test_table_rows_and_missing_cells():
    args = lb.parse_args(["--modes", "push", "local", "--lengths", "512", "--load-lengths", "1024"])
    c = {"ttft_ms": 190.0, "tpot_ms": 8.0, "failed": 0, "prefill_ms": 115.0, "pend_to_kv_ms": 72.0,
         "wire_ms": 70.0, "wire_gbit_s": 0.96}
    regime = {"push": {"512": {"lone": c}, "1024": {"load": dict(c, failed=2, qps=3.5)}}}
    rows = lb.table("1gbit", regime, args, None).splitlines()
    assert rows[2] == "| push | 512 | 190.0 | 8.0 | 115.0 | 72.0 | 70.0 (0.96 Gbit/s) | - | - | - | - | 0 |"
    assert rows[3].startswith("| push | 1024 | - |") and rows[3].endswith("| 3.5 | 190.0 | 8.0 | 72.0 | 2 |")
    assert rows[4] == "| local | 512 | - | - | - | - | - | - | - | - | - | - |"


@pytest.mark.parametrize("rate, n, link_load, qps", [
    ("1gbit", 1024, 0.9, 0.9 * 1e9 / 8 / (1024 * 16384)),  # 16 MiB of KV: 6.7 QPS fill 90 % of 1 Gbit/s
    ("10gbit", 4096, 0.5, 0.5 * 10e9 / 8 / (4096 * 16384)),
    ("none", 1024, 0.9, 2.0),  # no cap: --qps
    ("1gbit", 1024, None, 2.0),  # no --link-load: --qps
])
def test_load_qps_is_a_share_of_the_capped_link(rate, n, link_load, qps):
    argv = ["--qps", "2"] + (["--link-load", str(link_load)] if link_load is not None else [])
    args = lb.parse_args(argv)
    assert lb.load_qps(rate, n, args, lb.model_config(args.model, args.geometry)) == pytest.approx(qps, abs=1e-3)


def test_ucx_env_binds_the_tcp_lanes_to_the_veth():
    assert lb.ucx_env(lb.parse_args([])) == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
    assert lb.ucx_env(lb.parse_args(["--ucx-tls", "tcp,cuda_copy", "--ucx-net-devices", ""])) == {
        "UCX_TLS": "tcp,cuda_copy"}


@pytest.mark.parametrize("argv", [
    ["--rates", "1gbps"],
    ["--lengths", "40000"],  # past small's max_position
    ["--modes", "push-chunk", "--prefill-chunk", "0"],
])
def test_refused(argv):
    with pytest.raises(SystemExit):
        lb.parse_args(argv)


@pytest.mark.parametrize("spec, mode, chunk, flags", [
    ("push", "push", 256, ["--mode", "push", "--push-stream", "off", "--prefill-chunk", "256"]),
    ("push-layer@0", "push-layer", 0, ["--mode", "push", "--push-stream", "layer"]),
    ("push-chunk@128", "push-chunk", 128, ["--mode", "push", "--push-stream", "chunk", "--prefill-chunk", "128"]),
    ("local@0", "local", 0, ["--mode", "local"]),  # 0: prompts run whole
])
def test_mode_specs(spec, mode, chunk, flags):
    args = lb.parse_args(["--modes", spec, "--prefill-chunk", "256"])
    assert lb.split_mode(spec)[0] == mode and lb.chunk_of(spec, args) == chunk
    assert lb.mode_flags(spec, args) == flags


@pytest.mark.parametrize("argv", [
    ["--modes", "push@x"], ["--modes", "pushy"], ["--modes", "push", "push"],
    ["--modes", "push-chunk@0"], ["--modes", "push-chunk", "--prefill-chunk", "0"],
])
def test_refused_mode_specs(argv):
    with pytest.raises(SystemExit):
        lb.parse_args(argv)


def test_goal_pairs_match_chunks():
    args = lb.parse_args(["--modes", "push", "push-chunk", "push@512", "push-chunk@512", "push-chunk@128",
                          "local", "--prefill-chunk", "256"])
    assert lb.goal_pairs(args) == [("push-chunk", "push"), ("push-chunk@512", "push@512")]


def test_goal_hidden_and_its_stages():
    lone = lambda ttft, pre, tail, parts=0: {"lone": {"ttft_ms": ttft, "prefill_ms": pre, "pend_to_kv_ms": tail,
                                                      "parts": parts}}
    regime = {"push": {"1024": lone(420.0, 275.0, 140.0)}, "push-chunk": {"1024": lone(315.0, 280.0, 30.0, 3)}}
    g = lb.goal(regime, 1024)
    assert g["least"] == 140.0 and g["goal_ttft"] == pytest.approx(420.0 - 0.8 * 140.0)
    assert g["hidden"] == pytest.approx(105.0) and g["hidden_share"] == pytest.approx(0.75)
    assert g["tail_hidden"] == pytest.approx(110.0) and g["prefill_delta"] == pytest.approx(5.0)
    assert not g["met"] and g["parts"] == 3
    assert g["cpu_delta"] is None and g["wait_delta"] is None  # no CPU figures in these cells
    regime["push"]["1024"]["lone"]["cpu_ms"] = {"prefill-worker": 260.0, "prefill-worker wait": 10.0}
    regime["push-chunk"]["1024"]["lone"]["cpu_ms"] = {"prefill-worker": 262.0, "prefill-worker wait": 13.0}
    g = lb.goal(regime, 1024)
    assert g["cpu_delta"] == pytest.approx(2.0) and g["wait_delta"] == pytest.approx(3.0)
    assert lb.goal(regime, 2048) is None
    assert "NOT met" in lb.goal_line(g) and "75 % of min" in lb.goal_line(g)


def test_cell_parts_and_cpu():
    tl = {"router.arrival": 0.0, "prefill.prefill_start": 0.01, "prefill.stream_start": 0.07,
          "prefill.part_post_first": 0.0702, "prefill.part_done_first": 0.1052, "prefill.part_done_last": 0.25,
          "prefill.prefill_end": 0.29, "prefill.write_posted": 0.291, "prefill.write_done": 0.325,
          "decode.kv_received": 0.327}
    kv = {"decode": {"bytes": 4 << 20}, "prefill": {"bytes": 16 << 20, "parts": 3, "stream": "chunk"}}
    s = _summary([tl, tl], [kv, kv])
    s["cpu_ms"] = [{"prefill-worker": 270.0, "prefill-worker wait": 10.0, "router": 3.0},
                   {"prefill-worker": 290.0, "prefill-worker wait": 30.0, "router": 5.0}]
    c = lb.cell(s)
    assert c["parts"] == 3 and c["stream"] == "chunk" and c["part_bytes"] == 12 << 20
    assert c["chunk1_ms"] == pytest.approx(60.0) and c["part_lag_ms"] == pytest.approx(0.2)
    assert c["part1_ms"] == pytest.approx(35.0) and c["parts_idle_ms"] == pytest.approx(40.0)
    assert c["cpu_ms"] == {"prefill-worker": 280.0, "prefill-worker wait": 20.0, "router": 4.0}
    args = lb.parse_args(["--modes", "push-chunk", "--lengths", "1024"])
    rows = lb.cpu_table({"push-chunk": {"1024": {"lone": c}}}, args).splitlines()
    assert rows[0] == "| mode | tokens | prefill-worker | prefill-worker wait | rest |"
    assert rows[2] == "| push-chunk | 1024 | 280.0 | 20.0 | 4.0 |"


def test_pooled_loaded_runs():
    ok = {"router.arrival": 0.0, "prefill.prefill_start": 0.0, "prefill.prefill_end": 0.1, "decode.kv_received": 0.2}
    a = bench.aggregate([bench.RequestResult(True, 100, 4, ttft=t, itl=[0.01] * 3, latency=t + 0.03, timeline=ok)
                         for t in (0.3, 0.5)], 1.0, {"mode": "x"})
    b = bench.aggregate([bench.RequestResult(True, 100, 4, ttft=0.9, itl=[0.02] * 3, latency=0.96, timeline=ok),
                         bench.RequestResult(False, 100, 0, error="HTTP 503")], 1.0, {"mode": "x"})
    a["cpu_ms"], b["cpu_ms"] = [{"prefill-worker": 100.0}], [{"prefill-worker": 300.0}]
    p = lb.pooled([a, b])
    assert (p["completed"], p["failed"]) == (3, 1)
    assert p["median_ttft_ms"] == pytest.approx(500.0)  # of 300, 500, 900: the failed one left out
    assert p["median_tpot_ms"] == pytest.approx(10.0)
    assert lb.cell(p)["cpu_ms"] == {"prefill-worker": 200.0}
    assert lb.pooled([a]) is a


def test_plot_cells_are_the_table_figures():
    args = lb.parse_args(["--modes", "push", "--lengths", "512", "--load-lengths", "1024", "--qps", "2"])
    regime = {"push": {"512": {"lone": {"ttft_ms": 190.0, "tpot_ms": 8.0}},
                       "1024": {"load": {"ttft_ms": 900.0, "tpot_ms": None}}}}
    assert lb.plot_cells(regime, args) == {("push", 0.0, 512): {"median_ttft_ms": 190.0, "median_tpot_ms": 8.0},
                                           ("push", 2.0, 1024): {"median_ttft_ms": 900.0}}


def test_each_rate_sends_its_own_prompts():
    """One deployment serves every rate: the same prompts at the next rate would hit P's and D's
    prefix caches and move no KV."""
    args = lb.parse_args(["--rates", "25gbit", "10gbit", "--lengths", "1024", "--reps", "2"])
    first, second = lb.lone_prompts(1024, "25gbit", args), lb.lone_prompts(1024, "10gbit", args)
    assert len(first) == len(second) == 2 and all(len(p) == 1024 for p in first + second)
    assert not {tuple(p[:16]) for p in first} & {tuple(p[:16]) for p in second}  # not one first block shared
    assert lb.lone_prompts(1024, "25gbit", args) == first  # and each rate's are the same from run to run
    assert lb.rate_seed("25gbit", args) != lb.rate_seed("10gbit", args)


def test_the_link_probe_s_sizes_scale_with_the_cap():
    assert lb.probe_sizes(25e9) == [119 * 2**20, 477 * 2**20]  # 40 and 160 ms at 25 Gbit/s
    assert lb.probe_sizes(1e8) == [2**20, 2 * 2**20]  # at least 1 MiB
    assert lb.probe_sizes(1e9, [0.5, 8.0]) == [2**19, 8 * 2**20]  # as given


def test_no_run_sends_a_prompt_whose_start_an_earlier_run_sent():
    """One deployment per mode serves every rate, length and round: the loaded runs at two --load-lengths drew from
    one seed per round, so the 1024-token prompts began with the 512-token run's, half of each in the prefix cache."""
    args = lb.parse_args(["--rates", "1gbit", "none", "--lengths", "512", "1024", "--load-lengths", "512", "1024",
                          "--load-rounds", "2", "--num-prompts", "6", "--reps", "3"])
    seen: dict[tuple, str] = {}

    def check(prompts, what):
        for p in prompts:
            assert tuple(p[:16]) not in seen, f"{what} resends {seen[tuple(p[:16])]}'s prompt"
            seen[tuple(p[:16])] = what

    for rate in args.rates:
        for n in args.lengths:
            check(lb.lone_prompts(n, rate, args), f"lone {rate} {n}")
        for it in range(args.load_rounds):
            for n in args.load_lengths:
                b = lb.loaded_args("http://x", "push", rate, n, args, "out", it)
                check(bench.make_prompts(b.num_prompts, b.input_len, b.vocab_size, b.seed), f"load {rate} {n} {it}")
