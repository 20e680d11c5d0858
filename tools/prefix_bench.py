"""Prefix caching, lone chat turns: TTFT with the cache on and off.

For each mode it starts one deployment per cache setting (``pushkv up`` as a subprocess,
tools.launch) and runs ``--conversations`` two-turn conversations one request at a time:
turn 1 is a shared system prompt and a question, turn 2 repeats turn 1's prompt and answer
and asks a follow-up. From every answer's timeline it takes TTFT (router arrival -> the
router's first token) and, from the instances' counters, the prompt tokens found cached and
the KV bytes moved. It prints medians per (mode, cache, turn) and writes JSON.

    python -m tools.prefix_bench --modes local push pull-background --system 1024 --question 64 \\
        --answer 32 --conversations 4 --up-args "--model small"
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import tempfile

from tools.launch import launched
from tools.sweep import MODES, mode_flags


def counters(dep, role: str) -> dict:
    return dict(dep.stats(role).counters)


def run(mode: str, cache: bool, args, log_dir: str) -> list[dict]:
    rng = random.Random(args.seed)
    system = [rng.randrange(1, args.vocab) for _ in range(args.system)]
    flags = [*mode_flags(mode), *shlex.split(args.up_args), *([] if cache else ["--no-prefix-cache"])]
    computes = "local" if mode == "local" else "prefill"
    side = computes if mode == "local" else ("prefill" if mode.startswith("push") else "decode")
    rows = []
    with launched(*flags, log_path=os.path.join(log_dir, f"{mode}-{'on' if cache else 'off'}.log")) as dep:
        warm = [rng.randrange(1, args.vocab) for _ in range(args.system)]  # shapes, not the system prompt
        dep.tokens(warm, 2)
        for c in range(args.conversations):
            question = [rng.randrange(1, args.vocab) for _ in range(args.question)]
            prompt = system + question
            for turn in (1, 2):
                before = (counters(dep, computes), counters(dep, side))
                status, body = dep.post("/v1/completions", {"prompt": prompt, "max_tokens": args.answer})
                if status != 200:
                    raise RuntimeError(f"{mode}: HTTP {status}: {body}")
                after = (counters(dep, computes), counters(dep, side))
                tl = body["pushkv"]["timeline"]
                rows.append({
                    "mode": mode, "cache": cache, "conversation": c, "turn": turn, "prompt_tokens": len(prompt),
                    "ttft_ms": (tl["router.first_token"] - tl["router.arrival"]) * 1e3,
                    "hit_tokens": after[0].get("prefix_hit_tokens", 0) - before[0].get("prefix_hit_tokens", 0),
                    "kv_bytes": after[1].get("kv_bytes", 0) - before[1].get("kv_bytes", 0),
                })
                answer = body["choices"][0]["token_ids"]
                follow = [rng.randrange(1, args.vocab) for _ in range(args.question)]
                prompt = prompt + answer + follow
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'mode':>16} {'cache':>5} {'turn':>4} {'prompt':>6} {'TTFT ms p50':>11} {'hit tok p50':>11} "
             f"{'KV MB p50':>9} {'TTFT off/on':>11}"]
    keys = list(dict.fromkeys((r["mode"], r["cache"], r["turn"]) for r in rows))
    med = {}
    for k in keys:
        sel = [r for r in rows if (r["mode"], r["cache"], r["turn"]) == k]
        med[k] = {f: statistics.median(r[f] for r in sel)
                  for f in ("prompt_tokens", "ttft_ms", "hit_tokens", "kv_bytes")}
    for (mode, cache, turn) in keys:
        m = med[(mode, cache, turn)]
        off = med.get((mode, False, turn))
        ratio = f"{off['ttft_ms'] / m['ttft_ms']:>11.2f}" if cache and off else f"{'':>11}"
        lines.append(f"{mode:>16} {'on' if cache else 'off':>5} {turn:>4} {m['prompt_tokens']:>6.0f} "
                     f"{m['ttft_ms']:>11.1f} {m['hit_tokens']:>11.0f} {m['kv_bytes'] / 1e6:>9.2f} {ratio}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", nargs="+", default=["local", "push", "pull-background"], choices=sorted(MODES))
    ap.add_argument("--system", type=int, default=1024, help="tokens of the shared system prompt")
    ap.add_argument("--question", type=int, default=64, help="tokens of each question and follow-up")
    ap.add_argument("--answer", type=int, default=32, help="max_tokens of each turn")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=250, help="prompt ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--up-args", default="--model small", help="extra `pushkv up` flags for every deployment")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    log_dir = tempfile.mkdtemp(prefix="pushkv-prefix-bench-")
    rows = []
    for mode in args.modes:
        for cache in (False, True):
            rows += run(mode, cache, args, log_dir)
            print(table([r for r in rows if r["mode"] == mode]), flush=True)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": sys.argv[1:], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
