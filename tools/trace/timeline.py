"""Trace events -> per-request timelines, spans, stage breakdowns and a
Chrome/Perfetto trace. Pure: no sockets, no clock reads (tools/trace/tap.py feeds it).

Every ``TraceEvent`` carries the process's CLOCK_MONOTONIC time, which Linux
shares between the processes of one host, so events of different processes
order by ``t_mono`` directly.

A request (one ``transfer_id``) is described by *marks*, named instants such
as ``prefill.prefill_end`` or ``decode-writer.kv_received`` (lane prefix +
event; over several TP ranks the earliest start and the latest end), and by
*spans* on lanes, one lane per pushkv process.
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional

import msgspec

from pushkv import messages as m

# -- decoding payloads with the project's schema ---------------------------------------


def _message_types() -> dict[str, type]:
    out: dict[str, type] = {}
    todo = [m.Msg]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            out[sub.__name__] = sub
            todo.append(sub)
    return out


_DECODERS: dict[str, msgspec.msgpack.Decoder] = {}


def decode_payload(ev: m.TraceEvent) -> Optional[m.Msg]:
    """The message an event mirrors, decoded with its own type; None for local events."""
    if not ev.payload:
        return None
    dec = _DECODERS.get(ev.kind)
    if dec is None:
        types = _message_types()
        if ev.kind not in types:
            return None
        dec = _DECODERS[ev.kind] = msgspec.msgpack.Decoder(types[ev.kind])
    try:
        return dec.decode(ev.payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _short(v, depth: int = 0):
    if isinstance(v, (bytes, bytearray)):
        return f"<{len(v)} B>"
    if isinstance(v, msgspec.Struct):
        if depth >= 1:
            return f"<{type(v).__name__}>"
        return {k: _short(x, depth + 1) for k, x in msgspec.structs.asdict(v).items()}
    if isinstance(v, (tuple, list)):
        if len(v) > 6:
            return f"[{len(v)} items]"
        return [_short(x, depth + 1) for x in v]
    if isinstance(v, float):
        return round(v, 6)
    return v


def summarize(msg: Optional[m.Msg]) -> str:
    """``field=value`` for a log line: long sequences counted, bytes sized."""
    if msg is None:
        return ""
    parts = []
    for k, v in msgspec.structs.asdict(msg).items():
        if k in ("transfer_id", "timeline") or v in ((), {}, None, "", b""):
            continue
        parts.append(f"{k}={_short(v)}")
    return " ".join(parts)


# -- one request ---------------------------------------------------------------------


@dataclass
class Span:
    lane: str  # pushkv process name
    name: str
    start: float  # t_mono
    end: float
    args: dict = field(default_factory=dict)

    @property
    def dur(self) -> float:
        return self.end - self.start


def _lane(process: str) -> str:
    """``prefill-writer-1`` -> ``prefill-writer``; schedulers: ``prefill``; router: ``router``;
    a host suffix (``decode-writer-0@10.0.0.2``, from tools/trace/merge.py) is dropped."""
    process = process.split("@", 1)[0]
    if process.endswith("-scheduler"):
        return process[: -len("-scheduler")]
    parts = process.rsplit("-", 1)
    return parts[0] if len(parts) == 2 and parts[1].isdigit() else process


def _parse_size(detail: str) -> tuple[int, int]:
    """``"8192B/1d"`` (write_posted / read_posted detail) -> (bytes, descriptors)."""
    try:
        b, d = detail.split("/")
        return int(b.rstrip("B")), int(d.rstrip("d"))
    except ValueError:
        return 0, 0


class RequestTimeline:
    def __init__(self, transfer_id: str, events: Iterable[m.TraceEvent]):
        self.transfer_id = transfer_id
        self.events = sorted(events, key=lambda e: e.t_mono)
        procs = {e.process for e in self.events}
        if any(p.startswith("local-") for p in procs):
            self.mode = "local"
        elif (not any(p.startswith("prefill-") for p in procs)
              and any(e.kind == "prefill_start" and e.process.startswith("decode-") for e in self.events)):
            self.mode = "decode-local"  # --conditional-disagg: D prefilled the prompt itself, nothing moved
        elif any(e.kind in ("read_posted", "HoldKV", "ReadKV") for e in self.events):
            self.mode = "pull"
        else:
            self.mode = "push"
        self.token_leg = "local" if self.mode == "local" else "decode"
        # the leg that computed the prompt: one instance alone (local, decode-local), or P
        self.computing = self.token_leg if self.mode in ("local", "decode-local") else "prefill"
        # how the KV moved: P WRITEs in push and in pull with --pull-read write, D READs otherwise
        self.transport = ("" if self.computing != "prefill" else
                          "WRITE" if any(e.kind == "write_posted" for e in self.events) or self.mode == "push"
                          else "READ")
        self.variant = "pull-write" if self.mode == "pull" and self.transport == "WRITE" else self.mode
        self.marks = self._marks()
        self.spans = self._spans()
        self.info = self._info()

    # -- lookups ------------------------------------------------------------
    def find(self, process: str = "", direction: str = "", kind: str = "", peer: str = "") -> list[m.TraceEvent]:
        """Events whose process starts with ``process`` (and equal direction/kind/peer when given)."""
        return [e for e in self.events
                if e.process.startswith(process) and (not direction or e.direction == direction)
                and (not kind or e.kind == kind) and (not peer or e.peer == peer)]

    def at(self, process: str, direction: str, kind: str, nth: int = 0, last: bool = False,
           peer: str = "") -> Optional[float]:
        evs = self.find(process, direction, kind, peer)
        if not evs or nth >= len(evs):
            return None
        return evs[-1].t_mono if last else evs[nth].t_mono

    def processes(self, prefix: str) -> list[str]:
        return sorted({e.process for e in self.events if e.process.startswith(prefix)})

    # -- marks ------------------------------------------------------------------
    def _marks(self) -> dict[str, float]:
        mk: dict[str, float] = {}

        def put(name: str, t: Optional[float]) -> None:
            if t is not None:
                mk[name] = t

        for e in self.events:  # every local event, earliest (ends below take the latest)
            if e.direction == "event":
                mk.setdefault(f"{_lane(e.process)}.{e.kind}", e.t_mono)
        for name in ("prefill-writer.write_done", "decode-writer.kv_received", "decode-writer.read_done"):
            lane, kind = name.split(".")
            evs = [e.t_mono for e in self.find(lane, "event", kind)]
            if evs:
                mk[name] = max(evs)  # every rank done
        leg = self.token_leg
        toks = self.find(f"{leg}-scheduler", "send", "TokensGenerated")
        put(f"{leg}.first_token_sent", toks[0].t_mono if toks else None)
        put(f"{leg}.first_decode_step", toks[1].t_mono if len(toks) > 1 else None)
        put("router.first_token", self.at("router", "recv", "TokensGenerated", peer=f"{leg}-scheduler"))
        put("router.send_prefill", self.at("router", "send", "Generate", peer="prefill-scheduler"))
        put("router.send_decode", self.at("router", "send", "Generate", peer=f"{leg}-scheduler"))
        put("router.prefill_finished", self.at("router", "recv", "PrefillFinished"))
        put("prefill-writer.recv_sendkv", self.at("prefill-writer", "recv", "SendKV"))
        put("prefill-writer.recv_register", self.at("prefill-writer", "recv", "Register"))
        put("prefill-writer.recv_holdkv", self.at("prefill-writer", "recv", "HoldKV"))
        put("prefill-writer.recv_readdone", self.at("prefill-writer", "recv", "ReadDone", last=True))
        put("prefill.recv_kvsent", self.at("prefill-scheduler", "recv", "KVSent", last=True))
        put("decode-writer.recv_expectkv", self.at("decode-writer", "recv", "ExpectKV"))
        put("decode-writer.send_register", self.at("decode-writer", "send", "Register"))
        put("decode-writer.recv_readkv", self.at("decode-writer", "recv", "ReadKV"))
        put("decode-writer.recv_writedone", self.at("decode-writer", "recv", "WriteDone", last=True))
        return mk

    # -- spans -------------------------------------------------------------------
    def _spans(self) -> list[Span]:
        out: list[Span] = []
        mk = self.marks

        def span(lane: str, name: str, a: Optional[float], b: Optional[float], **args) -> None:
            if a is not None and b is not None and b >= a:
                out.append(Span(lane, name, a, b, args))

        def ev(process: str, kind: str, last: bool = False) -> Optional[float]:
            return self.at(process, "event", kind, last=last)

        span("router", "request", ev("router", "http_request"), ev("router", "http_done"))
        span("router", "TTFT", ev("router", "http_request"), mk.get("router.first_token"))
        if self.mode == "pull":
            span("router", "relay", mk.get("router.prefill_finished"), mk.get("router.send_decode"))
        first = self.computing
        p = f"{first}-scheduler"
        span(p, "queued", ev(p, f"{first}_queued"), ev(p, "prefill_start"))
        span(p, "prefill", ev(p, "prefill_start"), ev(p, "prefill_end"))
        if self.mode == "push":
            span(p, "KV send (writer)", ev(p, "send_kv"), ev(p, "kv_sent"))
        elif self.mode == "pull":
            span(p, "blocks leased", ev(p, "prefill_end"), mk.get("prefill.recv_kvsent"))
        for w in self.processes("prefill-writer"):
            if self.transport == "WRITE":
                sent = self._kv_sent(w)
                ready = self._prefill_ready(w, sent)
                reg = self.at(w, "recv", "Register")
                if ready is not None and reg is not None:
                    said = sent[1].rendezvous if sent else ""  # the writer's own order, where its KVSent is traced
                    order = said if said in ("registration_first", "prefill_first") else (
                        "registration_first" if reg < ready else "prefill_first")
                    name = "wait for prefill" if order == "registration_first" else "wait for registration"
                    span(w, name, min(reg, ready), max(reg, ready), order=order)
                posted = self.find(w, "event", "write_posted")
                nb, nd = _parse_size(posted[0].peer) if posted else (0, 0)
                span(w, "WRITE", ev(w, "write_posted"), ev(w, "write_done"), bytes=nb, descriptors=nd)
                parts = [_parse_size(e.peer) for e in self.find(w, "event", "part_posted")]
                if parts:  # streamed push: parts left while P computed, the last WRITE carries the rest
                    span(w, "parts", ev(w, "part_posted"), ev(w, "write_posted"), bytes=sum(b for b, _ in parts),
                         descriptors=sum(d for _, d in parts), count=len(parts))
            else:
                span(w, "lease", self.at(w, "recv", "HoldKV"), self.at(w, "recv", "ReadDone", last=True))
        if first == "prefill":
            d = "decode-scheduler"
            span(d, "queued", ev(d, "decode_queued"), ev(d, "decode_alloc"))
            start = ev(d, "registration_sent") if self.mode == "push" else ev(d, "read_posted")
            span(d, "await KV", start, ev(d, "kv_received"))
            span(d, "decode", ev(d, "kv_received"), ev(d, "finished"))
            span(d, "first decode step", ev(d, "kv_received"), mk.get("decode.first_decode_step"))
            for w in self.processes("decode-writer"):
                if self.transport == "WRITE":
                    span(w, "registration", self.at(w, "recv", "ExpectKV" if self.mode == "push" else "ReadKV"),
                         ev(w, "registration_sent"))
                    span(w, "KV wait", ev(w, "registration_sent"), ev(w, "kv_received"))
                else:
                    posted = self.find(w, "event", "read_posted")
                    nb, nd = _parse_size(posted[0].peer) if posted else (0, 0)
                    span(w, "READ", ev(w, "read_posted"), ev(w, "read_done"), bytes=nb, descriptors=nd)
        else:
            span(p, "decode", ev(p, "prefill_end"), ev(p, "finished"))
            span(p, "first decode step", mk.get(f"{first}.first_token_sent"), mk.get(f"{first}.first_decode_step"))
        return out

    def _kv_sent(self, writer: str) -> Optional[tuple[m.TraceEvent, m.KVSent]]:
        """The writer's KVSent to its scheduler (its send event and message), if traced."""
        for e in self.find(writer, "send", "KVSent"):
            msg = decode_payload(e)
            if isinstance(msg, m.KVSent):
                return e, msg
        return None

    def _prefill_ready(self, writer: str, sent: Optional[tuple[m.TraceEvent, m.KVSent]]) -> Optional[float]:
        """When the prefill half reached the writer: its SendKV (HoldKV in pull), or, streaming, the first
        progress (a chunk's StreamKV or a stored layer group, from the writer's ``stream_progress`` stage on its
        wall clock, moved to the monotonic one through the ``sent`` KVSent event's pair of stamps)."""
        times = [t for t in (self.at(writer, "recv", "SendKV" if self.mode == "push" else "HoldKV"),
                             self.at(writer, "recv", "StreamKV")) if t is not None]
        if sent is not None:
            e, msg = sent
            times += [wall - e.t_wall + e.t_mono for stage, wall in msg.timeline if stage == "stream_progress"]
        return min(times) if times else None

    # -- summary -----------------------------------------------------------------
    def _info(self) -> dict:
        info: dict = {"mode": self.variant}
        waits = [s for s in self.spans if s.name.startswith("wait for")]
        if waits:
            info["rendezvous"] = waits[0].args["order"]
        moves = [s for s in self.spans if s.name in ("WRITE", "READ", "parts")]
        if moves:
            info["bytes"] = sum(s.args.get("bytes", 0) for s in moves)
            info["descriptors"] = sum(s.args.get("descriptors", 0) for s in moves)
        done = self.find("router", "event", "http_done")
        if done:
            info["outcome"] = done[0].peer
        return info

    @property
    def complete(self) -> bool:
        """The router answered and every leg reported its end."""
        mk = self.marks
        if "router.http_done" not in mk:
            return False
        if self.mode == "push":
            return "prefill.kv_sent" in mk
        if self.mode == "pull":
            return "prefill.recv_kvsent" in mk
        return True  # local, decode-local: the one leg's end is the router's

    def stages(self) -> dict[str, float]:
        """Seconds per stage: queue, prefill compute, relay (prefill end -> transfer
        posted), transfer (posted -> D has the KV), first decode step; TTFT, e2e."""
        mk = self.marks
        first = self.computing
        t_req = mk.get("router.http_request")
        posted = mk.get("prefill-writer.write_posted" if self.transport == "WRITE" else "decode-writer.read_posted")
        have = mk.get("decode.kv_received")
        if posted is not None and have is not None and posted > have:
            # write_posted is stamped when the post call returns: a layer-streamed push's last WRITE
            # is small, and D may have it (and its notification) before the call is back
            posted = have
        pairs = {
            "queue": (t_req, mk.get(f"{first}.prefill_start")),
            "prefill": (mk.get(f"{first}.prefill_start"), mk.get(f"{first}.prefill_end")),
            "relay": (mk.get(f"{first}.prefill_end"), posted),
            "transfer": (posted, have),
            "first_decode_step": ((have if first == "prefill" else mk.get(f"{first}.first_token_sent")),
                                  mk.get(f"{self.token_leg}.first_decode_step")),
            "ttft": (t_req, mk.get("router.first_token")),
            "e2e": (t_req, mk.get("router.http_done")),
        }
        if self.transport == "WRITE":
            w = [s for s in self.spans if s.name.startswith("wait for")]
            if w:
                pairs["rendezvous_wait"] = (w[0].start, w[0].end)
            pairs["write"] = (posted, mk.get("prefill-writer.write_done"))
        elif self.transport == "READ":
            pairs["read"] = (posted, mk.get("decode-writer.read_done"))
        return {k: b - a for k, (a, b) in pairs.items() if a is not None and b is not None}


