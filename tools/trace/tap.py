"""pushkv tap: attach to a running deployment's trace and show what moves.

Finds the deployment through the supervisor's registry (``pushkv up --trace``
records where taps attach), subscribes, decodes every mirrored message with
pushkv's own schema, and

- prints a live log, filterable by transfer id, process and message type;
- writes a Chrome/Perfetto trace JSON (``--perfetto``): one track group per
  request, a lane per process, spans for queueing, prefill, registration,
  rendezvous wait, WRITE or READ, KV received and decode, message arrows;
- prints a per-request stage breakdown (``--breakdown``): prefill compute,
  relay, transfer, first decode step, TTFT.

Stops on Ctrl-C, after ``--duration`` seconds or after ``--requests`` finished
requests; ``--record`` keeps the raw events, ``--replay`` analyses them later.
"""
from __future__ import annotations

import argparse
import fnmatch
import heapq
import os
import signal
import sys
import time
from typing import Iterable, Optional

import msgspec
import zmq

from pushkv import messages as m
from pushkv import security
from pushkv.supervisor import deployments, registry
from tools.trace import merge as trace_merge
from tools.trace import timeline as T

RCVHWM = 1_000_000
REORDER_S = 0.05  # the live log holds events this long to print them in time order across processes
LINGER_S = 0.5  # after the last wanted request finished: late events (P's lease release) still come
ALIVE_CHECK_S = 1.0  # a deployment found through the registry: how often the tap looks whether it still runs


class TapError(Exception):
    pass


def find_endpoint(dep_id: Optional[str] = None,
                  directory: Optional[str] = None) -> tuple[str, registry.DeploymentRecord]:
    """The tap endpoint of the one running (traced) deployment, or of ``dep_id`` (a prefix)."""
    try:
        recs = registry.list_records(directory)
    except registry.RegistryError as e:
        raise TapError(str(e)) from e
    if dep_id:
        recs = [r for r in recs if r.deployment_id.startswith(dep_id)]
    if not recs:
        raise TapError("no running pushkv deployment" + (f" matching {dep_id!r}" if dep_id else ""))
    traced = [r for r in recs if r.trace_tap_endpoint]
    if not traced:
        raise TapError(f"deployment(s) {', '.join(r.deployment_id for r in recs)} run without tracing; "
                       "start with `pushkv up --trace`")
    if len(traced) > 1:
        raise TapError(f"several traced deployments ({', '.join(r.deployment_id for r in traced)}); pass --id")
    return traced[0].trace_tap_endpoint, traced[0]


class Tap:
    """A SUB on the deployment's tap endpoint (or bound at the processes' own trace endpoint)."""

    def __init__(self, endpoint, bind: bool = False, ctx: Optional[zmq.Context] = None,
                 secure: Optional[security.Security] = None):
        """``endpoint``: one, or a list (connect only): one SUB on every host's tap endpoint."""
        self.sock = (ctx or zmq.Context.instance()).socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            security.secure_bind(self.sock, endpoint, secure)
        else:
            for ep in [endpoint] if isinstance(endpoint, str) else endpoint:
                security.secure_connect(self.sock, ep, secure)
        self.undecodable = 0

    def poll(self, timeout_ms: int = 100) -> list[m.TraceEvent]:
        """Every event queued now; waits up to ``timeout_ms`` for the first."""
        out: list[m.TraceEvent] = []
        if not self.sock.poll(timeout_ms):
            return out
        while True:
            try:
                raw = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(m.DEC_TRACE.decode(raw))
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.undecodable += 1

    def close(self) -> None:
        self.sock.close(0)

    def __enter__(self) -> "Tap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- the live log -----------------------------------------------------------------------------


class Filter:
    def __init__(self, tids: Iterable[str] = (), processes: Iterable[str] = (), kinds: Iterable[str] = ()):
        self.tids = tuple(tids)
        self.processes = tuple(processes)
        self.kinds = {k.lower() for k in kinds}

    def __call__(self, ev: m.TraceEvent) -> bool:
        if self.tids and not any(ev.transfer_id.startswith(t) for t in self.tids):
            return False
        if self.processes and not any(fnmatch.fnmatch(ev.process, p) or ev.process.startswith(p)
                                      for p in self.processes):
            return False
        return not self.kinds or ev.kind.lower() in self.kinds


