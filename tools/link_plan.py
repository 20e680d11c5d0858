"""pushkv link-plan: the planner's link model checked against a ``pushkv link-bench`` run.

For every capped rate and mode of the run, a profile is made from what the run measured *lone*:
P's prefill, a transfer's fixed cost, D's step; the link's rate is what link-bench's probe of that
sitting measured at the cap (NIXL WRITEs between the hosts' buffers over UCX's TCP lanes, the slope
over their sizes: ``link_rate``), or the cap's (the tc rate less the TCP and Ethernet headers) for runs
without a probe, and the mode's own path's where its lone transfers moved slower than that
(``plan.link.path_rate``: pull's READ through UCX's staging on the GPU). The planner then replays
each *loaded* run's own arrivals (``router.arrival`` of every request, and the prefix of each prompt
P and D already held, as the bytes it moved show) through ``pushkv.plan.sim`` with the writer's
link window and order, D's pool, P's step budget (``--max-batch-tokens``: the prompts that wait
while a step runs go in the next together) and P's and D's device (one GPU for both: their steps
share it; where UCX stages the transfers through that GPU, as pull's READs, none moves while a prefill
computes on it: ``Profile.staged_holds``) as the deployment ran them, and the predicted TTFT p50 is set
against the measured one.
The same replay without the link model (each transfer alone at the link's rate, what the planner
did before) shows what the queue adds.

    pushkv link-plan results/link              # a link-bench --out folder
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import statistics
import sys
from typing import Any, Optional

import msgspec

from pushkv.config import InstanceConfig
from pushkv.kv.layout import split_layers
from pushkv.plan import sim
from pushkv.plan import workload as W
from pushkv.plan.link import path_rate
from pushkv.plan.profile import Profile
from pushkv.router.cost import Costs
from pushkv.transport import staging_plan
from tools import bench, link_bench, netns

# what a TCP stream moves of what tbf lets through: MSS 1448 (timestamps on) of each 1514-byte frame
TCP_PAYLOAD_SHARE = 1448 / 1514
BLOCK_SIZE = 16
# the report's classes only (the model takes each rate as measured): a mode's path "bounds" it where
# it moves less than this share of the link's rate (pull's READ through UCX's staging on the GPU:
# 0.17-0.44; push's WRITE: 0.97-1.0, what a fit over two lengths gives of the cap)
PATH_BOUND_SHARE = 0.9
GOAL_ERROR = 0.20  # issue 27: the planner predicts the capped-link loads within 20 %
# link-bench mode -> the planner's mode
SIM_MODE = {"push": "push", "push-off": "push", "push-layer": "push-layer", "push-layer-ucx-staging": "push-layer",
            "pull-inline": "pull-inline", "pull-background": "pull"}
LEGACY_GROUPS = 4  # the default of the runs that did not record theirs (before 2026-12-03)
# P's step budget as pushkv up defaults it (a run's flags override it)
STEP_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(InstanceConfig)
                 if f.name in ("max_batch_tokens", "max_num_seqs")}


# what --without leaves out of the model: P's steps one prompt each, P and D each on a device of its own
WITHOUT: dict[str, dict[str, Any]] = {"batching": {"max_batch_tokens": 0},
                                      "shared-device": {"one_device": False, "staged_holds": False},
                                      "staged-holds": {"staged_holds": False}}


def flag(flags: list[str], name: str, default: str) -> str:
    """The last value of ``name`` in a ``pushkv up`` argv (what the deployment ran with)."""
    got = default
    for a, b in zip(flags, flags[1:]):
        if a == name:
            got = b
    return got


def link_setting(results: dict, mode: str, op: str = "write") -> tuple[int, str]:
    """The writers' link window (P's WRITEs, or ``op`` "read": D's READs from one P) and order as
    ``pushkv up`` ran them: window 0 (auto) is ``AUTO_WINDOW[op]`` over UCX's TCP lanes, which
    link-bench always uses."""
    flags = [*results["mode_flags"].get(mode, []), *results["up_flags"]]
    # auto as the run's pushkv had it (link-bench records it); runs before D's READ queue posted READs at
    # once, which moved about one after another, as the model took them then: 1
    auto = results.get("auto_windows", {}).get(op, 1)
    window = int(flag(flags, "--link-window", "0")) or auto
    return window, flag(flags, "--link-order", "arrival")


def lone(regime: dict, mode: str, n: int) -> dict:
    return ((regime.get(mode) or {}).get(str(n)) or {}).get("lone") or {}


def _median(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def profile_for(results: dict, rate: str, mode: str, n: int, out: Optional[str] = None) -> Optional[Profile]:
    """The lone measurements at ``n`` tokens and the cap, as the planner's profile; None where the
    run has no lone figures at that length. ``out``: the run's folder, whose lone reps give the
    mode's path its fastest transfer at each length (else the lone medians)."""
    bps = netns.parse_rate(rate)
    regime = results["regimes"].get(rate, {})
    kv_per_token = results["model"]["kv_bytes_per_token"]
    if bps is None or not lone(regime, mode, n):
        return None
    # the link's rate: the cap less the headers, or this mode's path where it is slower (the slope
    # of its lone transfers' time over their bytes: a lone WRITE's own rate is lower than the cap's
    # by its post and notice, which are the fixed cost below, not a slower path)
    link_per_block = link_ms_per_block(results, rate)
    fastest = fastest_wire_ms(out, rate, mode) if out else None
    per_block = 1.0 / path_rate(1.0 / link_per_block, lone_transfers(regime, mode, kv_per_token, fastest))
    whole = whole_transfer(regime, mode, n, kv_per_token, fastest)
    if whole is not None:  # one length only (no slope: the link's rate above): its one transfer's rate
        per_block = max(per_block, whole[1] / whole[0])
    # one hardware figure for P's prefill: the median over every mode's lone runs at this length
    prefill = _median([lone(regime, m, n).get("prefill_ms") for m in regime])
    own = lone(regime, mode, n)
    if prefill is None or None in (own.get(k) for k in ("ttft_ms", "prefill_ms", "pend_to_kv_ms", "tpot_ms")):
        return None
    # P's step: the lone prompt's own cost a token (attention makes a token of a long prompt dearer,
    # so this length's figure, not a line over the lengths: every prompt of a run has its length),
    # and no fixed part a step (TTFT's own rest is each request's, ``lone_rest_ms``)
    costs = Costs(prefill_ms_fixed=0.0, prefill_ms_per_token=prefill / n, prefill_ms_per_cached_token=0.0,
                  handoff_ms_fixed=0.0, handoff_ms_per_block=per_block,
                  step_ms_fixed=own["tpot_ms"], step_ms_per_seq=0.0, step_ms_per_kctx=0.0)
    flags = [*results["mode_flags"].get(mode, []), *results["up_flags"]]
    window, order = link_setting(results, mode)
    # push-layer's groups as the deployment ran them (a lone run's part count is not it: a part
    # carries every group stored while the one before was on the wire); D's pool as it ran; P's
    # step budget as it ran (the prompts that wait while a step runs go in the next one together); P's
    # pool as D's (link-bench gives both sides one --num-blocks)
    # (cut as the pools are: a 4-layer model streams 4 groups whatever the flag says)
    groups = int(flag(flags, "--push-stream-groups", str(results.get("push_stream_groups", LEGACY_GROUPS))))
    cut: tuple[int, ...] = ()
    if results["model"].get("num_layers"):
        split = split_layers(results["model"]["num_layers"], groups)
        groups = len(split)
        if results.get("layer_cut") == "short_ends":  # runs before it recorded none: equal groups
            cut = tuple(len(g) for g in split)
    capacity = int(flag(flags, "--num-blocks", "0")) * int(flag(flags, "--block-size", str(BLOCK_SIZE)))
    prof = Profile(f"{rate} {mode} lone", costs, block_size=BLOCK_SIZE, relay_ms=0.0, layer_groups=groups,
                   # the rest at once: recorded, or implied by the short-ends cut (the same change)
                   group_layers=cut, rest_at_end=bool(results.get("rest_part", results.get("layer_cut"))),
                   d_capacity_tokens=capacity or Profile.d_capacity_tokens,
                   p_capacity_tokens=capacity or Profile.p_capacity_tokens,
                   link_window=window, link_order=order,  # type: ignore[arg-type]
                   read_window=link_setting(results, mode, "read" if SIM_MODE.get(mode, "").startswith("pull")
                                            else "write")[0],
                   max_batch_tokens=int(flag(flags, "--max-batch-tokens", str(STEP_DEFAULTS["max_batch_tokens"]))),
                   max_num_seqs=int(flag(flags, "--max-num-seqs", str(STEP_DEFAULTS["max_num_seqs"]))),
                   one_device=one_device(flags), staged_holds=one_device(flags) and transport_staged(flags))
    # the transfer's fixed cost: this mode's lone prefill end -> KV landed less what the model puts
    # there without one (the bytes on the link, a streamed mode's parts placed while P computes):
    # the posts, the staging copies, D's copy-in and its notice
    fixed = own["pend_to_kv_ms"] - _model_tail(prof, SIM_MODE.get(mode, "push"), n, own["prefill_ms"])
    return dataclasses.replace(prof, costs=dataclasses.replace(costs, handoff_ms_fixed=max(fixed, 0.0)))


