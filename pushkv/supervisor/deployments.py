"""The commands against running deployments (``pushkv status``, ``pushkv stop``) and the sweep of
dead ones' residue that ``pushkv up`` runs first: each finds deployments through the registry
directory and talks to each supervisor's control socket. ``processes/cli.py`` parses the flags.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import time
from typing import Optional

import msgspec

from pushkv.supervisor import commands as c
from pushkv.supervisor import lifecycle, registry

ASK_TIMEOUT_S = 3.0


def _fmt_s(s: float) -> str:
    if s <= 0:
        return "-"
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"


def _pick(records: list[registry.DeploymentRecord], dep_id: Optional[str]) -> list[registry.DeploymentRecord]:
    if dep_id is None:
        return records
    return [r for r in records if r.deployment_id == dep_id or r.deployment_id.startswith(dep_id)]


def supervisor_alive(rec: registry.DeploymentRecord) -> bool:
    """The record's supervisor runs (its pid is ours and titled for its deployment: a reused or
    foreign pid counts as gone, and is never signalled)."""
    return lifecycle.is_our_supervisor(rec.pid, rec.deployment_id)


def clean_after(rec: registry.DeploymentRecord, who: str) -> list[str]:
    """Remove a dead deployment's record and, when the record is of pushkv's form
    (``registry.run_dir_problem``), its run dir and pool segments; else delete nothing and say why."""
    why = registry.run_dir_problem(rec)
    registry.remove_record(rec.deployment_id)
    if why:
        print(f"{who}: record {rec.deployment_id} removed, but nothing it names was deleted: {why}", file=sys.stderr)
        return []
    return lifecycle.cleanup(rec.deployment_id, rec.run_dir)


def sweep_residue() -> None:
    """A host whose processes were all killed left its deployments' records, run dirs and pools:
    remove this user's, and say what went."""
    for rec in registry.list_records():
        if not supervisor_alive(rec):
            removed = clean_after(rec, "pushkv up")
            print(f"pushkv up: removed dead deployment {rec.deployment_id} (supervisor pid {rec.pid} gone): "
                  f"its record, run dir and {len(removed)} pool segment(s)", file=sys.stderr)
    for path, why in lifecycle.sweep_residue():
        print(f"pushkv up: removed pool segment {path} ({why})", file=sys.stderr)


def status(dep_id: Optional[str] = None, as_json: bool = False) -> int:
    """``pushkv status [ID] [--json]``: every running deployment (or those matching ID) and its processes."""
    left = lifecycle.residue()
    for path, why in left:
        print(f"residue: {path} ({why}; `pushkv up` removes it)", file=sys.stderr)
    try:
        records = _pick(registry.list_records(), dep_id)
    except registry.RegistryError as e:
        print(f"pushkv status: {e}", file=sys.stderr)
        return 2
    if not records:
        print("no running pushkv deployments" + (f" matching {dep_id!r}" if dep_id else ""), file=sys.stderr)
        return 1
    report, rc = status_report(records)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return rc


def status_report(records: list[registry.DeploymentRecord]) -> tuple[list[dict], int]:
    """Each deployment's state, processes, instances and cost model (``pushkv status --json``), and
    the exit status: 1 if any is stale, unresponsive or in error."""
    report: list[dict] = []
    rc = 0
    for rec in records:
        entry = {"deployment_id": rec.deployment_id, "supervisor_pid": rec.pid, "router_url": rec.router_url,
                 "mode": rec.mode, "state": "", "processes": []}
        if not supervisor_alive(rec):
            entry["state"] = "stale"
            entry["error"] = f"supervisor pid {rec.pid} is gone; `pushkv stop {rec.deployment_id}` cleans up"
            rc = 1
        else:
            try:
                reply = c.ask(rec.control_endpoint, "status", timeout_s=ASK_TIMEOUT_S)
                entry["state"] = reply.info.get("phase", "?") if reply.status == c.OK else "error"
                entry["processes"] = [msgspec.structs.asdict(p) for p in reply.processes]
                # the run dir's socket only where the run dir is pushkv's own (a planted record points nowhere)
                health = router_health(rec.router_url, "" if registry.run_dir_problem(rec) else rec.run_dir)
                entry["instances"] = instance_rows(reply.info.get("instances", "[]"), reply.processes,
                                                   router_view(health))
                if health.get("costs"):
                    entry["costs"] = health["costs"]
                if reply.status != c.OK:
                    entry["error"], rc = reply.reason, 1
            except TimeoutError as e:
                entry["state"], entry["error"], rc = "unresponsive", str(e), 1
        report.append(entry)
    return report, rc