def format_event(ev: m.TraceEvent, t0: float) -> str:
    arrow = {"send": "->", "recv": "<-", "event": "**"}.get(ev.direction, "?")
    peer = ev.peer if ev.direction != "event" else "-"
    detail = T.summarize(T.decode_payload(ev)) if ev.payload else (ev.peer if ev.direction == "event" else "")
    tid = ev.transfer_id[:8] if ev.transfer_id else "-"
    return (f"{(ev.t_mono - t0) * 1e3:11.3f} ms  {ev.process:<18} {arrow} {peer:<22} {ev.kind:<16} "
            f"{tid:<8}  {detail}")


# -- command line ------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pushkv tap", description=__doc__.split("\n\n")[0])
    src = ap.add_argument_group("source (default: the one deployment started with `pushkv up --trace`)")
    src.add_argument("--id", help="deployment id (prefix) in the registry")
    src.add_argument("--endpoint", action="append", default=[],
                     help="connect to this tap endpoint instead; repeat it for several hosts (their clocks are "
                          "aligned from the messages between them: tools/trace/merge.py)")
    src.add_argument("--bind", metavar="ENDPOINT",
                     help="bind a SUB at the processes' trace endpoint (deployments without a supervisor)")
    src.add_argument("--replay", metavar="FILE", help="analyse events saved with --record; no socket")
    src.add_argument("--secret-file", default="", help="the deployment's CURVE secret (a tcp:// tap endpoint)")
    flt = ap.add_argument_group("live log filters (several allowed)")
    flt.add_argument("--tid", action="append", default=[], help="transfer id prefix")
    flt.add_argument("--process", action="append", default=[], help="process name, prefix or glob")
    flt.add_argument("--kind", action="append", default=[], help="message type or event (e.g. Register, write_done)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no live log")
    ap.add_argument("--perfetto", metavar="FILE", help="write a Chrome/Perfetto trace JSON at the end")
    ap.add_argument("--breakdown", action="store_true", help="print the per-request stage breakdown at the end")
    ap.add_argument("--spans", action="store_true", help="print each request's spans (the Perfetto tracks) as text")
    ap.add_argument("--record", metavar="FILE", help="save the raw events (msgpack) for --replay, readable by its "
                    "owner alone (mode 0600: it holds the prompts' token ids)")
    ap.add_argument("--duration", type=float, default=0.0, metavar="SECONDS", help="stop after this long")
    ap.add_argument("--requests", type=int, default=0, metavar="N", help="stop after N requests finished")
    return ap.parse_args(argv)


def report(events: list[m.TraceEvent], args: argparse.Namespace, out=None, only: Optional[list[str]] = None) -> None:
    """The recording, the per-request listing and breakdown; ``only``: the requests to list (``--requests N``'s
    first N finished: others that finished while the tap lingered for their last events are left out)."""
    out = out or sys.stdout
    if len({e.host for e in events}) > 1:  # several hosts: one clock, one lane per process and host
        events, al = trace_merge.merged(events)
        print(trace_merge.describe(al), file=out)
    tids = args.tid
    if tids:
        events = [e for e in events if not e.transfer_id or any(e.transfer_id.startswith(t) for t in tids)]
    if args.perfetto:
        T.write_perfetto(events, args.perfetto)
        print(f"wrote {args.perfetto} ({len(events)} events): open in https://ui.perfetto.dev", file=out)
    tls = [t for t in T.timelines(events) if "router.http_request" in t.marks
           and (only is None or t.transfer_id in only)]
    if args.spans:
        for t in tls:
            print(T.span_listing(t), file=out)
    if args.breakdown:
        print(T.breakdown_table(tls) if tls else "no request seen", file=out)
        for t in tls:
            bad = T.problems(t) if t.complete else ["incomplete (still running when the tap stopped?)"]
            if bad:
                print(f"  {t.transfer_id[:8]}: {'; '.join(bad)}", file=out)


