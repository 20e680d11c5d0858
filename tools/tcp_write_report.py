"""NIXL WRITE over UCX's TCP transport against a plain TCP socket, between two network-namespace
"hosts" on this machine, measured in the same run: the network path forced once.

    sudo pushkv tcp-write-report [--sizes 1,16,64,256] [--reps 5] [--json out.json] [--rate 1gbit]

Two namespaces on a bridge (``tools/netns.py``); in each a process with a
``pushkv.transport.nixl_agent.NixlAgent`` on host memory, with ``UCX_TLS=tcp`` so that UCX
cannot take its shared-memory shortcuts (cma, posix) that work across namespaces on one
machine. The processes meet over a TCP control socket: the target sends its NIXL metadata
and buffer address, the initiator its metadata (both load each other's, for the notification).
Per size and rep, alternating: the target zeroes its buffer and says "go"; the initiator
starts the clock, posts one WRITE of the whole size with a notification (or, for the
baseline, ``sendall``s the same bytes on a second TCP connection), and stops the clock when
the target's acknowledgement arrives: the target sends it once the notification (or the
last byte) is in, with the CRC32 of what it received, which must equal the sender's.
Both paths pay the same acknowledgement round trip. The median of the reps is reported.

``--rate`` caps what each host sends (``tools/netns.py`` ``Host.cap``: tc tbf on its link), the
link ``tools/link_bench.py`` measures serving over; each row then also has the fastest rep.

The UCX transport really used is read from UCX's own protocol table (``UCX_PROTO_INFO=y``):
the line for "remote memory write" names the transport and device (e.g. ``tcp/eth0``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import select
import socket
import statistics
import struct
import subprocess
import sys
import time
import zlib

import msgspec
import numpy as np

from pushkv import envs

MIB = 1 << 20
DEFAULT_SIZES_MIB = (1, 16, 64, 256)
STEP_TIMEOUT_S = 60.0  # one WRITE or one socket stream, at worst
RUN_TIMEOUT_S = 540.0
_enc, _dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()


# -- framing on the control socket ------------------------------------------------------------

def send_msg(sock: socket.socket, msg: dict) -> None:
    data = _enc.encode(msg)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the control socket")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket) -> dict:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    return _dec.decode(_recv_exact(sock, n))


def crc(buf: np.ndarray, n: int) -> int:
    return zlib.crc32(memoryview(buf[:n]))


def _make_agent(name: str, nbytes: int):
    from pushkv.transport.nixl_agent import NixlAgent

    buf = np.zeros(nbytes, dtype=np.uint8)
    agent = NixlAgent(name)
    agent.register(buf.ctypes.data, nbytes)
    return agent, buf


# -- the target (receiving host) ---------------------------------------------------------------

def run_target(bind: str, max_bytes: int) -> None:
    ctl_srv = socket.create_server((bind, 0))
    data_srv = socket.create_server((bind, 0))
    print(ctl_srv.getsockname()[1], flush=True)
    ctl, _ = ctl_srv.accept()
    ctl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small messages: no Nagle wait
    agent, buf = _make_agent("tcpw-target", max_bytes)
    send_msg(ctl, {"md": agent.metadata(), "base": buf.ctypes.data, "data_port": data_srv.getsockname()[1]})
    data, _ = data_srv.accept()
    peer = agent.add_remote(recv_msg(ctl)["md"])
    send_msg(ctl, {"ready": True})
    view = memoryview(buf)
    while True:
        msg = recv_msg(ctl)
        if msg["op"] == "bye":
            break
        n = msg["size"]
        buf[:n] = 0
        send_msg(ctl, {"go": True})
        if msg["op"] == "nixl":
            want = msg["notif"].encode()
            deadline = time.monotonic() + STEP_TIMEOUT_S
            got = False
            while not got:  # busy: UCX's TCP transport lands the data as we progress
                got = any(want in payloads for payloads in agent.poll_notifs().values())
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no notification {want!r} within {STEP_TIMEOUT_S}s")
        else:
            off = 0
            while off < n:
                k = data.recv_into(view[off:n])
                if not k:
                    raise ConnectionError("data socket closed")
                off += k
        send_msg(ctl, {"crc": crc(buf, n)})
    agent.remove_remote(peer)
    agent.deregister()


# -- the initiator (sending host) --------------------------------------------------------------

def run_initiator(target: str, port: int, sizes: list[int], reps: int) -> dict:
    ctl = socket.create_connection((target, port), timeout=STEP_TIMEOUT_S)
    ctl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hello = recv_msg(ctl)
    data = socket.create_connection((target, hello["data_port"]), timeout=STEP_TIMEOUT_S)
    data.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as UCX's tcp transport does
    agent, buf = _make_agent("tcpw-initiator", max(sizes))
    buf[:] = np.random.default_rng(0).integers(0, 256, buf.size, dtype=np.uint8)
    remote = agent.add_remote(hello["md"])
    send_msg(ctl, {"md": agent.metadata()})
    assert recv_msg(ctl)["ready"]
    out: dict = {"sizes": []}
    for n in sizes:
        times: dict[str, list[float]] = {"nixl": [], "tcp": []}
        for rep in range(reps + 1):  # rep 0 warms up (connection set-up, first touch)
            for op in ("nixl", "tcp"):
                buf[:8] = np.frombuffer(struct.pack("!II", rep, n & 0xFFFFFFFF), dtype=np.uint8)
                want = crc(buf, n)
                notif = f"w{n}-{rep}"
                send_msg(ctl, {"op": op, "size": n, "notif": notif})
                assert recv_msg(ctl)["go"]
                t0 = time.perf_counter()
                if op == "nixl":
                    ack = _write(agent, buf, n, remote, hello["base"], notif.encode(), ctl)
                else:
                    data.sendall(memoryview(buf)[:n])
                    ack = recv_msg(ctl)
                dt = time.perf_counter() - t0
                if ack["crc"] != want:
                    raise RuntimeError(f"{op} {n} bytes rep {rep}: CRC {ack['crc']:#x} != sent {want:#x}")
                if rep:
                    times[op].append(dt)
        row = {"bytes": n}
        for op in ("nixl", "tcp"):
            med = statistics.median(times[op])
            row[f"{op}_s"] = med
            row[f"{op}_min_s"] = min(times[op])
            row[f"{op}_gbps"] = n / med / 1e9
        row["ratio"] = row["nixl_gbps"] / row["tcp_gbps"]
        row["verified_reps"] = reps + 1
        out["sizes"].append(row)
    send_msg(ctl, {"op": "bye"})
    agent.remove_remote(remote)
    agent.deregister()
    return out


def _write(agent, buf: np.ndarray, n: int, remote: str, remote_base: int, notif: bytes,
           ctl: socket.socket) -> dict:
    handle = agent.post("WRITE", [(0, 0, n)], buf.ctypes.data, remote, remote_base, notif)
    try:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        state = "PROC"
        while True:  # progress our side until DONE and the target's ack is readable
            if state != "DONE":
                state = agent.state(handle)
                if state == "ERR":
                    raise RuntimeError(f"WRITE of {n} bytes failed")
            if select.select([ctl], [], [], 0 if state != "DONE" else 0.001)[0]:
                return recv_msg(ctl)
            if time.monotonic() > deadline:
                raise TimeoutError(f"WRITE of {n} bytes: no ack within {STEP_TIMEOUT_S}s (state {state})")
    finally:
        agent.release(handle)


# -- the orchestrator ----------------------------------------------------------------------------

def ucx_transport(text: str) -> str:
    """What UCX chose for remote memory writes to the peer, from its protocol tables
    (``UCX_PROTO_INFO=y``): e.g. ``tcp/eth0 (inter-node: 0..inf zero-copy)``; the table for
    the agent's own loopback endpoint ("self") is skipped."""
    rows = [re.sub(r"^\[[^]]*\]\s*\[[^]]*\]\s*", "", line).strip() for line in text.splitlines()]
    found: list[str] = []
    for i, row in enumerate(rows):
        m = re.match(r"\|\s*\S+\s+(.*?)\s+cfg#\d+\s*\|$", row)
        if not m or m.group(1) == "self" or i + 1 >= len(rows) or "remote memory write" not in rows[i + 1]:
            continue
        cells = []
        for r in rows[i + 2:]:
            parts = [c.strip() for c in r.strip("|").split("|")]
            if r.startswith("+") or parts[0] == "Range":
                continue
            if len(parts) != 3:
                break
            cells.append(f"{parts[0]} {parts[1]} via {parts[2]}")
        found.append(f"{m.group(1)}: {'; '.join(cells)}")
    return " | ".join(dict.fromkeys(found)) or "unknown (UCX printed no protocol table)"


