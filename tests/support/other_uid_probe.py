"""Run as another uid (``setpriv``): try to reach each writer handshake endpoint given on stdin
(JSON: endpoint -> hex of a Hello that P or D would accept) and say, as JSON on stdout, what
came of each: whether a unix connect was allowed, and what answer (if any) the Hello got.

The wait for an answer ends on an event, not a sleep: the socket monitor's first connect
outcome (connected, or a retry after the kernel refused the connect)."""
from __future__ import annotations

import json
import socket
import sys

import zmq
from zmq.utils.monitor import recv_monitor_message

CONNECT_WAIT_MS = 10_000
ANSWER_WAIT_MS = 5_000


def unix_connect(path: str) -> str:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return "connected"
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()


def try_hello(endpoint: str, hello: bytes) -> dict:
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECT_DELAYED)
        s.connect(endpoint)
        outcome = "silent"
        while mon.poll(CONNECT_WAIT_MS):
            ev = recv_monitor_message(mon)["event"]
            if ev == zmq.EVENT_CONNECTED:
                outcome = "connected"
                break
            if ev == zmq.EVENT_CONNECT_RETRIED:
                outcome = "retried"
                break
        answer = ""
        if outcome == "connected":
            s.send(hello)
            if s.poll(ANSWER_WAIT_MS):
                answer = s.recv().hex()
        s.disable_monitor()
        return {"connect": outcome, "answer": answer}
    finally:
        ctx.destroy(0)


def main() -> None:
    asks = json.load(sys.stdin)
    out = {}
    for endpoint, hello_hex in asks.items():
        r = try_hello(endpoint, bytes.fromhex(hello_hex))
        if endpoint.startswith("ipc://"):
            r["unix"] = unix_connect(endpoint[len("ipc://"):])
        out[endpoint] = r
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