def run(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    if args.replay:
        with open(args.replay, "rb") as f:
            events = msgspec.msgpack.decode(f.read(), type=list[m.TraceEvent])
        filt = Filter(args.tid, args.process, args.kind)
        if not args.quiet and events:
            t0 = events[0].t_mono
            for ev in events:
                if filt(ev):
                    print(format_event(ev, t0), file=out)
        report(events, args, out)
        return 0
    rec: Optional[registry.DeploymentRecord] = None  # found through the registry: the tap ends when it stops
    try:
        if args.bind:
            endpoint, bind = args.bind, True
        elif args.endpoint:
            endpoint, bind = args.endpoint, False
            if len(endpoint) > 1 and not args.quiet:
                print("pushkv tap: the live log shows each host on its own clock; --perfetto/--breakdown/--spans "
                      "are aligned", file=sys.stderr)
        else:
            endpoint, rec = find_endpoint(args.id)
            bind = False
            if rec.trace_tap_secured and not args.secret_file:  # CURVE would refuse us without a word
                raise TapError(f"deployment {rec.deployment_id}'s tap end {endpoint} is under CURVE: give "
                               "--secret-file FILE, the deployment's secret")
            print(f"tapping deployment {rec.deployment_id} ({rec.mode}) at {endpoint}", file=sys.stderr)
    except TapError as e:
        print(f"pushkv tap: {e}", file=sys.stderr)
        return 1
    stop = {"flag": False}
    signal.signal(signal.SIGINT, lambda *a: stop.update(flag=True))
    signal.signal(signal.SIGTERM, lambda *a: stop.update(flag=True))
    filt = Filter(args.tid, args.process, args.kind)
    events: list[m.TraceEvent] = []
    done: dict[str, None] = {}  # finished requests, in the order they finished
    t_start = time.monotonic()
    next_alive_check = t_start + ALIVE_CHECK_S
    t0: Optional[float] = None
    linger_until: Optional[float] = None
    held: list[tuple[float, int, m.TraceEvent]] = []  # live log reorder buffer

    def show(upto: float) -> None:
        while held and held[0][0] <= upto:
            ev = heapq.heappop(held)[2]
            print(format_event(ev, t0), file=out, flush=True)

    with Tap(endpoint, bind, secure=security.load(args.secret_file)) as tap:
        while not stop["flag"]:
            now = time.monotonic()
            if args.duration and now - t_start >= args.duration:
                break
            if linger_until is not None and now >= linger_until:
                break
            if rec is not None and linger_until is None and now >= next_alive_check:
                next_alive_check = now + ALIVE_CHECK_S
                if not deployments.supervisor_alive(rec):  # nothing more will come: what is queued here, then end
                    print(f"pushkv tap: deployment {rec.deployment_id} stopped", file=sys.stderr, flush=True)
                    linger_until = now + LINGER_S
            for ev in tap.poll(50):
                events.append(ev)
                if t0 is None:
                    t0 = ev.t_mono
                    print(f"receiving events ({time.monotonic() - t_start:.2f} s after attaching)",
                          file=sys.stderr, flush=True)
                if not args.quiet and filt(ev):
                    heapq.heappush(held, (ev.t_mono, len(events), ev))
                if ev.kind == "http_done" and (not args.tid or filt(ev)):
                    done.setdefault(ev.transfer_id)
            if events:
                show(events[-1].t_mono - REORDER_S)
            if args.requests and len(done) >= args.requests and linger_until is None:
                linger_until = time.monotonic() + LINGER_S
        show(float("inf"))
        if tap.undecodable:
            print(f"pushkv tap: {tap.undecodable} undecodable frame(s)", file=sys.stderr)
    if args.record:
        write_private(args.record, msgspec.msgpack.encode(events))
    report(events, args, out, only=list(done)[:args.requests] if args.requests else None)
    return 0


def write_private(path: str, data: bytes) -> None:
    """``data`` into ``path``, readable by its owner alone (a record holds the mirrored messages: prompts' token
    ids), also where the file was there before with a wider mode."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
