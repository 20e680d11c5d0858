"""pushkv-link-bench: serving where the link, not the compute, sets the pace (root only).

P and D run on two network-namespace hosts (``tools/netns.py``), each a ``pushkv up --role``
(``tools/hosts_up.py``, as ``tests/test_hosts.py`` starts them), with the router and etcd in the
root namespace on the bridge; NIXL is forced onto UCX's TCP transport (``UCX_TLS=tcp``: across
namespaces UCX would otherwise copy with cma and never touch the link). Each host's link is capped
in turn at every ``--rates`` entry by a tc tbf on its veth end (``Host.cap``: what P sends to D
and what D sends to P both go through one; ``none`` = the veth as it runs). ``local`` runs one
instance on P's host: no link, the no-disaggregation reference.

For each mode one deployment; for each rate, with that deployment: lone requests (``--reps`` at
each length, one at a time, the median) and a loaded run (Poisson arrivals at ``--qps``,
``--num-prompts`` prompts, at each ``--load-lengths``). Every run is a pushkv-bench JSON under
``OUT/<rate>/`` (``qps0`` = the lone requests), so ``pushkv-stages`` and ``pushkv-plot`` read them
too; at the end a table per rate (stdout and ``OUT/tables.md``), ``OUT/link_bench.json`` and
``OUT/ttft_<rate>.png``. Hosts, namespaces, qdiscs, etcd and every process are removed at the end,
on Ctrl-C and on SIGTERM too.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import date
from typing import Iterator, Optional

from tools import bench, netns, plot
from tools.sweep import MODES as SWEEP_MODES

MODES: dict[str, list[str]] = {
    **SWEEP_MODES,
    # P WRITEs each prefill chunk's blocks as its step ends; identical to push until the
    # streaming lands (the flags are accepted today)
    "push-chunk": ["--mode", "push", "--push-stream", "chunk"],
}
DEFAULT_MODES = ["push", "push-chunk", "pull-inline", "pull-background", "local"]
# "small" with 8 KV heads of 64 (MHA): 16 KiB of KV per token, 4x the preset's, for ~1.4x its
# compute, so that at 1 Gbit/s the KV of a prompt takes about half its prefill on one CPU core
# (1024 tokens: 134 ms on the wire, ~280 ms of prefill measured on the 2-core machine)
DEFAULT_MODEL = "small"
DEFAULT_GEOMETRY = "--num-kv-heads 8 --head-dim 64"
UCX_TCP = {"UCX_TLS": "tcp"}
LONE_QPS = 0.0  # the file name's qps of lone requests
BLOCK_SIZE = 16
START_TIMEOUT_S = 180.0
# (label, from, to) over the request's timeline; the first key present wins
SPANS = {
    "prefill_ms": (("prefill.prefill_start", "prefill.prefill_end"), ("local.prefill_start", "local.prefill_end")),
    # the stage streaming shortens: from P's last compute to D holding every byte
    "pend_to_kv_ms": (("prefill.prefill_end", "decode.kv_received"),),
    "wire_ms": (("prefill.write_posted", "prefill.write_done"), ("decode.read_posted", "decode.read_done")),
}


# ---------------------------------------------------------------------------
# the model and its KV
# ---------------------------------------------------------------------------
def model_config(model: str, geometry: str):
    """The ModelConfig ``pushkv up --model MODEL GEOMETRY`` would run (the CLI's own parsing)."""
    from processes.cli import build_parser, config_from_args

    return config_from_args(build_parser().parse_args(["up", "--model", model, *shlex.split(geometry)])).model


def kv_formula(m) -> str:
    return (f"{m.num_layers} layers x {m.kv_planes} x {m.cache_kv_heads} kv heads x {m.cache_head_dim} "
            f"x {m.dtype_bytes} B = {m.kv_bytes_per_token()} B/token")


def kv_bytes(m, tokens: int) -> int:
    """What moves for a prompt: whole blocks."""
    return math.ceil(tokens / BLOCK_SIZE) * BLOCK_SIZE * m.kv_bytes_per_token()


def wire_ms(nbytes: int, rate: str) -> Optional[float]:
    bps = netns.parse_rate(rate)
    return None if bps is None else nbytes * 8 / bps * 1e3


def num_blocks(args) -> int:
    """Room for the loaded run on D (prompt + output per request, all at once) with push's pin
    cap (half of D) never reached, and for the longest lone prompt."""
    per = lambda n: math.ceil((n + args.output_len) / BLOCK_SIZE)
    need = max([per(max(args.lengths))] + [args.num_prompts * per(n) for n in args.load_lengths])
    return 2 * need + 64


# ---------------------------------------------------------------------------
# deployments
# ---------------------------------------------------------------------------
@contextmanager
def deployed(mode: str, net, registry: str, common: list[str], tmp: pathlib.Path) -> Iterator[str]:
    """One mode's deployment on the hosts until the block ends; yields the router's URL."""
    from pushkv.supervisor.plan import free_tcp_port
    from tools.hosts_up import HostUp, up_engines, wait_for

    flags = [*MODES[mode], *common]
    ups: list[HostUp] = []
    try:
        if mode == "local":
            h = net[1]
            ups.append(HostUp(mode, h, [*flags, "--host", h.addr, "--port", "8000"], tmp))
            url = f"http://{h.addr}:8000"
        else:
            port = free_tcp_port(net.root_addr)
            reg = ["--registry", registry, "--insecure"]  # namespace hosts on one machine, nothing else on the bridge
            ups.append(HostUp(f"{mode}-router", None, ["--role", "router", "--advertise", net.root_addr,
                                                      "--port", str(port), *flags, *reg], tmp))
            for i, role in ((1, "prefill"), (2, "decode")):
                ups.append(HostUp(f"{mode}-{role}", net[i], ["--role", role, "--advertise", net[i].addr,
                                                             *flags, *reg], tmp, UCX_TCP))
            url = f"http://{net.root_addr}:{port}"
        for u in ups:
            u.wait_ready(START_TIMEOUT_S)
        if mode != "local":
            want = {e for u in ups[1:] for e in u.engine_ids}
            wait_for(lambda: want <= up_engines(url), 30, f"the router to see {sorted(want)}")
        yield url
    finally:
        for u in reversed(ups):
            try:
                u.stop()
            except BaseException as e:  # a failed stop, or Ctrl-C again: kill it (its children die
                print(f"stopping {u.name}: {e!r}; killing it", file=sys.stderr)  # with it), stop the rest
                u.kill()
                u.cleanup()


# ---------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------
async def _one_by_one(url: str, prompts: list[list[int]], output_len: int) -> list[bench.RequestResult]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        return [await bench.send_request(s, url.rstrip("/") + "/v1/completions", p, output_len) for p in prompts]


def lone(url: str, mode: str, rate: str, length: int, args, out_dir: str) -> dict:
    """``args.reps`` requests of ``length``, each sent once the previous one ended."""
    prompts = bench.make_prompts(args.reps, length, bench.DEFAULT_VOCAB, args.seed + length)
    t0 = time.perf_counter()
    results = asyncio.run(_one_by_one(url, prompts, args.output_len))
    meta = {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": "pushkv", "mode": mode, "base_url": url,
            "num_prompts": args.reps, "request_rate": "lone", "input_len": length,
            "output_len": args.output_len, "seed": args.seed + length, "warmup": 0, "rate": rate}
    s = bench.aggregate(results, time.perf_counter() - t0, meta)
    with open(os.path.join(out_dir, bench.result_name(mode, LONE_QPS, length, args.output_len, 0)), "w") as f:
        json.dump(s, f, indent=1)
    return s


def loaded(url: str, mode: str, length: int, args, out_dir: str) -> dict:
    b = bench.parse_args(["--url", url, "--mode", mode, "--qps", str(args.qps), "--num-prompts",
                          str(args.num_prompts), "--input-len", str(length), "--output-len", str(args.output_len),
                          "--warmup", "0", "--seed", str(args.seed), "--result-dir", out_dir, "--iter", "0",
                          "--no-progress"])
    return bench.run(b)[1]


def warm_up(url: str, args) -> None:
    """Two short requests: the first transfer after start (handshakes, UCX lanes) or after the
    cap changed is not what a cell measures."""
    asyncio.run(_one_by_one(url, bench.make_prompts(2, min(args.lengths), bench.DEFAULT_VOCAB, 999), 2))


def span_ms(timelines: list[dict], pairs) -> Optional[float]:
    got = []
    for tl in timelines:
        for a, b in pairs:
            if tl and a in tl and b in tl:
                got.append((tl[b] - tl[a]) * 1e3)
                break
    return statistics.median(got) if got else None


def cell(s: dict) -> dict:
    """What the tables and the JSON keep of one run (medians over its completed requests)."""
    ok = [tl for tl, e in zip(s["timelines"], s["errors"]) if not e]
    out = {"ttft_ms": s["median_ttft_ms"] if s["completed"] else None,
           "tpot_ms": s["median_tpot_ms"] if s["completed"] else None,
           "completed": s["completed"], "failed": s["failed"]}
    out.update({k: span_ms(ok, pairs) for k, pairs in SPANS.items()})
    nbytes = [kv["decode"]["bytes"] for kv in s.get("kv", []) if kv and "decode" in kv]
    out["kv_bytes"] = int(statistics.median(nbytes)) if nbytes else None
    if out["kv_bytes"] and out["wire_ms"]:
        out["wire_gbit_s"] = out["kv_bytes"] * 8 / out["wire_ms"] / 1e6
    return out


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------
def _f(v, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _wire(c: dict) -> str:
    if c.get("wire_ms") is None:
        return "-"
    rate = f" ({c['wire_gbit_s']:.2f} Gbit/s)" if c.get("wire_gbit_s") else ""
    return f"{c['wire_ms']:.1f}{rate}"


def table(rate: str, regime: dict, args, m) -> str:
    head = ("| mode | tokens | TTFT p50 lone | TPOT p50 lone | prefill | prefill end → KV landed | WRITE/READ "
            "| TTFT p50 load | TPOT p50 load | prefill end → KV landed, load | failed |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for mode in args.modes:
        for n in sorted(set(args.lengths) | set(args.load_lengths)):
            c = regime.get(mode, {}).get(str(n), {})
            lo, ld = c.get("lone") or {}, c.get("load") or {}
            failed = (lo.get("failed") or 0) + (ld.get("failed") or 0)
            lines.append(f"| {mode} | {n} | {_f(lo.get('ttft_ms'))} | {_f(lo.get('tpot_ms'))} | "
                         f"{_f(lo.get('prefill_ms'))} | {_f(lo.get('pend_to_kv_ms'))} | {_wire(lo)} | "
                         f"{_f(ld.get('ttft_ms'))} | {_f(ld.get('tpot_ms'))} | {_f(ld.get('pend_to_kv_ms'))} | "
                         f"{failed if c else '-'} |")
    return "\n".join(lines)


def link_vs_compute(rate: str, regime: dict, args, m) -> str:
    """Per length: the KV, its time on the capped wire (computed) and P's prefill (measured)."""
    lines = ["| tokens | KV MiB | on the wire at " + rate + " (computed) | prefill (measured, lone median) |",
             "| --- | --- | --- | --- |"]
    for n in args.lengths:
        pre = [c["lone"]["prefill_ms"] for mode, cs in regime.items() for k, c in cs.items()
               if k == str(n) and c.get("lone") and c["lone"].get("prefill_ms") is not None]
        lines.append(f"| {n} | {kv_bytes(m, n) / 2**20:.1f} | {_f(wire_ms(kv_bytes(m, n), rate))} ms | "
                     f"{_f(statistics.median(pre) if pre else None)} ms |")
    return "\n".join(lines)


def cap_text(rate: str) -> str:
    bps = netns.parse_rate(rate)
    if bps is None:
        return "no cap (the veth as it runs)"
    return (f"tc tbf rate {rate}, burst {netns.cap_burst_bytes(bps)} B, latency {netns.CAP_LATENCY_MS} ms "
            f"on P's and D's links")


def report(results: dict, args, m) -> str:
    parts = [f"model {args.model} {args.geometry}: KV {kv_formula(m)}; {args.output_len} output tokens; "
             f"lone: median of {args.reps}; load: {args.num_prompts} prompts at {bench.fmt_qps(args.qps)} QPS "
             f"(Poisson) at {', '.join(map(str, args.load_lengths))} tokens; times in ms"]
    for rate in args.rates:
        regime = results["regimes"].get(rate, {})
        parts += [f"\n### {rate}: {cap_text(rate)}\n", table(rate, regime, args, m)]
        if netns.parse_rate(rate) is not None:
            parts += ["", link_vs_compute(rate, regime, args, m)]
    return "\n".join(parts)


def plots(args) -> list[str]:
    paths = []
    for rate in args.rates:
        cells = plot.load(os.path.join(args.out, rate))
        if not cells:
            continue
        path = os.path.join(args.out, f"ttft_{rate}.png")
        plot.plot(cells, path, title=f"link {rate}: {cap_text(rate)}",
                  column=lambda q: "lone requests" if q == LONE_QPS else f"load: {bench.fmt_qps(q)} QPS")
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pushkv-link-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", nargs="+", default=["1gbit", "none"], help="tc rates (1gbit, 10gbit, ...) or none")
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096], help="prompt tokens")
    ap.add_argument("--modes", nargs="+", choices=sorted(MODES), default=DEFAULT_MODES)
    ap.add_argument("--reps", type=int, default=3, help="lone requests per length (median)")
    ap.add_argument("--qps", type=float, default=2.0, help="loaded run: Poisson arrival rate")
    ap.add_argument("--num-prompts", type=int, default=16, help="loaded run: prompts")
    ap.add_argument("--load-lengths", nargs="*", type=int, default=[1024], help="loaded run at these lengths")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="pushkv preset")
    ap.add_argument("--geometry", default=DEFAULT_GEOMETRY, help="`pushkv up` geometry flags, one shell string")
    ap.add_argument("--prefill-chunk", type=int, default=512,
                    help="tokens per prefill step, every mode alike (push-chunk streams each chunk's KV)")
    ap.add_argument("--up-args", default="", help="more `pushkv up` flags for every host, one shell string")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/link")
    args = ap.parse_args(argv)
    for r in args.rates:
        try:
            netns.parse_rate(r)
        except ValueError as e:
            ap.error(str(e))
    m = model_config(args.model, args.geometry)
    too_long = [n for n in args.lengths + args.load_lengths if n + args.output_len > m.max_position]
    if too_long:
        ap.error(f"lengths {too_long} + {args.output_len} output tokens exceed max_position {m.max_position}")
    if "push-chunk" in args.modes and args.prefill_chunk <= 0:
        ap.error("push-chunk streams prefill chunks: give --prefill-chunk N > 0")
    return args


