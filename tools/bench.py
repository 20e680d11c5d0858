"""pushkv bench: load generator for ``/v1/completions`` (streaming).

Poisson arrivals at ``--qps``, random-token prompts of ``--input-len``,
``--output-len`` tokens each (EOS ignored). Records per request TTFT, TPOT,
ITLs, end-to-end latency and the router's ``pushkv.timeline``, and writes one
JSON per run, named ``<mode>_qps<q>_in<in>_out<out>_iter<i>.json``, with
``vllm bench serve`` field names plus a ``stages`` breakdown. A router started with
``--api-key`` gets the key from ``PUSHKV_API_KEY``, else ``OPENAI_API_KEY`` (as ``vllm bench
serve`` sends it). Exit status 1 when any request failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Mapping, Optional

import numpy as np

from pushkv import envs

RESULT_RE = re.compile(r"^(?P<mode>.+)_qps(?P<qps>[^_]+)_in(?P<inp>\d+)_out(?P<out>\d+)_iter(?P<it>\d+)\.json$")
DEFAULT_VOCAB = 256  # byte ids: valid for every preset, never BOS/EOS


# ---------------------------------------------------------------------------
# naming
# ---------------------------------------------------------------------------
def fmt_qps(qps: float) -> str:
    if math.isinf(qps):
        return "inf"
    return str(int(qps)) if float(qps).is_integer() else f"{qps:g}"


def result_name(mode: str, qps: float, input_len: int, output_len: int, it: int) -> str:
    return f"{mode}_qps{fmt_qps(qps)}_in{input_len}_out{output_len}_iter{it}.json"


def parse_result_name(name: str) -> Optional[dict]:
    mt = RESULT_RE.match(os.path.basename(name))
    if not mt:
        return None
    return {"mode": mt["mode"], "qps": float(mt["qps"]), "input_len": int(mt["inp"]),
            "output_len": int(mt["out"]), "iter": int(mt["it"])}


def next_iter(result_dir: str, mode: str, qps: float, input_len: int, output_len: int) -> int:
    i = 0
    while os.path.exists(os.path.join(result_dir, result_name(mode, qps, input_len, output_len, i))):
        i += 1
    return i


# ---------------------------------------------------------------------------
# one request
# ---------------------------------------------------------------------------
KEY_VARS = ("PUSHKV_API_KEY", "OPENAI_API_KEY")  # the first one set is sent


def auth_headers(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """``Authorization: Bearer KEY`` for a router started with ``--api-key``: the key from
    ``PUSHKV_API_KEY`` (where ``pushkv up`` takes its own from), else ``OPENAI_API_KEY`` (what
    ``vllm bench serve`` sends); neither set: no header."""
    key = next((k for k in (envs.get(name, environ) for name in KEY_VARS) if k), "")
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    timeline: dict[str, float] = field(default_factory=dict)
    transfer_id: str = ""
    error: str = ""
    reserved_block_s: Optional[float] = None  # D blocks x seconds held before the KV arrived
    allocation: str = ""  # "early" (push) | "late" (after P: pull, or push's fallback)
    instances: dict[str, str] = field(default_factory=dict)  # leg -> engine id
    kv: dict[str, dict] = field(default_factory=dict)  # leg -> its KVTransferStats (bytes, transfer_s, ...)

    @property
    def tpot(self) -> Optional[float]:
        if not self.success or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


async def send_request(session, url: str, prompt: list[int], output_len: int, model: str = "") -> RequestResult:
    body = {"prompt": prompt, "max_tokens": output_len, "stream": True, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # the token count in the chunk after the last, as vLLM sends it
    if model:  # the server checks a model it is given against the names it serves
        body["model"] = model
    res = RequestResult(prompt_len=len(prompt))
    start = time.perf_counter()
    last = start
    n_tokens = 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                now = time.perf_counter()
                ch = (chunk.get("choices") or [{}])[0]
                k = len(ch.get("token_ids") or [])
                if k or ch.get("text"):
                    if n_tokens == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    n_tokens += max(k, 1)
                if chunk.get("usage"):
                    n_tokens = chunk["usage"].get("completion_tokens", n_tokens)
                ext = chunk.get("pushkv")
                if ext:
                    res.timeline = ext.get("timeline", {})
                    res.transfer_id = ext.get("transfer_id", "")
                    res.reserved_block_s = ext.get("reserved_block_s", res.reserved_block_s)
                    res.allocation = ext.get("allocation", res.allocation)
                    res.instances = ext.get("instances", res.instances)
                    res.kv = ext.get("kv", res.kv)
        res.latency = time.perf_counter() - start
        res.output_len = n_tokens
        res.success = n_tokens > 0
        if not res.success:
            res.error = "no tokens received"
    except Exception as e:  # a failed request is data, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


# ---------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------
def _stats(name: str, values_s: list[float]) -> dict:
    a = np.asarray(values_s, dtype=float) * 1000.0
    if a.size == 0:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"std_{name}_ms": 0.0, f"p99_{name}_ms": 0.0}
    return {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
            f"std_{name}_ms": float(a.std()), f"p99_{name}_ms": float(np.percentile(a, 99))}


def stage_summary(timelines: list[dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms of each stage since the previous one (per request, in time
    order) and since router arrival; stages ordered by median offset."""
    deltas: dict[str, list[float]] = defaultdict(list)
    offsets: dict[str, list[float]] = defaultdict(list)
    for tl in timelines:
        if not tl:
            continue
        items = sorted(tl.items(), key=lambda kv: kv[1])
        t0 = tl.get("router.arrival", items[0][1])
        prev = items[0][1]
        for stage, t in items:
            deltas[stage].append((t - prev) * 1000.0)
            offsets[stage].append((t - t0) * 1000.0)
            prev = t
    order = sorted(offsets, key=lambda s: float(np.median(offsets[s])))
    return ({s: float(np.median(deltas[s])) for s in order},
            {s: float(np.median(offsets[s])) for s in order})


