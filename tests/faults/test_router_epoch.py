"""A router killed with streams open: each client's connection drops (what it sees is recorded),
the restarted router announces a new epoch, and both schedulers abort the legs of the old one:
every block of both pools is free within 5 s of the kill, not after decoding to max_tokens.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

import pytest

from pushkv.supervisor.commands import ask
from tests.support.deploy import deployment

pytestmark = pytest.mark.timeout(180)

STREAMS, PROMPT, MAX_TOKENS = 6, 100, 3000  # decoding to the end would take minutes on a CPU
FREE_WITHIN_S = 5.0


def _router_pid(dep) -> int:
    return next(p.pid for p in ask(dep.cfg.control_endpoint, "status").processes if p.name == "router")


def _wait_router_ready(dep, old_pid: int, timeout_s: float = 30.0) -> None:
    """Until the supervisor has the restarted router READY: its HTTP edge listens only then (its
    scheduler links, which announce its epoch and free the old legs' blocks, start before it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        procs = ask(dep.cfg.control_endpoint, "status").processes
        if any(p.name == "router" and p.pid != old_pid and p.state == "READY" for p in procs):
            return
        assert time.monotonic() < deadline, f"no router READY again within {timeout_s:.0f}s: {procs}"
        time.sleep(0.1)


class Stream:
    """One streaming completion read on its own thread: its tokens, and how it ended."""

    def __init__(self, port: int, i: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = json.dumps({"prompt": [(i * 7 + k) % 256 for k in range(PROMPT)], "max_tokens": MAX_TOKENS,
                           "stream": True})
        self.conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.first = threading.Event()
        self.ended = ""
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        try:
            while True:
                line = self.resp.readline()
                if not line:
                    self.ended = "eof"
                    return
                if line.startswith(b"data: [DONE]"):
                    self.ended = "done"
                    return
                if line.startswith(b"data: "):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        self.ended = "error event"
                        return
                    self.first.set()
        except Exception as e:  # the connection dropped mid-stream
            self.ended = type(e).__name__
        finally:
            self.first.set()


def test_router_kill_frees_every_block_within_5s(tmp_path):
    with deployment(tmp_path, "--mode", "push", "--model", "small", "--max-restarts", "5") as dep:
        streams = [Stream(dep.port, i) for i in range(STREAMS)]
        for s in streams:
            assert s.first.wait(60) and not s.ended, s.ended
        before = {r: dep.stats(r) for r in dep.roles()}
        assert before["decode"].free_blocks < before["decode"].num_blocks  # the legs hold D's blocks
        old_pid = _router_pid(dep)
        os.kill(old_pid, signal.SIGKILL)
        t_kill = time.monotonic()
        for s in streams:
            s.t.join(10)
        seen = sorted({s.ended for s in streams})
        # no error event can come from a killed process: the connection drops mid-stream
        assert "done" not in seen and "error event" not in seen, seen
        st = dep.wait_pools_free(FREE_WITHIN_S + 5)
        freed_s = time.monotonic() - t_kill
        aborted = {r: st[r].counters.get("router_epoch_aborted", 0) for r in st}
        print(f"router killed with {STREAMS} streams open: clients saw {seen}; both pools free "
              f"{freed_s:.2f}s after the kill; aborted by the new epoch {aborted}")
        assert freed_s <= FREE_WITHIN_S, f"blocks free only {freed_s:.1f}s after the kill"
        assert aborted["decode"] == STREAMS, aborted
        _wait_router_ready(dep, old_pid)
        assert dep.tokens([1, 2, 3], 2)  # the new router serves