# -- what a complete, ordered request looks like -------------------------------------------
EXPECTED_SPANS = {
    "push": {("router", "request"), ("router", "TTFT"), ("prefill-scheduler", "queued"),
             ("prefill-scheduler", "prefill"), ("prefill-scheduler", "KV send (writer)"),
             ("prefill-writer", "wait for *"), ("prefill-writer", "WRITE"), ("decode-scheduler", "queued"),
             ("decode-scheduler", "await KV"), ("decode-scheduler", "decode"),
             ("decode-writer", "registration"), ("decode-writer", "KV wait")},
    "pull": {("router", "request"), ("router", "TTFT"), ("router", "relay"), ("prefill-scheduler", "queued"),
             ("prefill-scheduler", "prefill"), ("prefill-scheduler", "blocks leased"), ("prefill-writer", "lease"),
             ("decode-scheduler", "queued"), ("decode-scheduler", "await KV"), ("decode-scheduler", "decode"),
             ("decode-writer", "READ")},
    "pull-write": {("router", "request"), ("router", "TTFT"), ("router", "relay"), ("prefill-scheduler", "queued"),
                   ("prefill-scheduler", "prefill"), ("prefill-scheduler", "blocks leased"),
                   ("prefill-writer", "wait for *"), ("prefill-writer", "WRITE"), ("decode-scheduler", "queued"),
                   ("decode-scheduler", "await KV"), ("decode-scheduler", "decode"), ("decode-writer", "registration"),
                   ("decode-writer", "KV wait")},
    "local": {("router", "request"), ("router", "TTFT"), ("local-scheduler", "queued"),
              ("local-scheduler", "prefill"), ("local-scheduler", "decode")},
    "decode-local": {("router", "request"), ("router", "TTFT"), ("decode-scheduler", "queued"),
                     ("decode-scheduler", "prefill"), ("decode-scheduler", "decode")},
}
# each chain must be non-decreasing in time
ORDER = {
    "push": [
        ["router.http_request", "router.send_prefill", "prefill.prefill_queued", "prefill.prefill_start",
         "prefill.prefill_end", "prefill-writer.recv_sendkv", "prefill-writer.write_posted",
         "prefill-writer.write_done", "prefill.kv_sent", "router.http_done"],
        ["router.send_decode", "decode.decode_queued", "decode.decode_alloc", "decode-writer.recv_expectkv",
         "decode-writer.send_register", "prefill-writer.recv_register", "prefill-writer.write_posted"],
        # D may hear WriteDone before P's post call returns (on CPU, UCX copies inside the post):
        # what must precede it is what P needed to post, not the post's return
        ["prefill-writer.recv_sendkv", "decode-writer.recv_writedone", "decode-writer.kv_received",
         "decode.kv_received", "router.first_token", "router.http_done"],
        ["prefill-writer.recv_register", "decode-writer.recv_writedone"],
        ["decode.kv_received", "decode.first_decode_step", "router.http_done"],
    ],
    "pull": [
        ["router.http_request", "router.send_prefill", "prefill.prefill_queued", "prefill.prefill_start",
         "prefill.prefill_end", "prefill-writer.recv_holdkv", "prefill-writer.recv_readdone",
         "prefill.recv_kvsent"],
        ["prefill.prefill_end", "router.prefill_finished", "router.send_decode", "decode.decode_queued",
         "decode.decode_alloc", "decode-writer.recv_readkv", "decode-writer.read_posted", "decode-writer.read_done",
         "prefill-writer.recv_readdone"],
        ["decode-writer.read_done", "decode.kv_received", "router.first_token", "router.http_done"],
        ["decode.kv_received", "decode.first_decode_step", "router.http_done"],
    ],
    "pull-write": [
        ["router.http_request", "router.send_prefill", "prefill.prefill_queued", "prefill.prefill_start",
         "prefill.prefill_end", "prefill-writer.recv_holdkv", "prefill-writer.write_posted",
         "prefill-writer.write_done", "prefill.recv_kvsent"],
        ["prefill.prefill_end", "router.prefill_finished", "router.send_decode", "decode.decode_queued",
         "decode.decode_alloc", "decode-writer.recv_readkv", "decode-writer.send_register",
         "prefill-writer.recv_register", "prefill-writer.write_posted"],
        ["prefill-writer.recv_holdkv", "decode-writer.recv_writedone", "decode-writer.kv_received",
         "decode.kv_received", "router.first_token", "router.http_done"],
        ["prefill-writer.recv_register", "decode-writer.recv_writedone"],
        ["decode.kv_received", "decode.first_decode_step", "router.http_done"],
    ],
    "local": [
        ["router.http_request", "local.local_queued", "local.prefill_start", "local.prefill_end",
         "local.first_token_sent", "router.first_token", "router.http_done"],
        ["local.first_token_sent", "local.first_decode_step", "router.http_done"],
    ],
    "decode-local": [
        ["router.http_request", "router.send_decode", "decode.decode_queued", "decode.prefill_start",
         "decode.prefill_end", "decode.first_token_sent", "router.first_token", "router.http_done"],
        ["decode.first_token_sent", "decode.first_decode_step", "router.http_done"],
    ],
}