def one_device(flags: list[str]) -> bool:
    """P and D on one GPU, as the deployment ran them (their steps then share it)."""
    device = flag(flags, "--device", "cpu")
    p, d = flag(flags, "--prefill-device", device), flag(flags, "--decode-device", device)
    return p == d and p.startswith("cuda")


def transport_staged(flags: list[str]) -> bool:
    """The deployment's transfers staged by UCX through a GPU (``staging_plan.wanted`` false on a
    GPU pool: pull, or ``--staging transport``), over the UCX TCP lanes link-bench always uses."""
    device = flag(flags, "--device", "cpu")
    mode = flag(flags, "--mode", "push")
    return device.startswith("cuda") and not staging_plan.wanted(flag(flags, "--staging", "auto"), mode, device, "tcp")


def lone_rest_ms(results: dict, rate: str, mode: str, n: int) -> float:
    """What a lone request's TTFT holds besides P's prefill and the handoff: the router, P's queue
    entry, D's first token after the KV (each request's own, not a step's)."""
    own = lone(results["regimes"].get(rate, {}), mode, n)
    return max(own["ttft_ms"] - own["prefill_ms"] - own["pend_to_kv_ms"], 0.0)


def cap_ms_per_block(results: dict, rate: str) -> float:
    """A KV block's time on the capped link: the tc rate less the TCP and Ethernet headers."""
    bps = netns.parse_rate(rate)
    if bps is None:
        raise ValueError(f"{rate}: not a capped rate")
    return results["model"]["kv_bytes_per_token"] * BLOCK_SIZE * 8 / (bps * TCP_PAYLOAD_SHARE) * 1e3


