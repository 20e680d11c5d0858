"""What a hostile local peer (same uid: past the run dir's mode) can do to a default push
deployment's P writer, measured: a wake hint naming 2**62 bytes (P writer CPU seconds over a 5 s
window), 64 frames of just under 4 MiB sent as one message (P writer RSS growth), and a Hello that
names D's engine id (what it is answered, then the status of the requests after it).

    python tools/hostile_peer.py [--model small]

Prints one JSON object. Starts and stops its own deployment (tools.launch).
"""
from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request

import zmq

from pushkv import messages as m
from pushkv.config import model_fingerprint
from pushkv.kv import layout as L
from pushkv.supervisor.commands import ask
from pushkv.supervisor.lifecycle import read_cpu_seconds
from pushkv.transport.nixl_agent import NixlAgent
from tools.launch import launched

WINDOW_S = 5.0
FRAME_BYTES = (4 << 20) - 4096  # each under the 4 MiB per-frame cap of a handshake socket


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def complete(url: str) -> int:
    req = urllib.request.Request(url + "/v1/completions", headers={"content-type": "application/json"},
                                 data=json.dumps({"prompt": [1, 2, 3, 4, 5], "max_tokens": 4}).encode())
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    args = ap.parse_args()
    out: dict = {}
    with launched("--mode", "push", "--model", args.model, "--num-blocks", "256") as dep:
        cfg = dep.cfg
        pid = {p.name: p.pid for p in ask(cfg.control_endpoint, "status").processes}["prefill-writer-0"]
        ep = cfg.prefill.handshake_endpoints[0]
        out["handshake_endpoint_scheme"] = ep.split("://")[0]
        out["before"] = complete(dep.url)
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(ep)
        c0, t0 = read_cpu_seconds(pid), time.monotonic()
        s.send(m.encode(m.TransferStarting("spin", 0, 0, 2**62)))
        time.sleep(WINDOW_S)  # the measurement window
        spent = read_cpu_seconds(pid) - c0
        out["hint_2e62_writer_cpu_s_per_5s"] = round(spent * WINDOW_S / (time.monotonic() - t0), 2)
        r0 = rss_mb(pid)
        frame = b"x" * FRAME_BYTES
        s.send_multipart([frame] * 64)
        time.sleep(3.0)  # the writer reads it on its loop
        out["64_frames_writer_rss_growth_mb"] = round(rss_mb(pid) - r0, 1)
        agent = NixlAgent("forger")
        f = ctx.socket(zmq.DEALER)
        f.setsockopt(zmq.LINGER, 0)
        f.connect(ep)
        f.send(m.encode(m.Hello(cfg.decode.engine_id, 0, 1, "forger", agent.metadata(), 0,
                                L.instance_layout(cfg, cfg.decode, 0), wire_version=m.WIRE_VERSION,
                                model_id=model_fingerprint(cfg.model))))
        answer = m.DEC_HANDSHAKE.decode(f.recv()) if f.poll(10_000) else None
        out["forged_hello_answer"] = type(answer).__name__ if answer is not None else "none"
        out["after_forgery"] = [complete(dep.url) for _ in range(3)]
        ctx.destroy(0)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
