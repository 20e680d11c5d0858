"""pushkv link-bench: serving where the link, not the compute, sets the pace (root only).

P and D run on two network-namespace hosts (``tools/netns.py``), each a ``pushkv up --role``
(``tools/hosts_up.py``, as ``tests/hosts/test_hosts.py`` starts them), with the router and etcd in the
root namespace on the bridge; NIXL is forced onto UCX's TCP transport (``--ucx-tls``, default
``tcp``: across namespaces UCX would otherwise copy with cma and never touch the link; ``tcp,cuda_copy``
for pools in GPU memory), its lanes bound to each host's veth end (``--ucx-net-devices eth0``).
Each host's link is capped in turn at every ``--rates`` entry by a tc tbf on its veth end
(``Host.cap``: what P sends to D and what D sends to P both go through one; ``none`` = the veth
as it runs). ``local`` runs one instance on P's host: no link, the no-disaggregation reference.

Every mode gets one deployment (its own registry prefix), all up at once; every mode runs with
the same ``--prefill-chunk`` (``MODE@CHUNK`` gives one its own, to set chunk sizes side by side).
For each rate: lone requests, ``--reps`` rounds at each length of one request to each mode in
turn (the order rotating), each sent once the previous one ended, so that the modes' figures lie
seconds apart on a host whose load drifts (the median per mode); then each mode's loaded run
(Poisson arrivals at ``--qps``, or at ``--link-load`` of a capped link's capacity, ``--num-prompts``
prompts, at each ``--load-lengths``).
``--one-at-a-time`` runs one deployment at a time instead. Every run is a pushkv bench JSON under
``OUT/<rate>/`` (``qps0`` = the lone requests, with ``cpu_ms``: the CPU each role's processes spent
per request), so ``pushkv stages`` and ``pushkv plot`` read them too; at the end, per rate (stdout
and ``OUT/tables.md``): the table, the streamed parts' stages, the streaming goal per length
(``TTFT(push-chunk) <= TTFT(push) - 0.8 x min(prefill, transfer)``, transfer = push's prefill end
-> KV landed, and how much streaming hid) and the CPU per request; ``OUT/link_bench.json`` and
``OUT/ttft_<rate>.png``. Hosts, namespaces, qdiscs, etcd and every process are removed at the end,
on Ctrl-C and on SIGTERM too.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
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
from contextlib import ExitStack, contextmanager
from datetime import date
from typing import Iterator, Optional

from pushkv.config import DeploymentConfig
from pushkv.protocol import link_queue
from tools import bench, netns, plot
from tools.sweep import MODES as SWEEP_MODES
from tools.sweep import mode_flags as sweep_mode_flags

MODES: dict[str, list[str]] = {
    **SWEEP_MODES,
    # P WRITEs each prefill chunk's finished blocks (part WRITEs, one in flight at a time) while
    # the next chunk computes; the last WRITE, with D's notification, follows at prefill end
    "push-chunk": ["--mode", "push", "--push-stream", "chunk"],
}
DEFAULT_MODES = ["push", "push-chunk", "pull-inline", "pull-background", "local"]
# "small" with 8 KV heads of 64 (MHA): 16 KiB of KV per token, 4x the preset's, for ~1.4x its
# compute, so that at 1 Gbit/s the KV of a prompt takes about half its prefill on one CPU core
# (1024 tokens: 134 ms on the wire, ~280 ms of prefill measured on the 2-core machine)
DEFAULT_MODEL = "small"
DEFAULT_GEOMETRY = "--num-kv-heads 8 --head-dim 64"
UCX_TLS = "tcp"  # P's and D's UCX lanes (--ucx-tls): TCP, so that the bytes cross the capped veth
LONE_QPS = 0.0  # the file name's qps of lone requests
BLOCK_SIZE = 16
START_TIMEOUT_S = 180.0
# (label, from, to) over the request's timeline; the first key present wins
SPANS = {
    "prefill_ms": (("prefill.prefill_start", "prefill.prefill_end"), ("local.prefill_start", "local.prefill_end")),
    # the stage streaming shortens: from P's last compute to D holding every byte
    "pend_to_kv_ms": (("prefill.prefill_end", "decode.kv_received"),),
    "wire_ms": (("prefill.write_posted", "prefill.write_done"), ("decode.read_posted", "decode.read_done")),
    # streaming push's parts: the first layer group stored (push-layer, P's writer hears the mark) or
    # the first chunk's end (push-chunk, P's scheduler), the first part's post and completion, the
    # newest part's completion (P's writer)
    "chunk1_ms": (("prefill.prefill_start", "prefill.layers_stored_0"),
                  ("prefill.prefill_start", "prefill.stream_start")),
    "part_lag_ms": (("prefill.layers_stored_0", "prefill.part_post_first"),
                    ("prefill.stream_start", "prefill.part_post_first")),
    "part1_ms": (("prefill.part_post_first", "prefill.part_done_first"),),
    # > 0: every part had landed that long before prefill end (the link idled, waiting for compute)
    "parts_idle_ms": (("prefill.part_done_last", "prefill.prefill_end"),),
}
# the goal of streaming: TTFT(push-chunk) <= TTFT(push) - GOAL_SHARE x min(prefill, transfer)
GOAL_SHARE = 0.8


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


def split_mode(spec: str) -> tuple[str, Optional[int]]:
    """``MODE`` or ``MODE@CHUNK`` (that mode with its own ``--prefill-chunk``, to set chunk sizes
    side by side): (mode, chunk or None for the run's ``--prefill-chunk``)."""
    mode, _, chunk = spec.partition("@")
    if mode not in MODES or (chunk and not chunk.isdigit()):
        raise ValueError(f"mode {spec!r}: want one of {', '.join(sorted(MODES))}, optionally @CHUNK (tokens, 0 = off)")
    return mode, int(chunk) if chunk else None


def chunk_of(spec: str, args) -> int:
    chunk = split_mode(spec)[1]
    return args.prefill_chunk if chunk is None else chunk


def mode_flags(spec: str, args) -> list[str]:
    """``pushkv up`` flags of a mode spec: the mode's own, then its prefill chunk (every mode alike
    unless the spec names one)."""
    chunk = chunk_of(spec, args)
    mode = split_mode(spec)[0]
    own = sweep_mode_flags(mode) if mode in SWEEP_MODES else MODES[mode]  # (sweep's say what "push" is)
    return [*own, *(["--prefill-chunk", str(chunk)] if chunk > 0 else [])]


def ucx_env(args) -> dict[str, str]:
    """P's and D's UCX environment: ``--ucx-tls`` (UCX over TCP: across namespaces UCX would
    otherwise copy with cma and never touch the link; ``tcp,cuda_copy`` from GPU memory) and its
    TCP lanes bound to the host's veth end (``--ucx-net-devices``), so no byte takes another path."""
    env = {"UCX_TLS": args.ucx_tls}
    if args.ucx_net_devices:
        env["UCX_NET_DEVICES"] = args.ucx_net_devices
    return env


def load_qps(rate: str, length: int, args, m) -> float:
    """The loaded run's arrival rate at one cap and length: ``--link-load`` of the capped link's
    capacity (its rate over one request's KV), or ``--qps`` where the link is not capped (or no
    ``--link-load`` is given)."""
    bps = netns.parse_rate(rate)
    if args.link_load is None or bps is None:
        return args.qps
    return round(args.link_load * bps / 8 / kv_bytes(m, length), 3)


def num_blocks(args) -> int:
    """Room for the loaded run on D (prompt + output per request, all at once) with push's pin
    cap (half of D) never reached, and for the longest lone prompt."""
    def per(n: int) -> int:
        return math.ceil((n + args.output_len) / BLOCK_SIZE)

    need = max([per(max(args.lengths))] + [args.num_prompts * per(n) for n in args.load_lengths])
    return 2 * need + 64


# ---------------------------------------------------------------------------
# deployments
# ---------------------------------------------------------------------------
# a deployment's router URL -> the supervisors of its hosts (each ``pushkv up``), whose process
# trees' CPU time ``cpu_ns`` reads
SUPERVISORS: dict[str, list[int]] = {}
LOCAL_PORTS = itertools.count(8000)  # local's HTTP port on P's host, one per local deployment


@contextmanager
def deployed(spec: str, net, registry: str, common: list[str], tmp: pathlib.Path, args) -> Iterator[str]:
    """One mode spec's deployment on the hosts until the block ends (processes and logs named
    after it); yields the router's URL."""
    from pushkv.supervisor.plan import free_tcp_port
    from tools.hosts_up import HostUp, up_engines, wait_for

    mode, name = split_mode(spec)[0], spec
    flags = [*mode_flags(spec, args), *common]
    ups: list[HostUp] = []
    url = ""
    try:
        if mode == "local":
            h = net[1]
            port = next(LOCAL_PORTS)
            ups.append(HostUp(name, h, [*flags, "--host", h.addr, "--port", str(port)], tmp))
            url = f"http://{h.addr}:{port}"
        else:
            port = free_tcp_port(net.root_addr)
            reg = ["--registry", registry, "--insecure"]  # namespace hosts on one machine, nothing else on the bridge
            ups.append(HostUp(f"{name}-router", None, ["--role", "router", "--advertise", net.root_addr,
                                                      "--port", str(port), *flags, *reg], tmp))
            for i, role in ((1, "prefill"), (2, "decode")):
                ups.append(HostUp(f"{name}-{role}", net[i], ["--role", role, "--advertise", net[i].addr,
                                                             *flags, *reg], tmp, ucx_env(args)))
            url = f"http://{net.root_addr}:{port}"
        for u in ups:
            u.wait_ready(START_TIMEOUT_S)
        if mode != "local":
            want = {e for u in ups[1:] for e in u.engine_ids}
            wait_for(lambda: want <= up_engines(url), 30, f"the router to see {sorted(want)}")
        SUPERVISORS[url] = [u.proc.pid for u in ups]
        yield url
    finally:
        SUPERVISORS.pop(url, None)
        for u in reversed(ups):
            try:
                u.stop()
            except BaseException as e:  # a failed stop, or Ctrl-C again: kill it (its children die
                print(f"stopping {u.name}: {e!r}; killing it", file=sys.stderr)  # with it), stop the rest
                u.kill()
                u.cleanup()


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, process title) of every process on this machine."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        out[int(d)] = (ppid, title)
    return out