def _commit() -> str:
    got = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return got.stdout.strip() or "unknown"


def _argv(argv: list[str]) -> list[str]:
    """The run's arguments less ``--out DIR`` (the JSON lies there)."""
    out, skip = [], False
    for a in argv:
        if skip or a == "--out" or a.startswith("--out="):
            skip = a == "--out"
            continue
        out.append(a)
    return out


def _on_sigterm(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through every `finally`: the same cleanup as Ctrl-C


def _on_sigint(_signum, _frame):
    # raised wherever the main thread is, inside asyncio.run too: asyncio's own SIGINT handling
    # only cancels its task, and a request in flight could take that as its own failure
    raise KeyboardInterrupt


def main(argv=None) -> int:
    from tqdm import tqdm

    from tools.etcd_server import etcd_server

    args = parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("pushkv-link-bench makes network namespaces and tc qdiscs: run it as root")
    m = model_config(args.model, args.geometry)
    os.makedirs(args.out, exist_ok=True)
    for rate in args.rates:
        os.makedirs(os.path.join(args.out, rate), exist_ok=True)
    print(f"KV per token: {kv_formula(m)}")
    for n in args.lengths:
        wires = ", ".join(f"{_f(wire_ms(kv_bytes(m, n), r))} ms at {r}" for r in args.rates
                          if netns.parse_rate(r) is not None)
        print(f"  {n} tokens: {kv_bytes(m, n) / 2**20:.1f} MiB of KV, {wires} on the wire")
    common = ["--model", args.model, *shlex.split(args.geometry), "--num-blocks", str(num_blocks(args)),
              "--block-size", str(BLOCK_SIZE), *shlex.split(args.up_args)]
    if args.prefill_chunk > 0:
        common += ["--prefill-chunk", str(args.prefill_chunk)]
    results = {"date": date.today().isoformat(), "commit": _commit(), "argv": _argv(sys.argv[1:] if argv is None else argv),
               "model": {"preset": args.model, "geometry": args.geometry, "kv_bytes_per_token": m.kv_bytes_per_token(),
                         "kv_formula": kv_formula(m)},
               "up_flags": common, "caps": {r: cap_text(r) for r in args.rates}, "regimes": {}}
    signal.signal(signal.SIGTERM, _on_sigterm)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored
        signal.signal(signal.SIGINT, _on_sigint)
    per_rate = len(args.lengths) + len(args.load_lengths)
    bar = tqdm(total=len(args.modes) * len(args.rates) * per_rate, desc="link-bench", unit="cell")
    t_start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="pushkv-link-") as tmp, netns.hosts(2) as net, \
                etcd_server(tmp, extra_hosts=(net.root_addr,)) as etcd:
            registry = etcd.url(host=net.root_addr)
            for mode in args.modes:
                bar.set_postfix_str(f"{mode}: starting")
                logs = pathlib.Path(args.out) / "logs"
                logs.mkdir(exist_ok=True)
                with deployed(mode, net, registry, common, logs) as url:
                    for rate in args.rates:
                        run_rate(url, mode, rate, net, args, results, bar)
                        _save(results, args)
    finally:
        bar.close()
    results["elapsed_s"] = round(time.monotonic() - t_start, 1)
    _save(results, args)
    text = report(results, args, m)
    with open(os.path.join(args.out, "tables.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    for p in plots(args):
        print(f"wrote {p}")
    print(f"wrote {os.path.join(args.out, 'link_bench.json')} ({results['elapsed_s']:.0f} s)")
    failed = sum((c.get(k) or {}).get("failed", 0) for reg in results["regimes"].values() for cs in reg.values()
                 for c in cs.values() for k in ("lone", "load"))
    return 1 if failed else 0


def run_rate(url: str, mode: str, rate: str, net, args, results: dict, bar) -> None:
    """Every cell of one mode at one rate, on the running deployment."""
    from tqdm import tqdm

    for h in (net[1], net[2]):
        h.cap(rate)
    out_dir = os.path.join(args.out, rate)
    warm_up(url, args)
    regime = results["regimes"].setdefault(rate, {}).setdefault(mode, {})
    for n in args.lengths:
        bar.set_postfix_str(f"{mode} {rate} lone {n}")
        c = regime.setdefault(str(n), {})["lone"] = cell(lone(url, mode, rate, n, args, out_dir))
        tqdm.write(f"{mode:16s} {rate:>7s} lone {n:6d}: TTFT {_f(c['ttft_ms'])} TPOT {_f(c['tpot_ms'])} "
                   f"prefill {_f(c['prefill_ms'])} prefill end → KV {_f(c['pend_to_kv_ms'])} "
                   f"wire {_f(c['wire_ms'])} ms  failed {c['failed']}")
        bar.update(1)
    for n in args.load_lengths:
        bar.set_postfix_str(f"{mode} {rate} load {n}")
        c = regime.setdefault(str(n), {})["load"] = cell(loaded(url, mode, n, args, out_dir))
        tqdm.write(f"{mode:16s} {rate:>7s} load {n:6d}: TTFT {_f(c['ttft_ms'])} TPOT {_f(c['tpot_ms'])} "
                   f"prefill end → KV {_f(c['pend_to_kv_ms'])} ms  failed {c['failed']}")
        bar.update(1)


def _save(results: dict, args) -> None:
    with open(os.path.join(args.out, "link_bench.json"), "w") as f:
        json.dump(results, f, indent=1)


def cli() -> int:
    try:
        return main()
    except KeyboardInterrupt:
        print("interrupted: hosts, qdiscs, etcd and every process removed; what ran is in --out",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(cli())
