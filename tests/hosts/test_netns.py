"""The namespace "hosts" harness (tests/support/netns.py): reachable, cut, restored, and nothing left."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.support import netns

pytestmark = pytest.mark.unit  # helper processes in namespaces, no pushkv deployment

ECHO = """
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
while True:
    c, _ = srv.accept()
    c.sendall(c.recv(64)); c.close()
"""
PROBE = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:
        s.sendall(b"ping"); print(s.recv(64).decode())
except OSError as e:
    print(type(e).__name__)
"""


def probe(host, addr: str, port: int, timeout_s: float = 1.0) -> str:
    argv = [sys.executable, "-c", PROBE, addr, str(port), str(timeout_s)]
    cmd = host.run(argv, capture_output=True, text=True, timeout=30) if host else \
        subprocess.run(argv, capture_output=True, text=True, timeout=30)
    return cmd.stdout.strip()


def echo_server(host, addr: str):
    argv = [sys.executable, "-c", ECHO, addr]
    proc = host.popen(argv, stdout=subprocess.PIPE, text=True) if host else \
        subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


@pytest.mark.timeout(60)
def test_hosts_reach_cut_restore_and_clean_up():
    with netns.hosts(3) as net:
        tag = net.tag
        h1, h2, h3 = net[1], net[2], net[3]
        assert len({h.addr for h in net}) == 3 and all(h.addr.startswith(net.subnet) for h in net)
        srv, port = echo_server(h2, h2.addr)
        root_srv, root_port = echo_server(None, net.root_addr)
        loop_srv, loop_port = echo_server(None, "127.0.0.1")
        try:
            assert probe(h1, h2.addr, port) == "ping"
            assert probe(h3, h2.addr, port) == "ping"
            assert probe(h1, net.root_addr, root_port) == "ping"  # etcd/router in the root ns
            assert probe(None, h2.addr, port) == "ping"
            assert probe(h1, "127.0.0.1", loop_port) == "ConnectionRefusedError"  # own loopback
            h2.cut()
            t0 = time.monotonic()
            assert probe(h1, h2.addr, port, 0.5) in ("TimeoutError", "OSError")
            assert probe(None, h2.addr, port, 0.5) in ("TimeoutError", "OSError")
            assert time.monotonic() - t0 < 10
            h2.restore()
            deadline = time.monotonic() + 10
            got = ""
            while got != "ping" and time.monotonic() < deadline:  # the port forwards again
                got = probe(h1, h2.addr, port)
            assert got == "ping"
            assert srv.poll() is None and srv.pid in h2.pids()
        finally:
            for p in (root_srv, loop_srv):
                p.kill()
                p.wait(5)
        # srv is left running inside h2: cleanup must kill it
    assert netns.leftovers(tag) == []
    assert srv.wait(5) == -9
    srv.stdout.close()


@pytest.mark.timeout(60)
def test_cleanup_when_the_block_fails():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.hosts(2) as net:
            tag = net.tag
            assert netns.leftovers(tag) != []
            raise RuntimeError("boom")
    assert netns.leftovers(tag) == []


def test_concurrent_runs_get_distinct_names_and_subnets():
    with netns.hosts(1) as a, netns.hosts(1) as b:
        assert a.tag != b.tag and a.subnet != b.subnet and a.bridge != b.bridge
        assert a[1].ns != b[1].ns
        assert probe(a[1], b[1].addr, 9, 0.5) in ("TimeoutError", "OSError")  # no route between
    assert netns.leftovers(a.tag) == netns.leftovers(b.tag) == []