def problems(rt: RequestTimeline, decode_steps: bool = True) -> list[str]:
    """What is missing or out of order in a finished request's trace (empty: complete and ordered)."""
    out = []
    have = {(s.lane, s.name) for s in rt.spans}
    for lane, name in sorted(EXPECTED_SPANS[rt.variant]):
        ok = any(h_lane.startswith(lane) and (h_name == name or (name.endswith("*") and h_name.startswith(name[:-1])))
                 for h_lane, h_name in have)
        if not ok:
            out.append(f"missing span {lane}/{name}")
    mk = rt.marks
    for chain in ORDER[rt.variant]:
        names = [n for n in chain if decode_steps or not n.endswith("first_decode_step")]
        for a, b in zip(names, names[1:]):
            if a not in mk or b not in mk:
                out.append(f"missing mark {a if a not in mk else b}")
            elif mk[b] < mk[a]:
                out.append(f"{b} ({(mk[b] - mk[a]) * 1e3:+.3f} ms) before {a}")
    return sorted(set(out))


# -- many requests --------------------------------------------------------------------------


def by_request(events: Iterable[m.TraceEvent]) -> dict[str, list[m.TraceEvent]]:
    out: dict[str, list[m.TraceEvent]] = defaultdict(list)
    for e in events:
        if e.transfer_id:
            out[e.transfer_id].append(e)
    return out


