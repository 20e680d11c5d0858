"""pushkv chat workload: multi-turn conversations sharing one system prompt.

Each conversation starts at a Poisson arrival (``--rate`` conversations per second) and runs
2-8 turns (``--turns``). Turn k's prompt is the shared system prompt, every earlier user turn
and answer (the answer's own token ids, as the server generated them), and a new user turn;
after each answer the user "thinks" for an exponential time (``--think-s`` mean) and asks again.
So turn k >= 2 repeats everything of turn k-1, and every turn repeats the system prompt: the
traffic a prefix cache is for.

Printed per turn: TTFT and TPOT p50/p99 (from the router's timeline and the answer's wall
time), how much of the prompts was a prefix already sent ("reusable"), how much the server
says it took from its cache ("cached", ``usage.prompt_tokens_details.cached_tokens`` when it
reports it), and which path each request took (the legs and instances in ``pushkv``).

A router started with ``--api-key`` gets the key from ``PUSHKV_API_KEY``, else ``OPENAI_API_KEY``
(tools/bench.py's ``auth_headers``). Exit status 1 when any turn failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from tools.bench import auth_headers

DEFAULT_VOCAB = 256


# --------------------------------------------------------------------------- the workload (pure)
@dataclass
class Conversation:
    start_s: float  # arrival of its first turn, from the run's start
    user_turns: list[list[int]]  # token ids of each user turn
    think_s: list[float]  # pause after each answer before the next turn


def make_conversations(n: int, rate: float, turns: tuple[int, int], user_len: tuple[int, int],
                       think_s: float, vocab: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        k = rng.randint(*turns)
        users = [[rng.randrange(1, vocab) for _ in range(rng.randint(*user_len))] for _ in range(k)]
        out.append(Conversation(t, users, [rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0 for _ in range(k)]))
    return out


def system_prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed ^ 0x5157)
    return [rng.randrange(1, vocab) for _ in range(length)]


def longest_sent_prefix(prompt: list[int], sent: list[list[int]]) -> int:
    """Tokens at the start of ``prompt`` that some earlier prompt (or prompt + answer) began with."""
    best = 0
    for s in sent:
        n = min(len(s), len(prompt))
        i = 0
        while i < n and s[i] == prompt[i]:
            i += 1
        best = max(best, i)
    return best


@dataclass
class TurnResult:
    conv: int
    turn: int  # 1-based
    prompt_len: int
    reusable: int  # tokens of the prompt a request already sent began with
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    tpot_s: Optional[float] = None
    output: list[int] = field(default_factory=list)
    cached: Optional[int] = None  # what the server reports it reused
    path: str = ""


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(results: list[TurnResult]) -> list[dict]:
    """One row per turn index (and one for all turns >= 2), figures in ms."""
    groups: dict[str, list[TurnResult]] = defaultdict(list)
    for r in results:
        groups[str(r.turn)].append(r)
        if r.turn >= 2:
            groups[">=2"].append(r)
    rows = []
    for key in sorted(groups, key=lambda k: (k == ">=2", int(k) if k.isdigit() else 0)):
        rs = groups[key]
        ok = [r for r in rs if r.ok]
        ttft = [r.ttft_s * 1e3 for r in ok]
        tpot = [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None]
        prompt = sum(r.prompt_len for r in ok)
        cached = [r.cached for r in ok if r.cached is not None]
        rows.append({
            "turn": key, "requests": len(rs), "failed": len(rs) - len(ok),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
            "reusable": sum(r.reusable for r in ok) / prompt if prompt else float("nan"),
            "cached": sum(cached) / prompt if cached and len(cached) == len(ok) and prompt else None,
            "paths": dict(Counter(r.path for r in ok)),
        })
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'turn':>5} {'reqs':>5} {'fail':>4} {'TTFT p50':>9} {'p99':>9} {'TPOT p50':>9} {'p99':>8} "
             f"{'reusable':>8} {'cached':>7}  paths"]
    for r in rows:
        cached = "n/a" if r["cached"] is None else f"{100 * r['cached']:.0f} %"
        paths = ", ".join(f"{k or '?'}: {v}" for k, v in sorted(r["paths"].items()))
        lines.append(f"{r['turn']:>5} {r['requests']:>5} {r['failed']:>4} {r['ttft_p50']:>9.1f} {r['ttft_p99']:>9.1f} "
                     f"{r['tpot_p50']:>9.2f} {r['tpot_p99']:>8.2f} {100 * r['reusable']:>7.0f} % {cached:>7}  {paths}")
    return "\n".join(lines)


def request_path(ext: dict) -> str:
    """Which legs served it: ``P->D push|late|pull`` (with the stream kind), ``D only`` (D
    prefilled it itself: conditional disaggregation), or the one leg."""
    inst = ext.get("instances") or {}
    legs = sorted(inst)
    path = ext.get("path", "")
    if path == "decode-local":
        return "D only"
    if "prefill" in legs and "decode" in legs:
        kv = (ext.get("kv") or {}).get("prefill") or {}
        how = path if path in ("push", "late", "pull") else ("pull" if ext.get("allocation") == "late" else "push")
        return f"P->D {how}" + (f" ({kv['stream']})" if kv.get("stream") else "")
    return "+".join(legs) or "?"


def turn_times(timeline: dict[str, float], wall_s: float, n: int) -> tuple[float, Optional[float]]:
    """TTFT and TPOT of one answered turn (a whole, unstreamed answer): both on the router's clock where its timeline
    has them (arrival, first token, finish), so that TPOT is not the client's wall time, with the HTTP round trip
    and the answer's serialisation in it, less a TTFT the router measured; else the client's wall time."""
    start, first, end = (timeline.get(k) for k in ("router.arrival", "router.first_token", "router.finish"))
    ttft = first - start if start is not None and first is not None else wall_s
    if n < 2:
        return ttft, None
    last = end - start if start is not None and end is not None and first is not None else wall_s
    return ttft, (last - ttft) / (n - 1)


# --------------------------------------------------------------------------- running it
async def _turn(session, url: str, conv: int, turn: int, prompt: list[int], reusable: int, output_len: int,
                model: str) -> TurnResult:
    res = TurnResult(conv, turn, len(prompt), reusable)
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
    if model:
        body["model"] = model
    start = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            data = await resp.json(content_type=None)
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {str(data)[:300]}"
                return res
    except Exception as e:  # a failed request is data
        res.error = f"{type(e).__name__}: {e}"
        return res
    wall = time.perf_counter() - start
    ch = data["choices"][0]
    res.output = list(ch.get("token_ids") or [])
    ext = data.get("pushkv") or {}
    n = len(res.output)
    res.ttft_s, res.tpot_s = turn_times(ext.get("timeline") or {}, wall, n)
    details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
    res.cached = details.get("cached_tokens")
    res.path = request_path(ext)
    res.ok = n > 0
    return res


async def _conversation(session, url: str, i: int, conv: Conversation, system: list[int], output_len: int,
                        model: str, t0: float, sent: list[list[int]], out: list[TurnResult]) -> None:
    await asyncio.sleep(max(0.0, t0 + conv.start_s - time.perf_counter()))
    history = list(system)
    for k, user in enumerate(conv.user_turns, start=1):
        prompt = history + user
        reusable = longest_sent_prefix(prompt, sent)
        sent.append(prompt)
        r = await _turn(session, url, i, k, prompt, reusable, output_len, model)
        out.append(r)
        if not r.ok:
            return  # the conversation ends with a failed turn: the next one has no answer to build on
        history = prompt + r.output
        sent.append(history)
        await asyncio.sleep(conv.think_s[k - 1])


async def run_chat(base_url: str, convs: list[Conversation], system: list[int], output_len: int,
                   model: str = "", progress=None) -> list[TurnResult]:
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    out: list[TurnResult] = []
    sent: list[list[int]] = []
    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers()) as session:
        tasks = [asyncio.create_task(_conversation(session, url, i, c, system, output_len, model, t0, sent, out))
                 for i, c in enumerate(convs)]
        total = sum(len(c.user_turns) for c in convs)
        while tasks:
            done, pending = await asyncio.wait(tasks, timeout=1.0)
            tasks = list(pending)
            if progress is not None:
                progress(len(out), total)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pushkv bench --workload chat", description=__doc__.split("\n\n")[0],
                                 epilog="A router started with --api-key: the key is sent as 'Authorization: Bearer "
                                        "KEY' from $PUSHKV_API_KEY, else $OPENAI_API_KEY (as vllm bench serve). "
                                        "Exit status: 0 when every turn completed, 1 when any failed")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--rate", type=float, default=1.0, help="conversations started per second (Poisson)")
    ap.add_argument("--turns", type=int, nargs=2, default=(2, 8), metavar=("MIN", "MAX"))
    ap.add_argument("--system-len", type=int, default=512, help="tokens of the system prompt every conversation shares")
    ap.add_argument("--user-len", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--think-s", type=float, default=0.5, help="mean pause between an answer and the next turn")
    ap.add_argument("--vocab", type=int, default=DEFAULT_VOCAB)
    ap.add_argument("--model", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write every turn and the summary as JSON here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    convs = make_conversations(args.conversations, args.rate, tuple(args.turns), tuple(args.user_len),
                               args.think_s, args.vocab, args.seed)
    system = system_prompt(args.system_len, args.vocab, args.seed)

    def progress(done: int, total: int) -> None:
        print(f"\rchat: {done}/{total} turns", end="", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    results = asyncio.run(run_chat(args.base_url, convs, system, args.output_len, args.model, progress))
    print(file=sys.stderr)
    rows = summarize(results)
    print(format_rows(rows))
    print(f"{len(results)} turns in {time.perf_counter() - t0:.1f} s, {sum(not r.ok for r in results)} failed")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "summary": rows,
                       "turns": [{k: v for k, v in r.__dict__.items() if k != "output"} for r in results]}, f, indent=1)
    return 1 if any(not r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