def measure(sizes: list[int], reps: int, tls: str = "tcp", rate: str = "none") -> dict:
    """``rate``: each host's link capped at it (tc syntax; ``none``: as the veth runs); the
    result's ``qdisc`` then holds each host's tbf with its counters after the run."""
    from tools.netns import hosts

    with hosts(2) as net:
        for h in (net[1], net[2]):
            h.cap(rate)
        result = measure_on(net[1], net[2], sizes, reps, {"UCX_TLS": tls})
        result["rate"] = rate
        return result


def measure_on(h1, h2, sizes: list[int], reps: int, ucx: dict[str, str]) -> dict:
    """The measurement between two hosts that exist (``tools.netns`` hosts, their caps as they
    are): ``h1`` WRITEs into ``h2`` under ``ucx`` (``UCX_TLS`` and the like). ``pushkv link-bench``
    runs it on its own hosts at every rate, so that the planner has the link's rate of that sitting."""
    env = dict(os.environ, **ucx, UCX_PROTO_INFO="y", UCX_PROTO_ENABLE="y")
    me = [sys.executable, "-m", "tools.tcp_write_report"]
    target = h2.popen(me + ["--role", "target", "--bind", h2.addr, "--max-bytes", str(max(sizes))],
                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    init = None
    try:
        port = int(target.stdout.readline() or 0)
        if not port:
            raise RuntimeError(f"target did not start: {target.stderr.read()[-2000:]}")
        init = h1.popen(me + ["--role", "initiator", "--connect", f"{h2.addr}:{port}",
                              "--sizes", ",".join(map(str, sizes)), "--reps", str(reps)],
                        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = init.communicate(timeout=RUN_TIMEOUT_S)
        if init.returncode:
            raise RuntimeError(f"initiator failed ({init.returncode}):\n{(out + err)[-3000:]}")
        result = json.loads(out.strip().splitlines()[-1])
        target.wait(STEP_TIMEOUT_S)
        result["ucx_transport"] = ucx_transport(out + err)
        if envs.PUSHKV_TCPW_UCX_LOG:
            sys.stderr.write(out + err)
        result["ucx_tls"] = ucx.get("UCX_TLS", "")
        result["hosts"] = [h1.addr, h2.addr]
        result["qdisc"] = {h.addr: h.qdisc() for h in (h1, h2)}
        return result
    finally:
        for p in (init, target):
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.communicate(timeout=10)


def print_table(result: dict) -> None:
    print(f"NIXL WRITE (UCX_TLS={result['ucx_tls']}, transport used: {result['ucx_transport']}) vs a TCP "
          f"socket stream, {result['hosts'][0]} -> {result['hosts'][1]}, median of {result['reps']} reps, "
          f"links capped at {result['rate']}")
    print(f"{'size':>10} {'WRITE GB/s':>11} {'socket GB/s':>12} {'ratio':>6}")
    for r in result["sizes"]:
        size = f"{r['bytes'] / MIB:g} MiB"
        print(f"{size:>10} {r['nixl_gbps']:>11.3f} {r['tcp_gbps']:>12.3f} {r['ratio']:>6.2f}")


def _sizes(text: str) -> list[int]:
    return [int(float(s) * MIB) for s in text.split(",") if s]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES_MIB)),
                    help="MiB, comma-separated (fractions allowed)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tls", default="tcp", help="UCX_TLS for both agents (default tcp)")
    ap.add_argument("--rate", default="none", help="cap each host's link (tc rate, e.g. 1gbit; default none)")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--role", choices=("target", "initiator"), help=argparse.SUPPRESS)
    ap.add_argument("--bind", help=argparse.SUPPRESS)
    ap.add_argument("--connect", help=argparse.SUPPRESS)
    ap.add_argument("--max-bytes", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role == "target":
        run_target(a.bind, a.max_bytes)
        return
    if a.role == "initiator":
        host, port = a.connect.rsplit(":", 1)
        res = run_initiator(host, int(port), [int(s) for s in a.sizes.split(",")], a.reps)
        print(json.dumps(res), flush=True)
        return
    if os.geteuid() != 0:
        sys.exit("pushkv tcp-write-report makes network namespaces: run it as root")
    result = measure(_sizes(a.sizes), a.reps, a.tls, a.rate)
    result["reps"] = a.reps
    print_table(result)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