def _role(title: str) -> str:
    """``pushkv prefill-writer 0`` -> ``prefill-writer``; ``pushkv supervisor <id>`` -> ``supervisor``."""
    words = title.split()
    return words[1] if len(words) > 1 and words[0] == "pushkv" else "other"


def cpu_ns(url: str) -> dict[str, int]:
    """CPU time so far (ns, /proc/PID/schedstat) of a deployment's processes, summed per role, and
    as ``<role> wait`` their time runnable on a run queue, waiting for a core."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[str, int] = {}
    todo = list(SUPERVISORS.get(url, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/schedstat") as f:
                ns, wait = (int(x) for x in f.read().split()[:2])
        except (OSError, ValueError):
            continue
        role = _role(table.get(pid, (0, ""))[1])
        out[role] = out.get(role, 0) + ns
        out[f"{role} wait"] = out.get(f"{role} wait", 0) + wait
    return out


def cpu_delta_ms(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    return {k: (after.get(k, 0) - before.get(k, 0)) / 1e6 for k in after}


# ---------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------
async def _one_by_one(url: str, prompts: list[list[int]], output_len: int) -> list[bench.RequestResult]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        return [await bench.send_request(s, url.rstrip("/") + "/v1/completions", p, output_len) for p in prompts]


def rate_seed(rate: str, args) -> int:
    """The prompts' seed at ``rate``: each rate its own prompts. One deployment serves every rate,
    so a rate that sent the prompts of the one before found them in P's and D's prefix caches,
    and moved no KV (a lone 16k "transfer" of 0.8 ms at 10 Gbit/s after one at 25)."""
    return args.seed + 1_000_003 * (args.rates.index(rate) if rate in args.rates else 0)


def load_seed(rate: str, length: int, it: int, args) -> int:
    """The prompts' seed of the loaded run at ``length`` in round ``it``: each its own. With the rounds' seeds alone,
    the runs at two --load-lengths drew their prompts from one stream, a longer prompt beginning with a shorter
    run's prompts, which the deployment's prefix cache then held (a 1024-token prompt half cached after 512's)."""
    index = args.load_lengths.index(length) if length in args.load_lengths else 0
    return rate_seed(rate, args) + 500_000 + 1000 * index + it  # apart from the lone prompts' (+ length)


def lone_prompts(length: int, rate: str, args) -> list[list[int]]:
    return bench.make_prompts(args.reps, length, bench.DEFAULT_VOCAB, rate_seed(rate, args) + length)


def _one_timed(url: str, prompt: list[int], args) -> tuple[bench.RequestResult, dict[str, float]]:
    """One request, and the CPU its deployment's processes spent meanwhile (ms per role)."""
    before = cpu_ns(url)
    res = asyncio.run(_one_by_one(url, [prompt], args.output_len))[0]
    return res, cpu_delta_ms(before, cpu_ns(url))


def lone(url: str, mode: str, rate: str, length: int, args, out_dir: str) -> dict:
    """``args.reps`` requests of ``length``, each sent once the previous one ended."""
    t0 = time.perf_counter()
    got = [_one_timed(url, p, args) for p in lone_prompts(length, rate, args)]
    return lone_summary(url, mode, rate, length, got, time.perf_counter() - t0, args, out_dir)


def lone_side_by_side(urls: dict[str, str], rate: str, length: int, args, out_dir: str) -> dict[str, dict]:
    """``args.reps`` rounds of one request of ``length`` to each mode's deployment in turn (the
    order rotating by one each round), each sent once the previous one ended: a mode's requests
    and the others' are as close in time as they can be on a host whose load drifts."""
    prompts = lone_prompts(length, rate, args)
    got: dict[str, list] = {mode: [] for mode in urls}
    busy = {mode: 0.0 for mode in urls}
    modes = list(urls)
    for i, p in enumerate(prompts):
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            t0 = time.perf_counter()
            got[mode].append(_one_timed(urls[mode], p, args))
            busy[mode] += time.perf_counter() - t0
    return {mode: lone_summary(urls[mode], mode, rate, length, got[mode], busy[mode], args, out_dir) for mode in urls}


def lone_summary(url: str, mode: str, rate: str, length: int, got, duration_s: float, args, out_dir: str) -> dict:
    """``got``: (result, CPU ms per role) per request; the pushkv bench JSON with ``cpu_ms`` added."""
    results = [r for r, _ in got]
    meta = {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": "pushkv", "mode": mode, "base_url": url,
            "num_prompts": args.reps, "request_rate": "lone", "input_len": length,
            "output_len": args.output_len, "seed": rate_seed(rate, args) + length, "warmup": 0, "rate": rate}
    s = bench.aggregate(results, duration_s, meta)
    s["cpu_ms"] = [c for _, c in got]  # per request: CPU of the deployment's processes meanwhile, per role
    with open(os.path.join(out_dir, bench.result_name(mode, LONE_QPS, length, args.output_len, 0)), "w") as f:
        json.dump(s, f, indent=1)
    return s


def loaded_args(url: str, mode: str, rate: str, length: int, args, out_dir: str, it: int = 0,
                qps: Optional[float] = None):
    """`pushkv bench`'s arguments for one loaded run."""
    qps = args.qps if qps is None else qps
    return bench.parse_args(["--url", url, "--mode", mode, "--qps", str(qps), "--num-prompts",
                             str(args.num_prompts), "--input-len", str(length), "--output-len", str(args.output_len),
                             "--warmup", "0", "--seed", str(load_seed(rate, length, it, args)), "--result-dir",
                             out_dir, "--iter", str(it), "--no-progress"])


def loaded(url: str, mode: str, rate: str, length: int, args, out_dir: str, it: int = 0,
           qps: Optional[float] = None) -> dict:
    """One loaded run (round ``it``: its own arrivals and prompts; at ``qps``, else ``--qps``), with
    ``cpu_ms``: the CPU each role's processes spent during the run, per completed request."""
    b = loaded_args(url, mode, rate, length, args, out_dir, it, qps)
    before = cpu_ns(url)
    path, s = bench.run(b)
    spent = cpu_delta_ms(before, cpu_ns(url))
    s["cpu_ms"] = [{k: v / max(s["completed"], 1) for k, v in spent.items()}]
    with open(path, "w") as f:
        json.dump(s, f, indent=1)
    return s


def pooled(runs: list[dict]) -> dict:
    """Loaded runs of one mode as one: medians over all their requests (what ``cell`` reads)."""
    if len(runs) == 1:
        return runs[0]
    out = {k: [x for r in runs for x in r[k]] for k in ("timelines", "errors", "kv", "ttfts", "tpots")}
    out["cpu_ms"] = [c for r in runs for c in r.get("cpu_ms", [])]
    out["completed"] = sum(r["completed"] for r in runs)
    out["failed"] = sum(r["failed"] for r in runs)
    def ok(key: str) -> list:
        return [v for v, e in zip(out[key], out["errors"]) if not e and v is not None]

    out["median_ttft_ms"] = statistics.median(ok("ttfts")) * 1e3 if ok("ttfts") else 0.0
    out["median_tpot_ms"] = statistics.median(ok("tpots")) * 1e3 if ok("tpots") else 0.0
    return out


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
    kvs = [kv for kv, e in zip(s.get("kv", []), s["errors"]) if kv and not e]
    # D's leg counts the bytes its one notification announced: the whole KV, or after streamed
    # parts only the last WRITE's; P's leg counts every byte it wrote, parts included
    nbytes = [kv["decode"]["bytes"] for kv in kvs if "decode" in kv]
    out["kv_bytes"] = int(statistics.median(nbytes)) if nbytes else None
    if out["kv_bytes"] and out["wire_ms"]:
        out["wire_gbit_s"] = out["kv_bytes"] * 8 / out["wire_ms"] / 1e6
    p = [kv["prefill"] for kv in kvs if isinstance(kv.get("prefill"), dict)]
    parts = [x.get("parts", 0) for x in p]
    out["parts"] = statistics.median(parts) if parts else None
    out["stream"] = next((x["stream"] for x in p if x.get("stream")), "")
    part_bytes = [x["bytes"] - kv["decode"]["bytes"] for kv, x in zip(kvs, p) if "decode" in kv and x.get("parts")]
    out["part_bytes"] = int(statistics.median(part_bytes)) if part_bytes else None
    cpus = [c for c, e in zip(s.get("cpu_ms") or [], s["errors"]) if c and not e]
    if cpus:  # lone runs: CPU ms per request of each role's processes (median)
        out["cpu_ms"] = {k: statistics.median(c.get(k, 0.0) for c in cpus) for k in sorted(set().union(*cpus))}
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
            "| load QPS | TTFT p50 load | TPOT p50 load | prefill end → KV landed, load | failed |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for mode in args.modes:
        for n in sorted(set(args.lengths) | set(args.load_lengths)):
            c = regime.get(mode, {}).get(str(n), {})
            lo, ld = c.get("lone") or {}, c.get("load") or {}
            failed = (lo.get("failed") or 0) + (ld.get("failed") or 0)
            lines.append(f"| {mode} | {n} | {_f(lo.get('ttft_ms'))} | {_f(lo.get('tpot_ms'))} | "
                         f"{_f(lo.get('prefill_ms'))} | {_f(lo.get('pend_to_kv_ms'))} | {_wire(lo)} | "
                         f"{_f(ld.get('qps'), 'g')} | {_f(ld.get('ttft_ms'))} | {_f(ld.get('tpot_ms'))} | "
                         f"{_f(ld.get('pend_to_kv_ms'))} | "
                         f"{failed if c else '-'} |")
    return "\n".join(lines)


def stream_table(rate: str, regime: dict, args, m) -> str:
    """The part stages of every streamed run (lone medians): when the first chunk ended, how soon
    its part was posted, the first part's time on the wire (its bytes: the first chunk's KV), how
    long before prefill end the last part had landed, and what was left for the last WRITE."""
    head = ("| mode | tokens | parts | first chunk (layer group) ends | → first part posted | first part on the wire "
            "| last part landed before prefill end | prefill end → KV landed | last WRITE |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for mode in args.modes:
        for n in args.lengths:
            lo = (regime.get(mode, {}).get(str(n), {}) or {}).get("lone") or {}
            if not lo.get("stream"):  # stream off (or no P leg)
                continue
            p1 = lo.get("part1_ms")
            first = kv_bytes(m, min(chunk_of(mode, args), n))
            rate1 = f" ({first * 8 / p1 / 1e6:.2f} Gbit/s)" if p1 else ""
            lines.append(f"| {mode} | {n} | {_f(lo.get('parts'), '.0f')} | {_f(lo.get('chunk1_ms'))} | "
                         f"{_f(lo.get('part_lag_ms'), '.2f')} | {_f(p1)}{rate1} | {_f(lo.get('parts_idle_ms'))} | "
                         f"{_f(lo.get('pend_to_kv_ms'))} | {_wire(lo)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def goal_pairs(args) -> list[tuple[str, str]]:
    """(streamed, its baseline) mode specs: each push-chunk or push-layer spec against the push
    spec with the same prefill chunk, so the pair differs only in streaming."""
    pushes = {chunk_of(sp, args): sp for sp in args.modes if split_mode(sp)[0] == "push"}
    return [(sp, pushes[chunk_of(sp, args)]) for sp in args.modes
            if split_mode(sp)[0] in ("push-chunk", "push-layer") and chunk_of(sp, args) in pushes]


def goal(regime: dict, n: int, stream: str = "push-chunk", base: str = "push") -> Optional[dict]:
    """The streaming goal at ``n`` tokens from lone medians: ``base`` (push, stream off) against
    ``stream``; transfer = base's prefill end -> KV landed (the whole transfer when nothing streams)."""
    b = (regime.get(base, {}).get(str(n)) or {}).get("lone") or {}
    c = (regime.get(stream, {}).get(str(n)) or {}).get("lone") or {}
    need = ("ttft_ms", "prefill_ms", "pend_to_kv_ms")
    if any(b.get(k) is None for k in need) or any(c.get(k) is None for k in need):
        return None
    least = min(b["prefill_ms"], b["pend_to_kv_ms"])
    hidden = b["ttft_ms"] - c["ttft_ms"]
    return {"tokens": n, "stream": stream, "base": base, "ttft_push": b["ttft_ms"], "ttft_stream": c["ttft_ms"],
            "prefill": b["prefill_ms"], "transfer": b["pend_to_kv_ms"], "least": least,
            "goal_ttft": b["ttft_ms"] - GOAL_SHARE * least,
            "hidden": hidden, "hidden_share": hidden / least if least > 0 else None,
            # the TTFT difference in its two stages: the link's tail, and the prefill (chunking and noise)
            "tail_hidden": b["pend_to_kv_ms"] - c["pend_to_kv_ms"], "prefill_delta": c["prefill_ms"] - b["prefill_ms"],
            "parts": c.get("parts"), "met": c["ttft_ms"] <= b["ttft_ms"] - GOAL_SHARE * least,
            # the prefill delta's two parts (lone: P's worker computes only this request's prefill):
            # its CPU (what chunking and streaming cost) and its time waiting for a core (the host's load)
            "cpu_delta": _cpu_delta(b, c, "prefill-worker"), "wait_delta": _cpu_delta(b, c, "prefill-worker wait")}


def _cpu_delta(b: dict, c: dict, role: str) -> Optional[float]:
    x, y = (b.get("cpu_ms") or {}).get(role), (c.get("cpu_ms") or {}).get(role)
    return None if x is None or y is None else y - x


def goal_line(g: dict) -> str:
    return (f"goal {g['tokens']:6d}: TTFT {g['stream']} {g['ttft_stream']:.1f} {'<=' if g['met'] else '>'} "
            f"{g['goal_ttft']:.1f} = TTFT {g['base']} {g['ttft_push']:.1f} - {GOAL_SHARE} x min(prefill "
            f"{g['prefill']:.1f}, transfer {g['transfer']:.1f}): {'met' if g['met'] else 'NOT met'}; hid "
            f"{g['hidden']:.1f} ms = {100 * g['hidden_share']:.0f} % of min (tail {-g['tail_hidden']:+.1f}, "
            f"prefill {g['prefill_delta']:+.1f}: P worker CPU {_f(g['cpu_delta'], '+.1f')}, waiting for a core "
            f"{_f(g['wait_delta'], '+.1f')}); parts {_f(g['parts'], '.0f')}")


def goal_table(regime: dict, args) -> str:
    head = (f"| streamed | tokens | TTFT push | TTFT streamed | goal: ≤ TTFT push - {GOAL_SHARE} x min "
            "| prefill (push) "
            "| transfer (push) | hidden | hidden / min(prefill, transfer) | tail shortened by | prefill Δ "
            "| of which P worker CPU | of which waiting for a core | parts | met |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for stream, base in goal_pairs(args):
        for n in args.lengths:
            g = goal(regime, n, stream, base)
            if g is None:
                continue
            lines.append(f"| {stream} | {n} | {g['ttft_push']:.1f} | {g['ttft_stream']:.1f} | {g['goal_ttft']:.1f} | "
                         f"{g['prefill']:.1f} | {g['transfer']:.1f} | {g['hidden']:.1f} | "
                         f"{100 * g['hidden_share']:.0f} % | {g['tail_hidden']:.1f} | {g['prefill_delta']:+.1f} | "
                         f"{_f(g['cpu_delta'], '+.1f')} | {_f(g['wait_delta'], '+.1f')} | "
                         f"{_f(g['parts'], '.0f')} | {'yes' if g['met'] else 'no'} |")
    return "\n".join(lines) if len(lines) > 2 else ""


CPU_ROLES = ("prefill-worker", "prefill-worker wait", "prefill-writer", "prefill-scheduler", "decode-worker",
             "decode-writer", "decode-scheduler", "local-worker", "local-worker wait", "local-writer",
             "local-scheduler")


def cpu_table(regime: dict, args) -> str:
    """CPU per request (ms, median; lone: each request's own, load: a run's over its requests) of
    each role's processes, the rest (router, supervisors) summed; ``wait``: the worker's time
    runnable but waiting for a core."""
    rows = []
    for mode in args.modes:
        for kind, lengths in (("lone", args.lengths), ("load", args.load_lengths)):
            for n in lengths:
                cpu = ((regime.get(mode, {}).get(str(n)) or {}).get(kind) or {}).get("cpu_ms")
                if cpu:
                    rows.append((mode, f"{n} {kind}" if kind == "load" else n, cpu))
    roles = [r for r in CPU_ROLES if any(r in c for _, _, c in rows)]
    if not rows:
        return ""
    head = "| mode | tokens | " + " | ".join(roles) + " | rest |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for mode, n, cpu in rows:
        rest = sum(v for k, v in cpu.items() if k not in roles and not k.endswith(" wait"))
        lines.append(f"| {mode} | {n} | " + " | ".join(_f(cpu.get(r)) for r in roles) + f" | {rest:.1f} |")
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
             f"lone: median of {args.reps}; load: {args.num_prompts} prompts at "
             f"{f'{args.link_load:g} of a capped link (uncapped: ' if args.link_load is not None else ''}"
             f"{bench.fmt_qps(args.qps)} QPS{')' if args.link_load is not None else ''} "
             f"(Poisson) at {', '.join(map(str, args.load_lengths))} tokens, {args.load_rounds} round(s) pooled; "
             f"times in ms"]
    for rate in args.rates:
        regime = results["regimes"].get(rate, {})
        parts += [f"\n### {rate}: {cap_text(rate)}\n", table(rate, regime, args, m)]
        st = stream_table(rate, regime, args, m)
        if st:
            parts += ["", "Streamed parts (lone medians, ms):", "", st]
        gt = goal_table(regime, args)
        if gt:
            parts += ["", "Streaming goal, lone medians (ms; hidden = TTFT push - TTFT streamed = tail "
                          "shortened - prefill Δ):", "", gt]
        ct = cpu_table(regime, args)
        if ct:
            parts += ["", "CPU per request (ms, median; the deployment's processes by role; load: per request of "
                          "a loaded run):", "", ct]
        if netns.parse_rate(rate) is not None:
            parts += ["", link_vs_compute(rate, regime, args, m)]
    return "\n".join(parts)


def plot_cells(regime: dict, args) -> dict:
    """The table's figures as pushkv plot's cells ((mode, qps, tokens) -> metric): a loaded run's
    point is its rounds pooled, as in the table (not the median of each round's median)."""
    cells = {}
    for mode, cs in regime.items():
        for n, c in cs.items():
            for kind, qps in (("lone", LONE_QPS), ("load", args.qps)):
                got = c.get(kind) or {}
                vals = {k: got[v] for k, v in (("median_ttft_ms", "ttft_ms"), ("median_tpot_ms", "tpot_ms"))
                        if got.get(v) is not None}
                if vals:
                    cells[(mode, qps, int(n))] = vals
    return cells


def load_text(rate: str, args) -> str:
    if args.link_load is not None and netns.parse_rate(rate) is not None:
        return f"load: {args.link_load:g} of the link"
    return f"load: {bench.fmt_qps(args.qps)} QPS"


def plots(args, results: dict) -> list[str]:
    paths = []
    for rate in args.rates:
        cells = plot_cells(results["regimes"].get(rate, {}), args)
        if not cells:
            continue
        path = os.path.join(args.out, f"ttft_{rate}.png")
        plot.plot(cells, path, title=f"link {rate}: {cap_text(rate)}",
                  column=lambda q, rate=rate: "lone requests" if q == LONE_QPS else load_text(rate, args))
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pushkv link-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", nargs="+", default=["1gbit", "none"], help="tc rates (1gbit, 10gbit, ...) or none")
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096], help="prompt tokens")
    ap.add_argument("--modes", nargs="+", default=DEFAULT_MODES, metavar="MODE[@CHUNK]",
                    help=f"of {', '.join(sorted(MODES))}; MODE@CHUNK: that mode with its own --prefill-chunk "
                         "(push@256 push-chunk@256 push@512 ...: chunk sizes side by side)")
    ap.add_argument("--reps", type=int, default=3, help="lone requests per length (median)")
    ap.add_argument("--qps", type=float, default=2.0, help="loaded run: Poisson arrival rate")
    ap.add_argument("--link-load", type=float, metavar="SHARE",
                    help="loaded run on a capped link: arrivals at this share of its capacity (0.9: QPS = 0.9 x "
                         "rate / one request's KV), per rate and length; --qps where the link is not capped")
    ap.add_argument("--num-prompts", type=int, default=16, help="loaded run: prompts")
    ap.add_argument("--load-lengths", nargs="*", type=int, default=[1024], help="loaded run at these lengths")
    ap.add_argument("--load-rounds", type=int, default=1,
                    help="loaded runs per mode and length, each with its own arrivals, the modes taking turns; "
                         "the figures pool every round's requests")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--ucx-tls", default=UCX_TLS,
                    help="P's and D's UCX_TLS (tcp,cuda_copy for pools in GPU memory: UCX over TCP all the same)")
    ap.add_argument("--ucx-net-devices", default=netns.DEV,
                    help="P's and D's UCX_NET_DEVICES: the TCP lanes bound to each host's veth end ('' = UCX's choice)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="pushkv preset")
    ap.add_argument("--geometry", default=DEFAULT_GEOMETRY, help="`pushkv up` geometry flags, one shell string")
    ap.add_argument("--prefill-chunk", type=int, default=256,
                    help="tokens per prefill step, every mode alike (push-chunk streams each chunk's KV)")
    ap.add_argument("--up-args", default="", help="more `pushkv up` flags for every host, one shell string")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="one mode's deployment at a time, each running every rate (less memory; the modes' "
                         "lone requests then lie minutes apart); default: every mode up at once, lone "
                         "requests alternating between them")
    ap.add_argument("--probe-mib", nargs="*", type=float, default=None,
                    help="at every capped rate, before the runs: NIXL WRITEs of these sizes between the hosts' "
                         "buffers (pushkv tcp-write-report's measurement), the link's rate of this sitting for "
                         "pushkv link-plan; default: what the cap moves in 40 and 160 ms; none given: no probe")
    ap.add_argument("--probe-reps", type=int, default=3, help="WRITEs per probe size (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/link")
    ap.add_argument("--replot", action="store_true",
                    help="run nothing: redraw OUT's tables and plots from OUT/link_bench.json (its run's arguments)")
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
    try:
        for sp in args.modes:
            split_mode(sp)
    except ValueError as e:
        ap.error(str(e))
    if len(set(args.modes)) != len(args.modes):
        ap.error(f"a mode twice in --modes {args.modes}")
    if any(split_mode(sp)[0] == "push-chunk" and chunk_of(sp, args) <= 0 for sp in args.modes):
        ap.error("push-chunk streams prefill chunks: give --prefill-chunk N > 0 (or push-chunk@N)")
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
    if args.replot:
        return replot(args.out)
    if os.geteuid() != 0:
        sys.exit("pushkv link-bench makes network namespaces and tc qdiscs: run it as root")
    m = model_config(args.model, args.geometry)
    os.makedirs(args.out, exist_ok=True)
    for rate in args.rates:
        os.makedirs(os.path.join(args.out, rate), exist_ok=True)
    print(f"KV per token: {kv_formula(m)}")
    for n in args.lengths:
        wires = ", ".join(f"{_f(wire_ms(kv_bytes(m, n), r))} ms at {r}" for r in args.rates
                          if netns.parse_rate(r) is not None)
        print(f"  {n} tokens: {kv_bytes(m, n) / 2**20:.1f} MiB of KV, {wires} on the wire")
    # every mode's flags: these, after its own (mode_flags: the mode, its prefill chunk)
    common = ["--model", args.model, "--load-format", "dummy", *shlex.split(args.geometry),
              "--num-blocks", str(num_blocks(args)), "--block-size", str(BLOCK_SIZE), *shlex.split(args.up_args)]
    results = {"date": date.today().isoformat(), "commit": _commit(),
               "argv": _argv(sys.argv[1:] if argv is None else argv),
               "model": {"preset": args.model, "geometry": args.geometry, "kv_bytes_per_token": m.kv_bytes_per_token(),
                         "num_layers": m.num_layers, "kv_formula": kv_formula(m)},
               # pushkv up's default layer groups when this ran (a flag in up_flags overrides it)
               "push_stream_groups": DeploymentConfig().push_stream_groups,
               # the writers' link windows over UCX's TCP lanes when --link-window is auto (link-plan's model)
               "auto_windows": dict(link_queue.AUTO_WINDOW),
               # how the pools cut the layers into groups (kv.layout.split_layers): the first and the
               # last group about half the others (runs that record none had equal groups)
               "layer_cut": "short_ends",
               # a prefill that ends while parts fly sends the rest of its whole units at once as one more part
               "rest_part": True,
               "up_flags": common, "mode_flags": {sp: mode_flags(sp, args) for sp in args.modes},
               "caps": {r: cap_text(r) for r in args.rates}, "regimes": {}}
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
            logs = pathlib.Path(args.out) / "logs"
            logs.mkdir(exist_ok=True)
            if args.one_at_a_time:
                for mode in args.modes:
                    bar.set_postfix_str(f"{mode}: starting")
                    with deployed(mode, net, registry, common, logs, args) as url:
                        for rate in args.rates:
                            run_rate(url, mode, rate, net, args, results, bar)
                            _save(results, args)
            else:
                with ExitStack() as up:
                    urls = {}
                    for mode in args.modes:  # each its own registry prefix: its router sees only its own
                        bar.set_postfix_str(f"{mode}: starting")
                        urls[mode] = up.enter_context(deployed(mode, net, f"{registry}/pushkv-{mode.replace('@', '-')}",
                                                               common, logs, args))
                    for rate in args.rates:
                        run_rate_side_by_side(urls, rate, net, args, results, bar)
                        _save(results, args)
    finally:
        bar.close()
    results["elapsed_s"] = round(time.monotonic() - t_start, 1)
    _save(results, args)
    write_report(results, args, m)
    print(f"wrote {os.path.join(args.out, 'link_bench.json')} ({results['elapsed_s']:.0f} s)")
    failed = sum((c.get(k) or {}).get("failed", 0) for reg in results["regimes"].values() for cs in reg.values()
                 for c in cs.values() for k in ("lone", "load"))
    return 1 if failed else 0