def cap_rate(results: dict, rate: str) -> float:
    """The capped link's payload rate (bytes per ms): the tc rate less the TCP and Ethernet headers."""
    return results["model"]["kv_bytes_per_token"] * BLOCK_SIZE / cap_ms_per_block(results, rate)


def probe_points(results: dict, rate: str) -> list[tuple[float, float]]:
    """(bytes, ms) of every size link-bench's probe WRITEs measured at ``rate`` (each probe's median),
    the probes that failed left out."""
    return [(sz["bytes"], sz["nixl_s"] * 1e3) for pr in (results.get("probes") or {}).get(rate, [])
            if "error" not in pr for sz in pr.get("sizes", [])]


def parts_rate(results: dict, rate: str) -> Optional[float]:
    """What the deployment's own streamed WRITEs moved at ``rate`` (bytes per ms), at the least: of
    each lone streamed run whose last part landed after its prefill ended (the link, not P's compute,
    was behind), its parts' bytes over the time from its first part's post to its last part's end
    (the link may have idled between parts early on, so the link moves this much or more); the
    fastest of them. None where no lone run streamed so."""
    best = None
    for cells in (results.get("regimes") or {}).get(rate, {}).values():
        for cell in cells.values():
            lo = cell.get("lone") or {}
            keys = ("part_bytes", "prefill_ms", "parts_idle_ms", "chunk1_ms", "part_lag_ms")
            if any(lo.get(k) is None for k in keys) or lo["parts_idle_ms"] >= 0:
                continue
            span = lo["prefill_ms"] - lo["parts_idle_ms"] - lo["chunk1_ms"] - lo["part_lag_ms"]
            if span > 0:
                best = max(best or 0.0, lo["part_bytes"] / span)
    return best


