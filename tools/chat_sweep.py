"""pushkv chat-sweep: the chat workload against each prefix-cache and conditional-disaggregation
setting, with the planner checked against every run.

For every (layout, cache, conditional) cell it starts one deployment (``pushkv up`` as a
subprocess, tools.launch), sends one warm-up prompt, runs ``pushkv bench --workload chat``
in-process, reads the router's ``/health`` (its fitted cost model), and simulates the same
workload with those costs (``pushkv plan``'s simulator, the same P:D). It prints one line per
run: turn 1 and turns >= 2, measured and simulated, and the paths the requests took.

    pushkv chat-sweep --layouts 1p1d 2p2d --cache on off --conditional off on --reps 2 \\
        --up-args "--model small --num-blocks 1024" --bench-args "--conversations 16 --rate 4" \\
        --result-dir chat-runs
    pushkv chat-sweep --result-dir chat-runs --resimulate   # the saved runs against today's planner
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time

from pushkv.plan import profile as PR
from pushkv.plan import sim
from pushkv.plan import workload as W
from tools import chat_bench as CB
from tools.launch import launched

LAYOUTS = {"1p1d": (1, 1), "2p2d": (2, 2), "1p2d": (1, 2), "2p1d": (2, 1)}


def workload_of(b: argparse.Namespace) -> W.Recorded:
    """The planner's twin of a chat bench's arguments: the very conversations it sends."""
    convs = CB.make_conversations(b.conversations, b.rate, tuple(b.turns), tuple(b.user_len), b.think_s,
                                  b.vocab, b.seed)
    return W.Recorded(b.system_len, b.output_len, tuple(c.start_s for c in convs),
                      tuple(tuple(len(u) for u in c.user_turns) for c in convs),
                      tuple(tuple(c.think_s) for c in convs))


def simulated(b: argparse.Namespace, health: dict, n_p: int, n_d: int, cache: bool, cond: bool) -> dict:
    """The simulator's p50s for the run's workload, priced by the run's own fitted costs."""
    prof = PR.from_dict({"name": "fitted", "costs": health.get("costs") or {}})
    reqs = sim.simulate(workload_of(b), prof, "conditional" if cond else "push", n_p, n_d, prefix_cache=cache)
    return {k: sim.summary(reqs, k) for k in ("1", ">=2")}