def timelines(events: Iterable[m.TraceEvent]) -> list[RequestTimeline]:
    """One timeline per transfer id, in order of the request's first event."""
    tls = [RequestTimeline(tid, evs) for tid, evs in by_request(events).items()]
    return sorted(tls, key=lambda t: t.events[0].t_mono)


BREAKDOWN_COLS = ("queue", "prefill", "relay", "transfer", "first_decode_step", "ttft", "e2e")


def breakdown_table(tls: list[RequestTimeline]) -> str:
    """Per-request stage breakdown in ms, and the median row."""
    stages = ("queue", "prefill", "relay", "transfer", "1st step", "TTFT", "e2e")
    head = f"{'request':<10} {'mode':<12} " + " ".join(f"{c:>10}" for c in stages)
    head += "  rendezvous           bytes   descs"
    lines = [head]
    cols: dict[str, list[float]] = defaultdict(list)
    for t in tls:
        st = t.stages()
        for c in BREAKDOWN_COLS:
            if c in st:
                cols[c].append(st[c])
        cells = " ".join(f"{st[c] * 1e3:10.2f}" if c in st else f"{'-':>10}" for c in BREAKDOWN_COLS)
        lines.append(f"{t.transfer_id[:8]:<10} {t.variant:<12} {cells}  {t.info.get('rendezvous', '-'):<18} "
                     f"{t.info.get('bytes', 0):>8} {t.info.get('descriptors', 0):>7}")
    if len(tls) > 1:
        cells = " ".join(f"{statistics.median(cols[c]) * 1e3:10.2f}" if cols[c] else f"{'-':>10}"
                         for c in BREAKDOWN_COLS)
        lines.append(f"{'median':<10} {'':<12} {cells}")
    return "\n".join(lines)


