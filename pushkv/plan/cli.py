"""``pushkv plan``: predicted TTFT and TPOT per mode and per P:D ratio (a simulation; starts nothing).

    pushkv plan --workload '{"kind": "poisson", "qps": 8, "requests": 400, "prompt": [16384, 16384], "output": 256}' \\
        --profile qwen3-32b-tp8-rdma --instances 8 16 32 64

``--profile``: a preset, a JSON file of a ``Profile``, or a router's ``/health`` body (its fitted
``costs``: what ``pushkv status`` shows). ``--pd 1:1 2:2`` simulates those ratios; ``--instances N``
every P share in eighths of N. Rows sort by predicted e2e p50 (TTFT + output x TPOT) per N and mode.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from pushkv.plan import profile as PR
from pushkv.plan import sim
from pushkv.plan import workload as W
from pushkv.protocol.link_queue import ORDERS


def _json_arg(text: str) -> dict:
    if os.path.exists(text):
        with open(text) as f:
            return json.load(f)
    return json.loads(text)


def load_profile(text: str) -> PR.Profile:
    if text in PR.PRESETS:
        return PR.PRESETS[text]()
    return PR.from_dict(_json_arg(text))


def with_link(prof: PR.Profile, args) -> PR.Profile:
    """The profile with the link flags given on the command line (the link model: plan/link.py)."""
    got = {k: v for k, v in (("link_window", args.link_window), ("link_order", args.link_order),
                             ("link_overlap_share", args.link_overlap)) if v is not None}
    if got and prof.link_window is None and "link_window" not in got:
        got["link_window"] = 0  # an order or an overlap share alone: the link model, every WRITE at once
    got.update({k: v for k, v in (("max_batch_tokens", args.max_batch_tokens), ("max_num_seqs", args.max_num_seqs),
                                  ("one_device", args.one_device or None)) if v is not None})
    if args.num_blocks is not None:  # the deployment's --num-blocks: every P's pool and every D's
        if args.num_blocks < 1:
            raise ValueError(f"--num-blocks {args.num_blocks} < 1")
        got["p_capacity_tokens"] = got["d_capacity_tokens"] = args.num_blocks * prof.block_size
    return dataclasses.replace(prof, **got) if got else prof


def check_fits(wl: W.Workload, prof: PR.Profile) -> None:
    """Refuse a workload with a request no instance could hold (pushkv refuses such a prompt; the
    simulation would leave it waiting forever)."""
    turns = [t for conv in wl.conversations() for t in conv]
    need = max((t.prompt + t.output for t in turns), default=0)
    prompt = max((t.prompt for t in turns), default=0)
    if need > prof.d_capacity_tokens:
        raise ValueError(f"a request of {need} tokens (prompt and output) does not fit a D of "
                         f"{prof.d_capacity_tokens} tokens: give more --num-blocks")
    if prompt > prof.p_capacity_tokens:
        raise ValueError(f"a prompt of {prompt} tokens does not fit a P of {prof.p_capacity_tokens} tokens: "
                         f"give more --num-blocks")


def ratios(args) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for pd in args.pd or ():
        p, d = pd.split(":")
        out.append((int(p), int(d)))
    for n in args.instances or ():
        ps = sorted({max(1, min(n - 1, round(n * k / 8))) for k in range(1, 8)})
        out += [(p, n - p) for p in ps]
    return out or [(1, 1)]


def plan(wl: W.Workload, prof: PR.Profile, modes, pds, prefix_cache: bool, turns: str) -> list[dict]:
    rows, seen_local = [], set()
    for n_p, n_d in pds:
        for mode in modes:
            if mode == "local":  # every instance does both: one run per instance count
                if n_p + n_d in seen_local:
                    continue
                seen_local.add(n_p + n_d)
            reqs = sim.simulate(wl, prof, mode, n_p, n_d, prefix_cache=prefix_cache)
            s = sim.summary(reqs, turns)
            out = max((r.turn.output for r in reqs), default=1)
            rows.append(dict(s, mode=mode, p=0 if mode == "local" else n_p, d=n_d if mode != "local" else n_p + n_d,
                             instances=n_p + n_d, e2e_p50=s["ttft_p50"] + (out - 1) * s["tpot_p50"]))
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'N':>3} {'mode':<12} {'P:D':>6} {'TTFT p50':>9} {'p99':>9} {'TPOT p50':>9} {'p99':>7} "
             f"{'e2e p50':>9}  paths"]
    for r in sorted(rows, key=lambda r: (r["instances"], r["mode"], r["e2e_p50"])):
        pd = f"{r['p']}:{r['d']}" if r["mode"] != "local" else f"{r['d']}"
        paths = ", ".join(f"{k}: {v}" for k, v in sorted(r["paths"].items()))
        lines.append(f"{r['instances']:>3} {r['mode']:<12} {pd:>6} {r['ttft_p50']:>9.1f} {r['ttft_p99']:>9.1f} "
                     f"{r['tpot_p50']:>9.2f} {r['tpot_p99']:>7.2f} {r['e2e_p50']:>9.1f}  {paths}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pushkv plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", required=True, help="JSON (inline or a file): see pushkv.plan.workload.from_dict")
    ap.add_argument("--profile", required=True, help=f"a preset ({', '.join(PR.PRESETS)}) or a JSON file")
    ap.add_argument("--modes", nargs="+", default=list(sim.MODES), choices=sim.MODES)
    ap.add_argument("--pd", nargs="+", metavar="P:D", help="P:D ratios to simulate")
    ap.add_argument("--instances", nargs="+", type=int, metavar="N", help="instances in all (every P share in eighths)")
    ap.add_argument("--link-window", type=int, metavar="POSTS",
                    help="model the link each P -> D pair shares: P's WRITEs in flight on it at a time, the rest "
                         "queued (0: all at once); without it (or the two flags below, or a profile's "
                         "link_window) each transfer moves alone at the link's rate however many overlap")
    ap.add_argument("--link-order", choices=ORDERS, help="which queued WRITE goes next (default arrival)")
    ap.add_argument("--link-overlap", type=float, metavar="SHARE",
                    help="what the link moves with several transfers on it, as a share of one transfer's rate "
                         "(default 1: fair sharing; about 0.6 over UCX's TCP lanes from GPU memory, issue 27)")
    ap.add_argument("--max-batch-tokens", type=int, metavar="TOKENS",
                    help="P's step budget (the deployment's --max-batch-tokens): the prompts that wait while a "
                         "step runs go in the next one together, each waiting for all of it (default: the "
                         "profile's; 0, one prompt a step)")
    ap.add_argument("--max-num-seqs", type=int, metavar="N", help="the most prompts in one P step (default: the "
                                                                  "profile's, 64)")
    ap.add_argument("--num-blocks", type=int, metavar="BLOCKS",
                    help="each P's and D's KV pool in blocks of the profile's block size, as the deployment's "
                         "--num-blocks: a prompt holds P's blocks until its KV has left P (pull: until D's READ "
                         "ends), a request D's from its reservation (default: the profile's capacities)")
    ap.add_argument("--one-device", action="store_true",
                    help="P and D on one GPU: their steps that run at once share it, each at an equal share")
    ap.add_argument("--turns", choices=("all", "1", ">=2"), default="all", help="which turns the figures cover")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--best", action="store_true", help="only the best ratio per N and mode")
    ap.add_argument("--out", help="write the rows, the workload and the profile as JSON here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        wl = W.from_dict(_json_arg(args.workload))
        prof = with_link(load_profile(args.profile), args)
        check_fits(wl, prof)
    except (ValueError, KeyError, TypeError, OSError) as e:
        print(f"pushkv plan: {e}", file=sys.stderr)
        return 2
    rows = plan(wl, prof, args.modes, ratios(args), not args.no_prefix_cache, args.turns)
    if args.best:
        best: dict = {}
        for r in rows:
            k = (r["instances"], r["mode"])
            if k not in best or r["e2e_p50"] < best[k]["e2e_p50"]:
                best[k] = r
        rows = list(best.values())
    print(f"profile {prof.name}: {json.dumps(prof.costs.as_dict())}")
    if prof.link_window is not None:
        print(f"link per P -> D: window {prof.link_window or 'unbounded'}, order {prof.link_order}, "
              f"{prof.link_overlap_share:g} of one transfer's rate with several on it")
    print(format_rows(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"workload": _json_arg(args.workload), "profile": prof.as_dict(), "rows": rows}, f, indent=1)
    return 0