def write_report(results: dict, args, m) -> None:
    text = report(results, args, m)
    with open(os.path.join(args.out, "tables.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    for p in plots(args, results):
        print(f"wrote {p}")


def replot(out: str) -> int:
    """Tables and plots again from ``out/link_bench.json``, with the arguments its run had."""
    with open(os.path.join(out, "link_bench.json")) as f:
        results = json.load(f)
    args = parse_args([*results["argv"], "--out", out])
    write_report(results, args, model_config(args.model, args.geometry))
    return 0


def run_rate_side_by_side(urls: dict[str, str], rate: str, net, args, results: dict, bar) -> None:
    """Every cell at one rate with every mode's deployment up: the lone requests alternate
    between the modes (``lone_side_by_side``), then each mode's loaded run in turn."""
    from tqdm import tqdm

    for h in (net[1], net[2]):
        h.cap(rate)
    probe_link(net, rate, args, results, tqdm)
    out_dir = os.path.join(args.out, rate)
    for url in urls.values():
        warm_up(url, args)
    regime = results["regimes"].setdefault(rate, {})
    for n in args.lengths:
        bar.set_postfix_str(f"{rate} lone {n}")
        for mode, s in lone_side_by_side(urls, rate, n, args, out_dir).items():
            c = regime.setdefault(mode, {}).setdefault(str(n), {})["lone"] = cell(s)
            _print_cell(tqdm, mode, rate, "lone", n, c)
            bar.update(1)
        _print_goals(tqdm, regime, rate, n, args)
    modes = list(urls)
    m = model_config(args.model, args.geometry)
    for n in args.load_lengths:
        qps = load_qps(rate, n, args, m)
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for it in range(args.load_rounds):  # round by round, the order rotating: a drifting host load
            for mode in modes[it % len(modes):] + modes[:it % len(modes)]:  # spreads over every mode
                bar.set_postfix_str(f"{mode} {rate} load {n} round {it + 1}/{args.load_rounds}")
                runs[mode].append(loaded(urls[mode], mode, rate, n, args, out_dir, it, qps))
        for mode in modes:
            c = regime.setdefault(mode, {}).setdefault(str(n), {})["load"] = dict(cell(pooled(runs[mode])), qps=qps)
            _print_cell(tqdm, mode, rate, "load", n, c)
            bar.update(1)


def _print_cell(tqdm, mode: str, rate: str, kind: str, n: int, c: dict) -> None:
    pre = f" prefill {_f(c['prefill_ms'])}" if kind == "lone" else ""
    tqdm.write(f"{mode:16s} {rate:>7s} {kind} {n:6d}: TTFT {_f(c['ttft_ms'])} TPOT {_f(c['tpot_ms'])}{pre} "
               f"prefill end → KV {_f(c['pend_to_kv_ms'])} wire {_f(c['wire_ms'])} ms  failed {c['failed']}"
               + _parts_text(c))


def _print_goals(tqdm, regime: dict, rate: str, n: int, args) -> None:
    for stream, base in goal_pairs(args):
        g = goal(regime, n, stream, base)
        if g is not None:
            tqdm.write(f"{rate:>7s} {goal_line(g)}")


PROBE_S = (0.04, 0.16)  # the probe's WRITEs: what the cap moves in these times (a fixed cost, then the slope)


def probe_sizes(bps: float, mib: Optional[list[float]] = None) -> list[int]:
    """The probe's sizes in bytes: ``mib``, or what ``bps`` moves in ``PROBE_S`` (whole MiB, >= 1)."""
    got = mib if mib is not None else [max(1.0, round(t * bps / 8 / 2**20)) for t in PROBE_S]
    return [int(s * 2**20) for s in got]


def probe_link(net, rate: str, args, results: dict, tqdm) -> None:
    """The link's rate now, at ``rate``: NIXL WRITEs from P's host into D's, between host buffers,
    under the deployments' UCX settings (``tools.tcp_write_report.measure_on``, with a plain socket's
    stream beside them), kept under ``results["probes"][rate]`` (one per mode with
    --one-at-a-time): a capped TCP path moves less than its cap, by an amount that differs between
    sittings, and the planner models the link at what it moved (``tools.link_plan.link_rate``).
    A probe that fails is kept with its error; the runs go on."""
    bps = netns.parse_rate(rate)
    if bps is None or args.probe_mib == []:
        return
    from tools import tcp_write_report

    sizes = probe_sizes(bps, args.probe_mib)
    try:
        got = tcp_write_report.measure_on(net[1], net[2], sizes, args.probe_reps, ucx_env(args))
        row = {"at": round(time.time(), 3), "ucx_transport": got["ucx_transport"],
               "sizes": [{k: sz[k] for k in ("bytes", "nixl_s", "nixl_min_s", "tcp_s")} for sz in got["sizes"]]}
        tqdm.write(f"link probe at {rate}: " + ", ".join(
            f"{sz['bytes'] / 2**20:g} MiB WRITE {sz['bytes'] * 8 / sz['nixl_s'] / 1e9:.2f} Gbit/s "
            f"(socket {sz['bytes'] * 8 / sz['tcp_s'] / 1e9:.2f})" for sz in row["sizes"]))
    except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
        row = {"at": round(time.time(), 3), "error": repr(e)[-1000:]}
        tqdm.write(f"link probe at {rate} failed: {row['error']}")
    results.setdefault("probes", {}).setdefault(rate, []).append(row)


def run_rate(url: str, mode: str, rate: str, net, args, results: dict, bar) -> None:
    """Every cell of one mode at one rate, on the running deployment."""
    from tqdm import tqdm

    for h in (net[1], net[2]):
        h.cap(rate)
    probe_link(net, rate, args, results, tqdm)
    out_dir = os.path.join(args.out, rate)
    warm_up(url, args)
    regime = results["regimes"].setdefault(rate, {}).setdefault(mode, {})
    for n in args.lengths:
        bar.set_postfix_str(f"{mode} {rate} lone {n}")
        c = regime.setdefault(str(n), {})["lone"] = cell(lone(url, mode, rate, n, args, out_dir))
        _print_cell(tqdm, mode, rate, "lone", n, c)
        bar.update(1)
    m = model_config(args.model, args.geometry)
    for n in args.load_lengths:
        bar.set_postfix_str(f"{mode} {rate} load {n}")
        qps = load_qps(rate, n, args, m)
        c = regime.setdefault(str(n), {})["load"] = dict(cell(pooled([loaded(url, mode, rate, n, args, out_dir, it, qps)
                                                                     for it in range(args.load_rounds)])), qps=qps)
        _print_cell(tqdm, mode, rate, "load", n, c)
        bar.update(1)
    if any(mode in pair for pair in goal_pairs(args)):  # the goal, once both of a pair have run at this rate
        for n in args.lengths:
            _print_goals(tqdm, results["regimes"][rate], rate, n, args)


def _parts_text(c: dict) -> str:
    """The part stages of a streamed run (empty when nothing streamed)."""
    if not c.get("parts") and not c.get("stream"):
        return ""
    return (f"  parts {_f(c.get('parts'), '.0f')} ({c.get('stream')}): "
            f"first chunk (layer group) ends {_f(c.get('chunk1_ms'))}, "
            f"first part posted +{_f(c.get('part_lag_ms'), '.2f')}, on the wire {_f(c.get('part1_ms'))}, "
            f"last part landed {_f(c.get('parts_idle_ms'))} before prefill end")


def _save(results: dict, args) -> None:
    with open(os.path.join(args.out, "link_bench.json"), "w") as f:
        json.dump(results, f, indent=1)


def cli(argv=None) -> int:
    try:
        return main(argv)
    except KeyboardInterrupt:
        print("interrupted: hosts, qdiscs, etcd and every process removed; what ran is in --out",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(cli())