def span_listing(tl: RequestTimeline) -> str:
    """A request's spans as text, in start order: offset from its first event, duration, lane, name."""
    t0 = tl.events[0].t_mono
    st = tl.stages()
    head = f"request {tl.transfer_id[:8]} ({tl.variant}"
    head += f", TTFT {st['ttft'] * 1e3:.2f} ms)" if "ttft" in st else ")"
    lines = [head]
    for s in sorted(tl.spans, key=lambda s: (s.start, -s.dur)):
        args = " ".join(f"{k}={v}" for k, v in s.args.items())
        lines.append(f"  {(s.start - t0) * 1e3:+10.3f} ms {s.dur * 1e3:9.3f} ms  {s.lane:<18} {s.name:<22} {args}")
    return "\n".join(lines)


# -- Chrome / Perfetto trace JSON --------------------------------------------------------------
LANE_ORDER = ("router", "prefill-scheduler", "prefill-writer", "prefill-worker", "local-scheduler",
              "local-writer", "local-worker", "decode-scheduler", "decode-writer", "decode-worker")


def _lane_rank(process: str) -> tuple[int, str]:
    for i, p in enumerate(LANE_ORDER):
        if process.startswith(p):
            return i, process
    return len(LANE_ORDER), process


def perfetto(events: list[m.TraceEvent]) -> dict:
    """Chrome trace JSON (chrome://tracing, ui.perfetto.dev): one track group per
    request with a lane per pushkv process (spans, message instants, flow arrows
    from each send to its recv), plus a group of engine steps per worker."""
    events = sorted(events, key=lambda e: e.t_mono)
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = events[0].t_mono
    us = lambda t: round((t - t0) * 1e6, 3)  # noqa: E731
    out: list[dict] = []
    flow_id = 0
    for pid, tl in enumerate(timelines(events), start=1):
        st = tl.stages()
        title = f"request {tl.transfer_id[:8]} ({tl.variant}"
        title += f", TTFT {st['ttft'] * 1e3:.1f} ms)" if "ttft" in st else ")"
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": title}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        procs = sorted({e.process for e in tl.events}, key=_lane_rank)
        tid_of = {p: i + 1 for i, p in enumerate(procs)}
        for p, tid in tid_of.items():
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": p}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for s in sorted(tl.spans, key=lambda s: (s.start, -s.dur)):
            out.append({"name": s.name, "cat": "stage", "ph": "X", "pid": pid, "tid": tid_of[s.lane],
                        "ts": us(s.start), "dur": round(s.dur * 1e6, 3),
                        "args": {**s.args, "ms": round(s.dur * 1e3, 3)}})
        pending: dict[str, list[tuple[m.TraceEvent, int]]] = defaultdict(list)
        for e in tl.events:
            tid = tid_of[e.process]
            if e.direction == "event":
                out.append({"name": e.kind, "cat": "event", "ph": "i", "s": "t", "pid": pid, "tid": tid,
                            "ts": us(e.t_mono), "args": {"detail": e.peer} if e.peer else {}})
                continue
            arrow = "->" if e.direction == "send" else "<-"
            args = {"peer": e.peer, "message": summarize(decode_payload(e))}
            # a zero-length slice, not an instant: flow arrows bind to the slice enclosing their end
            out.append({"name": f"{e.direction} {e.kind} {arrow} {e.peer}", "cat": "message", "ph": "X", "dur": 0,
                        "pid": pid, "tid": tid, "ts": us(e.t_mono), "args": args})
            if e.direction == "send":
                flow_id += 1
                pending[e.kind].append((e, flow_id))
                out.append({"name": e.kind, "cat": "flow", "ph": "s", "id": flow_id, "pid": pid, "tid": tid,
                            "ts": us(e.t_mono)})
            else:
                q = [x for x in pending[e.kind] if x[0].process != e.process]
                if q:
                    snd, fid = q[0]
                    pending[e.kind].remove(q[0])
                    out.append({"name": e.kind, "cat": "flow", "ph": "f", "bp": "e", "id": fid, "pid": pid,
                                "tid": tid, "ts": us(max(e.t_mono, snd.t_mono))})
    out.extend(_engine_steps(events, us))
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"source": "pushkv tap", "clock": "CLOCK_MONOTONIC", "t0_mono": t0}}