def block_seconds(ok: list[RequestResult]) -> dict:
    """Push's cost: D blocks x seconds reserved before the KV arrived, per request."""
    a = np.asarray([r.reserved_block_s for r in ok if r.reserved_block_s is not None], dtype=float)
    if a.size == 0:
        return {}
    return {"mean_reserved_block_s": float(a.mean()), "median_reserved_block_s": float(np.median(a)),
            "p99_reserved_block_s": float(np.percentile(a, 99)), "total_reserved_block_s": float(a.sum()),
            "late_allocations": sum(1 for r in ok if r.allocation == "late")}


def aggregate(results: list[RequestResult], duration: float, meta: dict) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    stages, offsets = stage_summary([r.timeline for r in ok])
    out = dict(meta)
    out.update({
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    })
    out.update(_stats("ttft", [r.ttft for r in ok]))
    out.update(_stats("tpot", tpots))
    out.update(_stats("itl", [x for r in ok for x in r.itl]))
    out.update(_stats("e2el", [r.latency for r in ok]))
    out.update(block_seconds(ok))
    out.update({
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "tpots": [r.tpot for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.latency for r in results],
        "errors": [r.error for r in results],
        "transfer_ids": [r.transfer_id for r in results],
        "timelines": [r.timeline for r in results],
        "reserved_block_s": [r.reserved_block_s for r in results],
        "allocations": [r.allocation for r in results],
        "instances": [r.instances for r in results],
        "kv": [r.kv for r in results],
        "stages": stages,
        "stage_offsets": offsets,
    })
    return out