def link_rate(results: dict, rate: str) -> tuple[float, str]:
    """The capped link's payload rate (bytes per ms) and where it comes from, never above the cap
    less the headers (``cap``, also where nothing was measured): the slope of the sitting's probe
    WRITEs over their sizes (``probe``), or, where faster, what the deployment's own streamed parts
    moved lone (``lone parts``). The probe is one WRITE's path; over a fast capped link one TCP flow
    moves less than the deployment's lanes do (on the H200 at 25 Gbit/s: the probe 9.6-10.2 Gbit/s,
    the lone parts 22.9), so what the parts moved is the floor."""
    cap = cap_rate(results, rate)
    pts = probe_points(results, rate)
    probe = path_rate(cap, pts) if len({b for b, _ in pts}) >= 2 else None
    parts = parts_rate(results, rate)
    if parts is not None and (probe is None or parts > probe):
        return (parts, "lone parts") if parts < cap else (cap, "cap")
    if probe is not None:  # (path_rate: the cap at most)
        return probe, "probe"
    return cap, "cap"


def link_lines(results: dict) -> list[str]:
    """Per capped rate of a run: the link's rate the model takes and where from, beside the cap's and
    each probe's largest WRITE (what one WRITE alone moved, its fixed cost included)."""
    out = []
    for rate in results["regimes"]:
        if netns.parse_rate(rate) is None:
            continue
        got, source = link_rate(results, rate)
        cap = cap_rate(results, rate)
        probes = (results.get("probes") or {}).get(rate, [])
        ones = [max(pr["sizes"], key=lambda sz: sz["bytes"]) for pr in probes if pr.get("sizes")]
        seen = ", ".join(f"{sz['bytes'] * 8 / sz['nixl_s'] / 1e9:.2f}" for sz in ones) or "none"
        failed = sum(1 for pr in probes if "error" in pr)
        out.append(f"{rate}: the link at {got * 8 / 1e6:.2f} Gbit/s ({source}); the cap less the headers "
                   f"{cap * 8 / 1e6:.2f}; the probes' largest WRITE alone {seen} Gbit/s"
                   + (f"; {failed} probe(s) failed" if failed else ""))
    return out


def link_ms_per_block(results: dict, rate: str) -> float:
    """A KV block's time on the link at ``rate`` (``link_rate``)."""
    return results["model"]["kv_bytes_per_token"] * BLOCK_SIZE / link_rate(results, rate)[0]


def bound_by(r: dict) -> str:
    """What sets a loaded run's pace at its lone costs: "path" (the mode's path moves slower than the
    link: pull's READ through UCX's staging), "link" (the link busier than P), else "P"."""
    if r["link_busy"] < PATH_BOUND_SHARE * r["path_busy"]:
        return "path"
    return "link" if r["link_busy"] >= r["p_busy"] else "P"


def _model_tail(prof: Profile, mode: str, n: int, prefill_ms: float) -> float:
    """What ``prof`` (no fixed cost) puts between a lone request's prefill end and its KV landing:
    the bytes on the link as the model places them (a streamed mode's parts while P computes)."""
    wl = W.Arrivals((0.0,), (n,), 1, ((0.0, prefill_ms),))
    (r,) = sim.simulate(wl, prof, mode, 1, 1)  # type: ignore[arg-type]
    assert r.first is not None and r.prefill_end is not None
    return r.first - r.prefill_end


def lone_transfers(regime: dict, mode: str, kv_per_token: int,
                   fastest: Optional[dict[int, float]] = None) -> list[tuple[float, float]]:
    """(blocks, ms on the wire) of this mode's lone transfers at each length (the last WRITE or the
    READ: what D's notification announced): the lone runs' median, or the fastest rep where
    ``fastest`` has it (``fastest_wire_ms``)."""
    out = []
    for n_text in (regime.get(mode) or {}):
        lo = lone(regime, mode, int(n_text))
        if lo.get("kv_bytes") and lo.get("wire_ms"):
            wire = min(lo["wire_ms"], (fastest or {}).get(int(n_text), lo["wire_ms"]))
            out.append((lo["kv_bytes"] / (kv_per_token * BLOCK_SIZE), wire))
    return out