def _engine_steps(events: list[m.TraceEvent], us) -> list[dict]:
    """Worker forward steps (batch-level, no transfer id): ExecuteStep recv -> StepDone send."""
    pid = 0
    out: list[dict] = []
    started: dict[tuple[str, int], tuple[float, int, int]] = {}
    workers = sorted({e.process for e in events if "-worker-" in e.process}, key=_lane_rank)
    if not workers:
        return out
    out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": "engine steps"}})
    out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": -1}})
    tid_of = {w: i + 1 for i, w in enumerate(workers)}
    for w, tid in tid_of.items():
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": w}})
    for e in events:
        if e.process not in tid_of or e.kind not in ("ExecuteStep", "StepDone", "StepFailed"):
            continue
        msg = decode_payload(e)
        if msg is None:
            continue
        if e.direction == "recv" and e.kind == "ExecuteStep":
            prefill = sum(1 for s in msg.seqs if s.start_pos == 0)
            started[(e.process, msg.step_id)] = (e.t_mono, len(msg.seqs), prefill)
        elif e.direction == "send" and (e.process, msg.step_id) in started:
            t, n, pf = started.pop((e.process, msg.step_id))
            out.append({"name": f"step {msg.step_id}: {n} seq ({pf} prefill)", "cat": "step", "ph": "X",
                        "pid": pid, "tid": tid_of[e.process], "ts": us(t), "dur": round((e.t_mono - t) * 1e6, 3),
                        "args": {"seqs": n, "prefills": pf,
                                 "compute_ms": round(getattr(msg, "compute_s", 0) * 1e3, 3)}})
    return out


def write_perfetto(events: list[m.TraceEvent], path: str) -> None:
    with open(path, "w") as f:
        json.dump(perfetto(events), f)
