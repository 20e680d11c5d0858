"""Traces of several hosts on one clock (pure: no sockets).

Every trace event carries its process's ``CLOCK_MONOTONIC`` (``t_mono``) and the host it
came from (``TraceEvent.host``, the supervisor's advertised address). On one host all
processes share that clock; across hosts the clocks are unrelated (different boots), and
wall clocks may disagree by more than a transfer takes. So the merge takes each host's
offset from the trace itself, the way NTP does from its packets: every message mirrored
twice, as a ``send`` on one host and a ``recv`` on another (same type, same transfer id,
same bytes), bounds the receiver's offset from the sender's by the one-way delay. With
messages both ways between hosts A and B,

    offset(B) - offset(A) ~= (min d(A->B) - min d(B->A)) / 2,   d(X->Y) = t_recv(Y) - t_send(X),

exact when the quickest messages each way took equal time; its error is at most half the
smaller of the two quickest round trips (reported per host). Hosts linked only through
others get the sum along a path; the router's host (or the first host seen) is 0. A host
with no message to or from the rest keeps offset 0 and is reported unaligned.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Iterable, Optional

import msgspec

from pushkv import messages as m


@dataclass
class Alignment:
    offsets: dict[str, float]  # host -> seconds to add to its t_mono
    error_s: dict[str, float]  # host -> bound on the offset's error (0 for the reference)
    reference: str
    unaligned: list[str]


def _pairs(events: Iterable[m.TraceEvent]) -> dict[tuple[str, str], list[float]]:
    """(sender host, receiver host) -> one-way delays on the raw clocks, from messages seen
    exactly once as a send and once as a receive on different hosts."""
    sends: dict[tuple, list[m.TraceEvent]] = defaultdict(list)
    recvs: dict[tuple, list[m.TraceEvent]] = defaultdict(list)
    for e in events:
        if e.direction not in ("send", "recv") or not e.transfer_id or not e.payload:
            continue
        (sends if e.direction == "send" else recvs)[(e.kind, e.transfer_id, e.payload)].append(e)
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for key, ss in sends.items():
        rs = recvs.get(key, [])
        if len(ss) == 1 and len(rs) == 1 and ss[0].host != rs[0].host:
            out[(ss[0].host, rs[0].host)].append(rs[0].t_mono - ss[0].t_mono)
    return out


def align(events: list[m.TraceEvent], reference: Optional[str] = None) -> Alignment:
    hosts = list(dict.fromkeys(e.host for e in events))
    if reference is None:  # the router's host, else the first seen
        reference = next((e.host for e in events if e.process == "router"), hosts[0] if hosts else "")
    delays = _pairs(events)
    edges: dict[str, list[tuple[str, float, float]]] = defaultdict(list)  # a -> (b, off(b)-off(a), err)
    for (a, b), ab in delays.items():
        ba = delays.get((b, a))
        if not ba or a > b:
            continue  # need both ways; each unordered pair once
        lo_ab, lo_ba = min(ab), min(ba)
        diff = (lo_ab - lo_ba) / 2  # raw(b) - raw(a) + latency asymmetry / 2
        err = (lo_ab + lo_ba) / 2  # half the quickest round trip
        edges[a].append((b, -diff, err))
        edges[b].append((a, diff, err))
    offsets, errors = {reference: 0.0}, {reference: 0.0}
    todo = deque([reference])
    while todo:  # breadth first: fewest hops, so the least accumulated error
        a = todo.popleft()
        for b, d, err in edges[a]:
            if b not in offsets:
                offsets[b] = offsets[a] + d
                errors[b] = errors[a] + err
                todo.append(b)
    unaligned = [h for h in hosts if h not in offsets]
    for h in unaligned:
        offsets[h], errors[h] = 0.0, float("inf")
    return Alignment(offsets, errors, reference, unaligned)


def merged(events: list[m.TraceEvent], reference: Optional[str] = None) -> tuple[list[m.TraceEvent], Alignment]:
    """The events on the reference host's clock, in time order. With more than one host,
    process names gain ``@host`` so that the same process name on two hosts stays two lanes."""
    al = align(events, reference)
    several = len(al.offsets) > 1
    out = [msgspec.structs.replace(e, t_mono=e.t_mono + al.offsets[e.host],
                                   process=f"{e.process}@{e.host}" if several and e.host else e.process)
           for e in events]
    out.sort(key=lambda e: e.t_mono)
    return out, al


def describe(al: Alignment) -> str:
    rows = [f"  {h or '(no host)'}: {al.offsets[h] * 1e3:+.3f} ms (+- {al.error_s[h] * 1e3:.3f} ms)"
            for h in al.offsets if h not in al.unaligned]
    rows += [f"  {h}: not aligned (no message both ways with another host)" for h in al.unaligned]
    return f"clocks aligned on {al.reference or '(no host)'}:\n" + "\n".join(rows)