def fastest_wire_ms(out: str, rate: str, mode: str) -> dict[int, float]:
    """Per length, the fastest of a mode's lone reps on the wire (its run files in ``out``): the path's
    own time, where a slower rep met something else (a lone READ through UCX's staging on the H200 varied
    by up to 17 % between reps: docs/results/2026-12-03-staged-holds)."""
    got: dict[int, float] = {}
    for path in glob.glob(os.path.join(out, rate, f"{mode}_qps0_in*_out*_iter*.json")):
        meta = bench.parse_result_name(path)
        if not meta or meta["mode"] != mode:
            continue
        with open(path) as f:
            run = json.load(f)
        n = int(run.get("input_len") or 0)
        for tl in run.get("timelines") or []:
            for a, b in link_bench.SPANS["wire_ms"]:  # the span link-bench's wire_ms takes
                if a in tl and b in tl:
                    got[n] = min(got.get(n, float("inf")), (tl[b] - tl[a]) * 1e3)
                    break
    return got


def whole_transfer(regime: dict, mode: str, n: int, kv_per_token: int,
                   fastest: Optional[dict[int, float]] = None) -> Optional[tuple[float, float]]:
    """(blocks, ms on the wire) of this mode's lone transfer at ``n`` tokens where it is the only
    length the run has and that one transfer moved the whole prompt's KV (pull's READ, an unstreamed
    WRITE): its rate, fixed cost and all, is then the path's (a long transfer's fixed cost is small
    beside it; a streamed mode's last WRITE, one unit, says nothing of the path). None otherwise."""
    pts = lone_transfers(regime, mode, kv_per_token, fastest)
    if len(pts) != 1 or pts[0][0] < 0.9 * -(-n // BLOCK_SIZE):
        return None
    return pts[0]


def arrivals(run: dict, replay: bool = False, kv_per_token: int = 0) -> W.Arrivals:
    """A loaded run's requests as they arrived at the router (its timelines); ``replay``: with each
    one's prefill and D's time from the KV to its first token as the run measured them.
    ``kv_per_token``: each prompt's prefix that P and D already held, from the bytes it moved (a
    run whose prompts begin as an earlier run's did: link-bench's loads share a seed)."""
    tls = run["timelines"]
    starts = [tl.get("router.arrival") for tl in tls]
    if any(t is None for t in starts):
        raise ValueError("a request of the run has no router.arrival in its timeline")
    t0 = min(starts)
    extra: dict = {}
    if replay:
        extra["prefills_ms"] = tuple((_span(tl, "router.arrival", "prefill.prefill_start"),
                                      _span(tl, "router.arrival", "prefill.prefill_end")) for tl in tls)
        extra["lands_ms"] = tuple(_span(tl, "decode.kv_received", "router.first_token") for tl in tls)
    if kv_per_token:
        kvs = run.get("kv") or [None] * len(tls)
        extra["cached"] = tuple(cached_tokens(n, kv, kv_per_token) for n, kv in zip(run["input_lens"], kvs))
    return W.Arrivals(tuple(t - t0 for t in starts), tuple(run["input_lens"]), int(run["output_lens"][0] or 1),
                      **extra)


def cached_tokens(prompt: int, kv: Optional[dict], kv_per_token: int) -> int:
    """The prompt's prefix one request did not move: its length less what P wrote (push) or D read
    (pull); 0 where the run kept no count."""
    moved = ((kv or {}).get("prefill") or (kv or {}).get("decode") or {}).get("bytes")
    return 0 if not moved else min(prompt, max(0, prompt - moved // kv_per_token))


def _span(tl: dict, a: str, b: str) -> float:
    if a not in tl or b not in tl:
        raise ValueError(f"a request of the run has no {a if a not in tl else b} in its timeline")
    return (tl[b] - tl[a]) * 1e3


def measured_tail_ms(run: dict) -> Optional[float]:
    """The run's prefill end -> KV landed, p50 (the stage the link and its queue make)."""
    return _median([(tl["decode.kv_received"] - tl["prefill.prefill_end"]) * 1e3 for tl in run["timelines"]
                    if "decode.kv_received" in tl and "prefill.prefill_end" in tl])


def predicted_tail_ms(reqs: list) -> Optional[float]:
    return _median([r.first - r.turn.land_ms - r.prefill_end for r in reqs if r.prefill_end is not None])


def loaded_runs(out: str, rate: str, mode: str, n: int) -> list[dict]:
    runs = []
    for path in sorted(glob.glob(os.path.join(out, rate, f"{mode}_qps*_in{n}_out*_iter*.json"))):
        meta = bench.parse_result_name(path)
        if meta and meta["mode"] == mode and meta["qps"] > 0:
            with open(path) as f:
                runs.append(json.load(f))
    return runs


def check(out: str, without: tuple[str, ...] = (), skipped: Optional[list[str]] = None) -> list[dict]:
    """One row per (rate, mode, length) with a loaded run: measured and predicted TTFT p50;
    ``without``: parts of the model left out of the prediction (``WITHOUT``), to see what each adds.
    A run with failed requests is not checked (a failed request's timeline has no first token):
    a line for it goes to ``skipped``."""
    with open(os.path.join(out, "link_bench.json")) as f:
        results = json.load(f)
    rows = []
    for rate, regime in results["regimes"].items():
        lrate, lfrom = link_rate(results, rate) if netns.parse_rate(rate) is not None else (0.0, "-")
        for mode in regime:
            for n_text in regime[mode]:
                n = int(n_text)
                prof = profile_for(results, rate, mode, n, out)
                runs = loaded_runs(out, rate, mode, n)
                if prof is None or not runs or mode not in SIM_MODE:
                    continue
                for part in without:
                    prof = dataclasses.replace(prof, **WITHOUT[part])
                for run in runs:
                    if run.get("failed"):
                        if skipped is not None:
                            skipped.append(f"{rate} {mode} {n} tokens at QPS {run['request_rate']:g}: "
                                           f"{run['failed']} of {len(run['input_lens'])} failed, not checked")
                        continue
                    mode_ = SIM_MODE[mode]
                    kvt = results["model"]["kv_bytes_per_token"]
                    wl, replay = arrivals(run, kv_per_token=kvt), arrivals(run, replay=True, kv_per_token=kvt)
                    wl = dataclasses.replace(wl, lands_ms=(lone_rest_ms(results, rate, mode, n),) * len(wl.starts))
                    got = sim.summary(sim.simulate(wl, prof, mode_, 1, 1))  # type: ignore[arg-type]
                    alone = sim.summary(sim.simulate(wl, dataclasses.replace(prof, link_window=None),
                                                     mode_, 1, 1))  # type: ignore[arg-type]
                    rep = sim.simulate(replay, prof, mode_, 1, 1)  # type: ignore[arg-type]
                    rep_alone = sim.simulate(replay, dataclasses.replace(prof, link_window=None),
                                             mode_, 1, 1)  # type: ignore[arg-type]
                    meas = run["median_ttft_ms"]
                    rows.append({
                        "rate": rate, "mode": mode, "tokens": n, "qps": run["request_rate"],
                        "requests": len(wl.starts), "window": prof.link_window, "order": prof.link_order,
                        "failed": run["failed"], "measured": meas,
                        # every cost from the lone runs and the cap
                        "predicted": got["ttft_p50"], "no_link_model": alone["ttft_p50"],
                        # each request's compute as the run measured it: the link and the queues predicted
                        "replayed": sim.summary(rep)["ttft_p50"],
                        "replayed_no_link_model": sim.summary(rep_alone)["ttft_p50"],
                        # the share of the time each resource is busy at this load (lone costs): the link's
                        # (its bytes at its rate: the probe's or the cap's) and P's (its lone prefill)
                        # and the mode's path's (its bytes at the rate it moves them: the cap's, or
                        # its own path's where that is slower)
                        "link_busy": run["request_rate"] * -(-n // BLOCK_SIZE) * kvt * BLOCK_SIZE / lrate / 1e3,
                        "link_gbit_s": lrate * 8 / 1e6, "link_from": lfrom,
                        "path_busy": run["request_rate"] * -(-n // BLOCK_SIZE) * prof.costs.handoff_ms_per_block / 1e3,
                        "path_gbit_s": kvt * BLOCK_SIZE * 8 / prof.costs.handoff_ms_per_block / 1e6,
                        "p_busy": run["request_rate"] * prof.costs.prefill_ms_per_token * n / 1e3,
                        "p_wait_measured": _median([_span(tl, "router.arrival", "prefill.prefill_start")
                                                    for tl in run["timelines"]]),
                        "tail_measured": measured_tail_ms(run), "tail_replayed": predicted_tail_ms(rep),
                        "tail_replayed_no_link_model": predicted_tail_ms(rep_alone)})
    return rows


def _err(pred: Optional[float], meas: Optional[float]) -> str:
    return "-" if pred is None or not meas else f"{100 * (pred / meas - 1):+.0f} %"


def error(r: dict, key: str, of: str = "measured") -> float:
    return r[key] / r[of] - 1


def table(rows: list[dict]) -> str:
    head = ("| rate | mode | tokens | QPS | window | link Gbit/s | path Gbit/s | link busy | path busy | P busy "
            "| bound "
            "| P's queue p50 measured | TTFT p50 measured "
            "| predicted from lone runs | error | replayed compute | error | same, no link model | error "
            "| prefill end → KV landed p50: measured | replayed | error | no link model | error |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['rate']} | {r['mode']} | {r['tokens']} | {r['qps']:g} | {r['window']} | "
                     f"{r['link_gbit_s']:.2f} ({r['link_from']}) | {r['path_gbit_s']:.2f} | {r['link_busy']:.2f} | "
                     f"{r['path_busy']:.2f} | {r['p_busy']:.2f} | "
                     f"{bound_by(r)} | {f(r['p_wait_measured'])} | {f(r['measured'])} | "
                     f"{f(r['predicted'])} | "
                     f"{_err(r['predicted'], r['measured'])} | "
                     f"{f(r['replayed'])} | {_err(r['replayed'], r['measured'])} | "
                     f"{f(r['replayed_no_link_model'])} | {_err(r['replayed_no_link_model'], r['measured'])} | "
                     f"{f(r['tail_measured'])} | {f(r['tail_replayed'])} | "
                     f"{_err(r['tail_replayed'], r['tail_measured'])} | {f(r['tail_replayed_no_link_model'])} | "
                     f"{_err(r['tail_replayed_no_link_model'], r['tail_measured'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pushkv link-plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="+", help="link-bench --out folders (link_bench.json and the runs' JSON)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--without", action="append", default=[], choices=sorted(WITHOUT),
                    help="leave this part out of the model (repeatable): P's steps one prompt each "
                         "(batching), P and D each on a device of its own (shared-device), transfers "
                         "UCX stages through the GPU moving while a prefill computes there (staged-holds)")
    args = ap.parse_args(argv)
    rows = []
    for out in args.out:
        skipped: list[str] = []
        try:
            with open(os.path.join(out, "link_bench.json")) as f:
                for line in link_lines(json.load(f)):
                    print(f"{out}: {line}")
            rows += [dict(r, run=out) for r in check(out, tuple(args.without), skipped)]
            for line in skipped:
                print(f"{out}: {line}")
        except (OSError, KeyError, ValueError) as e:
            print(f"pushkv link-plan: {out}: {e}", file=sys.stderr)
            return 2
    print(table(rows))
    if rows:
        # link-bound: the link busier than P (else P's compute sets the pace, and on a shared CPU its
        # cost under load is not the lone one); path-bound: the mode's own path slower than the link
        classes = (("loaded runs", rows),
                   ("link-bound ones (the link busier than P, the mode's path as fast as the link)",
                    [r for r in rows if bound_by(r) == "link"]),
                   ("path-bound ones (the mode's path slower than the link)",
                    [r for r in rows if bound_by(r) == "path"]))
        for key, what in (("predicted", "every cost from the lone runs"),
                          ("replayed", "each request's compute replayed, the link and queues predicted")):
            for name, rs in classes:
                if rs:
                    worst = max(abs(error(r, key)) for r in rs)
                    print(f"TTFT p50, {what}: worst error {100 * worst:.0f} % over {len(rs)} {name} "
                          f"(goal: within {100 * GOAL_ERROR:.0f} %: {'met' if worst <= GOAL_ERROR else 'NOT met'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