def print_report(report: list[dict]) -> None:
    """``pushkv status`` for people: a line per deployment, then its processes and instances."""
    for e in report:
        print(f"deployment {e['deployment_id']}  mode={e['mode']}  {e['router_url']}  "
              f"supervisor pid {e['supervisor_pid']}  {e['state']}")
        if e.get("error"):
            print(f"  {e['error']}")
        if e["processes"]:
            print(f"  {'NAME':<20} {'PID':>7}  {'STATE':<8} {'UPTIME':>7} {'RESTARTS':>8}  {'HEALTH':<9} LAST EXIT")
        for p in e["processes"]:
            ok = "ok" if p["healthy"] else ("-" if p["state"] != "READY" else "unhealthy")
            print(f"  {p['name']:<20} {p['pid'] or '-':>7}  {p['state']:<8} {_fmt_s(p['uptime_s']):>7} "
                  f"{p['restarts']:>8}  {ok:<9} {p['last_exit']}")
        if e.get("instances"):
            print(f"  {'INSTANCE':<10} {'ENGINE':<28} {'DEVICE':<8} {'STATE':<10} {'PROCS':>5} {'RESTARTS':>8} "
                  f"{'LEGS':>5} {'QUEUED TOK':>10} {'BLOCKS (router)':>16}")
        for i in e.get("instances", ()):
            blocks = f"{i['blocks_committed']}/{i['num_blocks']}" if i["role"] == "decode" and "legs" in i else "-"
            queued = i.get("queued_prefill_tokens", "-") if i["role"] == "prefill" else "-"
            print(f"  {i['name']:<10} {i['engine_id']:<28} {i['device']:<8} {i['state']:<10} {i['procs']:>5} "
                  f"{i['restarts']:>8} {i.get('legs', '-'):>5} {queued:>10} "
                  f"{blocks:>16}")
        for i in e.get("instances", ()):
            if i.get("metrics_url"):
                print(f"  {i['name']:<10} metrics {i['metrics_url']}")
        if e.get("costs"):
            print("  " + format_costs(e["costs"]))


def format_costs(c: dict) -> str:
    """The router's cost model on one line (ms), with the samples behind each fit."""
    return (f"cost model: prefill {c['prefill_ms_fixed']:.2f} + {c['prefill_ms_per_token']:.4f}/token + "
            f"{c['prefill_ms_per_cached_token']:.5f}/cached token ({c['prefill_samples']} samples); "
            f"handoff {c['handoff_ms_fixed']:.2f} + {c['handoff_ms_per_block']:.4f}/block ({c['handoff_samples']}); "
            f"decode step {c['step_ms_fixed']:.2f} + {c['step_ms_per_seq']:.3f}/seq + "
            f"{c['step_ms_per_kctx']:.4f}/seq x 1k context ({c['step_samples']}); "
            f"D's own prefill {c['local_prefill_ms_fixed']:.2f} + {c['local_prefill_ms_per_token']:.4f}/token "
            f"({c['local_samples']})")


def router_health(url: str, run_dir: str = "") -> dict:
    """The router's /health body; {} if unreachable. Read through its socket in the run dir where there is one (this
    host's own router: plain HTTP whatever its public edge asks, client certificates included), else at ``url``. Over
    HTTPS the certificate is not checked: this reads this host's own deployment's public /health, which a self-signed
    certificate serves as well, and sends nothing."""
    import ssl
    import urllib.request

    from pushkv import uds

    ctx = ssl._create_unverified_context() if url.startswith("https:") else None
    local = uds.run_dir_socket(run_dir)
    try:
        if local and os.path.exists(local):
            path: Optional[str] = local
        else:
            path = uds.path_of(url)
        if path is not None:  # the run dir's socket, or a router on a Unix socket (--uds)
            conn = uds.UnixHTTPConnection(path, timeout=ASK_TIMEOUT_S)
            try:
                conn.request("GET", "/health")
                body = json.loads(conn.getresponse().read())
            finally:
                conn.close()
        else:
            with urllib.request.urlopen(url + "/health", timeout=ASK_TIMEOUT_S, context=ctx) as r:
                body = json.loads(r.read())
    except (OSError, ValueError, http.client.HTTPException):
        return {}
    return body if isinstance(body, dict) else {}