def run_cell(args, layout: str, cache: bool, cond: bool, rep: int) -> dict:
    n_p, n_d = LAYOUTS[layout]
    b = CB.parse_args(shlex.split(args.bench_args) + ["--seed", str(args.seed + rep)])
    flags = ["--mode", "push", "--prefill-instances", str(n_p), "--decode-instances", str(n_d),
             *shlex.split(args.up_args), *([] if cache else ["--no-prefix-cache"]),
             *(["--conditional-disagg"] if cond else [])]
    name = f"{layout}_cache-{'on' if cache else 'off'}_cond-{'on' if cond else 'off'}_r{rep}"
    log = os.path.join(args.result_dir, name + ".log")
    t0 = time.perf_counter()
    with launched(*flags, log_path=log, start_timeout_s=args.start_timeout) as dep:
        started = time.perf_counter() - t0
        warm = CB.system_prompt(b.system_len, b.vocab, b.seed + 99)  # shapes and kernels, not the system prompt
        dep.tokens(warm, 2)
        convs = CB.make_conversations(b.conversations, b.rate, tuple(b.turns), tuple(b.user_len), b.think_s,
                                      b.vocab, b.seed)
        system = CB.system_prompt(b.system_len, b.vocab, b.seed)
        results = asyncio.run(CB.run_chat(dep.url, convs, system, b.output_len, b.model))
        health = dep.health()
    rows = {r["turn"]: r for r in CB.summarize(results)}
    out = {"name": name, "layout": layout, "cache": cache, "conditional": cond, "rep": rep,
           "start_s": started, "load1": os.getloadavg()[0], "bench_args": vars(b), "measured": rows,
           "costs": health.get("costs") or {}, "simulated": simulated(b, health, n_p, n_d, cache, cond),
           "turns": [{k: v for k, v in r.__dict__.items() if k != "output"} for r in results]}
    with open(os.path.join(args.result_dir, name + ".json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def _err(meas: float, simv: float) -> str:
    return f"{100 * (simv - meas) / meas:+5.0f}%" if meas == meas and meas > 0 and simv == simv else "  n/a"


def format_run(o: dict) -> str:
    m1, m2 = o["measured"].get("1", {}), o["measured"].get(">=2", {})
    s1, s2 = o["simulated"]["1"], o["simulated"][">=2"]
    fail = sum(r.get("failed", 0) for k, r in o["measured"].items() if k != ">=2")
    paths = ", ".join(f"{k}: {v}" for k, v in sorted(m2.get("paths", {}).items()))
    cached = m2.get("cached")
    return (f"{o['layout']:<5} {'on' if o['cache'] else 'off':<3} {'on' if o['conditional'] else 'off':<3} "
            f"{o['rep']:>2} | {m1.get('ttft_p50', float('nan')):8.1f} {s1['ttft_p50']:8.1f} "
            f"{_err(m1.get('ttft_p50', float('nan')), s1['ttft_p50'])} | "
            f"{m2.get('ttft_p50', float('nan')):8.1f} {m2.get('ttft_p99', float('nan')):8.1f} "
            f"{s2['ttft_p50']:8.1f} {_err(m2.get('ttft_p50', float('nan')), s2['ttft_p50'])} | "
            f"{m2.get('tpot_p50', float('nan')):7.2f} {s2['tpot_p50']:7.2f} "
            f"{_err(m2.get('tpot_p50', float('nan')), s2['tpot_p50'])} | "
            f"{100 * m2.get('reusable', float('nan')):4.0f}% "
            f"{'n/a' if cached is None else f'{100 * cached:3.0f}%'} {fail:>4}  {paths}")


HEADER = ("lay   $   cnd rp | turn 1 TTFT p50: meas      sim   err | turns>=2 TTFT p50   p99      sim   err | "
          "TPOT p50  sim    err | reuse cached fail  paths (turns >= 2)")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pushkv chat-sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=["1p1d"], choices=sorted(LAYOUTS))
    ap.add_argument("--cache", nargs="+", default=["on", "off"], choices=("on", "off"))
    ap.add_argument("--conditional", nargs="+", default=["off", "on"], choices=("on", "off"))
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="repetition r runs the bench with seed + r")
    ap.add_argument("--up-args", default="--model small", help="`pushkv up` arguments every run shares")
    ap.add_argument("--bench-args", default="", help="`pushkv bench --workload chat` arguments (not --base-url)")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds a deployment may take to start")
    ap.add_argument("--result-dir", required=True)
    ap.add_argument("--resimulate", action="store_true",
                    help="start nothing: simulate the runs saved in --result-dir again with this planner, each priced "
                         "by its own fitted costs, and print the table")
    return ap.parse_args(argv)


def resimulate(result_dir: str) -> list[dict]:
    runs = []
    for name in sorted(os.listdir(result_dir)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(result_dir, name)) as f:
            o = json.load(f)
        b = argparse.Namespace(**o["bench_args"])
        o["simulated"] = simulated(b, {"costs": o["costs"]}, *LAYOUTS[o["layout"]], o["cache"], o["conditional"])
        runs.append(o)
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.resimulate:
        print("\n".join([HEADER, *map(format_run, resimulate(args.result_dir))]))
        return 0
    os.makedirs(args.result_dir, exist_ok=True)
    cells = [(lay, c == "on", d == "on", rep) for rep in range(args.reps) for lay in args.layouts
             for c in args.cache for d in args.conditional]
    runs, failed = [], 0
    print(HEADER, flush=True)
    for i, cell in enumerate(cells, 1):
        print(f"[{i}/{len(cells)}] {cell[0]} cache {'on' if cell[1] else 'off'} "
              f"conditional {'on' if cell[2] else 'off'} rep {cell[3]}: running", file=sys.stderr, flush=True)
        o = None
        for attempt in (1, 2):  # a deployment that did not start (a port taken meanwhile) gets one more go
            try:
                o = run_cell(args, *cell)
                break
            except (RuntimeError, TimeoutError, OSError) as e:
                print(f"{cell} attempt {attempt}: {str(e)[-2000:]}", file=sys.stderr, flush=True)
        if o is None:
            failed += 1
            continue
        runs.append(o)
        failed += sum(r.get("failed", 0) for k, r in o["measured"].items() if k != ">=2")
        print(format_run(o), flush=True)
    with open(os.path.join(args.result_dir, "table.txt"), "w") as f:
        f.write("\n".join([HEADER, *map(format_run, runs)]) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