# ---------------------------------------------------------------------------
# a run
# ---------------------------------------------------------------------------
def make_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` random prompts; a stream of their own per (seed, length): drawn from one stream, a run's first prompt
    began with a shorter run's (its prefix in the deployment's prefix cache)."""
    rng = np.random.default_rng([seed, input_len])
    return [rng.integers(0, vocab, size=input_len).tolist() for _ in range(n)]


def arrival_gaps(n: int, qps: float, seed: int) -> list[float]:
    if math.isinf(qps) or qps <= 0:
        return [0.0] * n
    rng = np.random.default_rng(seed + 1)
    return rng.exponential(1.0 / qps, size=n).tolist()


async def run_load(base_url: str, prompts: list[list[int]], gaps: list[float], output_len: int,
                   warmup: list[list[int]] = (), model: str = "", progress: bool = True,
                   timeout_s: float = 3600.0) -> tuple[list[RequestResult], float]:
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                     headers=auth_headers()) as session:
        for p in warmup:
            r = await send_request(session, url, p, output_len, model)
            if not r.success:
                print(f"warmup request failed: {r.error}", file=sys.stderr)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(prompts), desc="requests", unit="req", file=sys.stderr)

        async def one(p):
            r = await send_request(session, url, p, output_len, model)
            if bar is not None:
                bar.update(1)
            return r

        start = time.perf_counter()
        tasks = []
        for p, gap in zip(prompts, gaps):
            if gap > 0:
                await asyncio.sleep(gap)  # Poisson pacing of the load, not synchronisation
            tasks.append(asyncio.create_task(one(p)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    return list(results), duration


def mode_label(health: dict) -> str:
    """The result files' label of the deployment whose ``/health`` this is, in `pushkv sweep`'s names: pull by its
    read (``pull-inline``, ...), push by its streaming, since `pushkv up --mode push` streams per layer group
    (``push-layer``, ``push-chunk``) and the sweep's ``push`` is push with ``--push-stream off`` (its baseline)."""
    mode = health.get("mode", "unknown")
    if mode == "pull":
        return f"pull-{health.get('pull_read', 'background')}"
    if mode == "push":
        stream = health.get("push_stream", "off")  # (absent: a router from before /health said it)
        return "push" if stream == "off" else f"push-{stream}"
    return mode


def detect_mode(base_url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=10) as r:
        return mode_label(json.loads(r.read()))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pushkv bench", description=__doc__.split("\n\n")[0],
                                 epilog="--workload chat: the chat workload instead (multi-turn conversations sharing "
                                        "a system prompt); pushkv bench --workload chat --help gives its options. "
                                        "A router started with --api-key: the key is sent as 'Authorization: Bearer "
                                        "KEY' from $PUSHKV_API_KEY, else $OPENAI_API_KEY (as vllm bench serve). "
                                        "Exit status: 0 when every request completed, 1 when any failed (the "
                                        "summary is printed and the result file written either way)")
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="router base URL")
    ap.add_argument("--mode", help="label in the file name (default: asked from /health, as the sweep names modes: "
                                   "push-layer, push-chunk, push for --push-stream off, pull-inline, ...)")
    ap.add_argument("--qps", type=float, default=1.0, help="Poisson arrival rate; inf = all at once")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2, help="sequential requests first, not recorded")
    ap.add_argument("--seed", type=int, default=None,
                    help="prompts and arrivals (default: the run's --iter, so that a run again against the same "
                         "deployment sends prompts its prefix cache does not hold)")
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="prompt ids drawn from [0, this)")
    ap.add_argument("--model", default="")
    ap.add_argument("--result-dir", default="results")
    ap.add_argument("--iter", type=int, default=None, help="iteration index (default: next free)")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> tuple[str, dict]:
    mode = args.mode or detect_mode(args.url)
    it = args.iter if args.iter is not None else next_iter(
        args.result_dir, mode, args.qps, args.input_len, args.output_len)
    seed = args.seed if args.seed is not None else it
    prompts = make_prompts(args.num_prompts, args.input_len, args.vocab_size, seed)
    warmup = make_prompts(args.warmup, args.input_len, args.vocab_size, seed + 1000)
    gaps = arrival_gaps(args.num_prompts, args.qps, seed)
    results, duration = asyncio.run(run_load(args.url, prompts, gaps, args.output_len, warmup,
                                             args.model, not args.no_progress))
    meta = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "pushkv", "mode": mode,
        "base_url": args.url, "model_id": args.model, "num_prompts": args.num_prompts,
        "request_rate": args.qps if not math.isinf(args.qps) else "inf",
        "input_len": args.input_len, "output_len": args.output_len, "seed": seed,
        "warmup": args.warmup,
    }
    summary = aggregate(results, duration, meta)
    os.makedirs(args.result_dir, exist_ok=True)
    path = os.path.join(args.result_dir, result_name(mode, args.qps, args.input_len, args.output_len, it))
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    return path, summary


def print_summary(path: str, s: dict) -> None:
    print(f"{s['mode']}  qps={s['request_rate']}  in={s['input_len']}  out={s['output_len']}  -> {path}")
    print(f"  completed {s['completed']}  failed {s['failed']}  duration {s['duration']:.2f}s  "
          f"output {s['output_throughput']:.1f} tok/s")
    for k in ("ttft", "tpot", "itl", "e2el"):
        print(f"  {k:5s} mean {s[f'mean_{k}_ms']:9.2f}  median {s[f'median_{k}_ms']:9.2f}  "
              f"p99 {s[f'p99_{k}_ms']:9.2f} ms")
    if "mean_reserved_block_s" in s:
        print(f"  D block-s per request: mean {s['mean_reserved_block_s']:.3f}  median "
              f"{s['median_reserved_block_s']:.3f}  p99 {s['p99_reserved_block_s']:.3f}  "
              f"(late allocations {s['late_allocations']})")
    if s["stages"]:
        print("  stages (median ms since previous stage):")
        for stage, ms in s["stages"].items():
            print(f"    {stage:36s} {ms:9.2f}")
    errors = [e for e in s["errors"] if e]
    if errors:
        print(f"  first error: {errors[0]}")


def main(argv=None) -> int:
    args = parse_args(argv)
    path, summary = run(args)
    print_summary(path, summary)
    if summary["failed"] or not summary["completed"]:
        print(f"pushkv bench: {summary['failed']} of {summary['failed'] + summary['completed']} requests failed "
              f"(saved in {path} all the same): exit status 1", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