def router_view(health) -> dict[str, dict]:
    """The router's own accounting per instance (its /health: the body, or the router's URL), by engine id."""
    if isinstance(health, str):
        health = router_health(health)
    return {i["engine_id"]: i for i in health.get("instances", ()) if isinstance(i, dict) and "engine_id" in i}


def instance_rows(instances_json: str, processes, router: dict[str, dict]) -> list[dict]:
    """One row per instance: its processes' states summed up, and the router's view of it."""
    try:
        insts = json.loads(instances_json)
    except ValueError:
        return []
    rows = []
    for i in insts:
        procs = [p for p in processes if p.role == i["role"] and p.instance == i["index"]]
        ready = sum(1 for p in procs if p.state == "READY")
        state = "up" if procs and ready == len(procs) else ("down" if ready == 0 else "restarting")
        view = router.get(i["engine_id"], {})
        if view and not view.get("up", True) and state == "up":
            state = "up (router: down)"
        row = dict(i, state=state, procs=f"{ready}/{len(procs)}", restarts=sum(p.restarts for p in procs))
        for k in ("legs", "queued_prefill_tokens", "blocks_committed", "blocks_pinned"):
            if k in view:
                row[k] = view[k]
        rows.append(row)
    if not insts:  # a router host (several hosts): the instances the router found in the registry
        for _, v in sorted(router.items()):
            rows.append(dict(v, name="-", index=0, device="-", procs="-", restarts="-",
                             state=("draining" if v.get("draining") else "up") if v.get("up") else "down"))
    return rows


def _stop_one(rec: registry.DeploymentRecord, timeout_s: float) -> bool:
    if not supervisor_alive(rec):
        removed = clean_after(rec, "pushkv stop")
        print(f"{rec.deployment_id}: supervisor was already gone; removed stale record"
              + (f" and {len(removed)} shm segment(s)" if removed else ""))
        return True
    try:
        reply = c.ask(rec.control_endpoint, "stop", {"reason": "pushkv stop"}, timeout_s=ASK_TIMEOUT_S)
        if reply.status != c.OK:
            print(f"{rec.deployment_id}: stop refused: {reply.reason}", file=sys.stderr)
    except TimeoutError:
        if not supervisor_alive(rec):  # checked again right before the signal: the pid may have gone and been reused
            print(f"{rec.deployment_id}: control socket silent and pid {rec.pid} is not its supervisor now; "
                  "not signalled", file=sys.stderr)
            return False
        print(f"{rec.deployment_id}: control socket silent; sending SIGTERM to {rec.pid}", file=sys.stderr)
        os.kill(rec.pid, signal.SIGTERM)
    t0 = time.monotonic()
    timeout_s += rec.shutdown_timeout_s  # the router's drain comes first
    if lifecycle.wait_pid_exit(rec.pid, timeout_s):
        print(f"{rec.deployment_id}: stopped in {time.monotonic() - t0:.1f}s")
        return True
    print(f"{rec.deployment_id}: supervisor pid {rec.pid} still running after {timeout_s:.0f}s", file=sys.stderr)
    return False


def stop(dep_id: Optional[str] = None, every: bool = False, timeout_s: float = 30.0) -> int:
    """``pushkv stop [ID] [--all]``: stop one deployment (the only one when no id is given), or every one."""
    try:
        records = registry.list_records()
    except registry.RegistryError as e:
        print(f"pushkv stop: {e}", file=sys.stderr)
        return 2
    if dep_id:
        records = _pick(records, dep_id)
    if not records:
        print("no running pushkv deployments" + (f" matching {dep_id!r}" if dep_id else ""), file=sys.stderr)
        return 1
    if len(records) > 1 and not every:
        ids = ", ".join(r.deployment_id for r in records)
        print(f"several deployments are running ({ids}); name one or pass --all", file=sys.stderr)
        return 2
    ok = [_stop_one(r, timeout_s) for r in records]
    return 0 if all(ok) else 1


