"""The connector's ipc socket files: a worker that stops removes its own and its writer's
(a writer killed at the stop removes nothing), and a worker that starts removes the files
that stopped runs left behind (vLLM's default shutdown SIGKILLs them all) but none that a
live process listens on, nor one that may have just been bound."""
import os
import socket
import subprocess
import sys
import time

import pytest
import zmq

from pushkv.vllm import params as P
from pushkv.vllm import worker_side
from pushkv.vllm.worker_side import WorkerSide

pytestmark = pytest.mark.timeout(60)

# binds a writer's command and handshake sockets, and stays until killed (it ignores SIGTERM)
STUBBORN_WRITER = """
import signal, sys, time, zmq
signal.signal(signal.SIGTERM, signal.SIG_IGN)
ctx = zmq.Context()
socks = []
for kind, ep in zip((zmq.PULL, zmq.ROUTER), sys.argv[1:]):
    s = ctx.socket(kind)
    s.bind(ep)
    socks.append(s)
print("bound", flush=True)
time.sleep(600)
"""


@pytest.fixture
def sock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return P.socket_dir()


def _listener(*endpoints: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN_WRITER, *endpoints], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "bound"
    return proc


def _dead_socket(path: str, age_s: float) -> None:
    """A socket file no process listens on, as a killed process leaves it, ``age_s`` old."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()
    t = time.time() - age_s
    os.utime(path, (t, t))


def test_a_stopping_worker_removes_its_and_its_killed_writers_socket_files(sock_dir, monkeypatch):
    """The worker binds its event socket, its writer the command and handshake sockets; the
    writer does not stop within WRITER_STOP_S and is killed: no file is left of either."""
    monkeypatch.setattr(worker_side, "WRITER_STOP_S", 0.5)
    s = P.Settings(f"e{os.getpid()}", 1, "", 0, 1.0, 1.0, 1.0)
    ws = WorkerSide(s, 0, "prefill")
    ws._open_sockets()
    ws.proc = _listener(s.cmd_endpoint(0), s.handshake_endpoint(0))
    try:
        ours = sorted(f"{s.engine_id}-0-{k}" for k in ("cmd", "hs", f"ev-{os.getpid()}"))
        assert sorted(os.listdir(sock_dir)) == ours
    finally:
        ws.shutdown()
    ws.proc.stdout.close()
    assert ws.proc.returncode == -9  # killed, as vLLM's default shutdown kills the writers
    assert os.listdir(sock_dir) == []


def test_a_starting_worker_removes_dead_socket_files_and_keeps_live_ones(sock_dir):
    """Files of runs that were killed go; a live instance's (another process listens), a file
    bound a moment ago and anything not a socket stay. A dead run's file of this engine id
    (a crash a moment ago) is simply bound over."""
    s = P.Settings(f"e{os.getpid()}", 1, "", 0, 1.0, 1.0, 1.0)
    _dead_socket(os.path.join(sock_dir, "old-0-ev-1"), 3600)
    _dead_socket(os.path.join(sock_dir, "old-0-hs"), 3600)
    _dead_socket(os.path.join(sock_dir, "young-0-ev-2"), 0)  # maybe between its bind and its listen
    _dead_socket(s.cmd_endpoint(0)[len("ipc://"):], 0)  # this engine's, of a run just killed
    with open(os.path.join(sock_dir, "notes"), "w"):
        pass
    live = _listener(f"ipc://{sock_dir}/live-0-cmd", f"ipc://{sock_dir}/live-0-hs")
    for name in ("live-0-cmd", "live-0-hs"):
        os.utime(os.path.join(sock_dir, name), (time.time() - 3600,) * 2)
    ws = WorkerSide(s, 0, "prefill")
    ctx = zmq.Context.instance()
    writer = ctx.socket(zmq.PULL)
    writer.setsockopt(zmq.LINGER, 0)
    try:
        ws._open_sockets()
        assert sorted(os.listdir(sock_dir)) == sorted(["live-0-cmd", "live-0-hs", "young-0-ev-2", "notes",
                                                       f"{s.engine_id}-0-cmd", f"{s.engine_id}-0-ev-{os.getpid()}"])
        writer.bind(s.cmd_endpoint(0))  # a new writer binds over the dead file: the worker's commands reach it
        assert ws.cmd is not None
        ws.cmd.send(b"hello")
        assert writer.poll(5000) and writer.recv() == b"hello"
        assert live.poll() is None  # the live listener was only knocked at
    finally:
        writer.close(0)
        live.kill()
        live.wait()
        live.stdout.close()
        ws.shutdown()
    assert sorted(os.listdir(sock_dir)) == sorted(["live-0-cmd", "live-0-hs", "young-0-ev-2", "notes"])


def test_a_second_instance_of_a_live_engine_id_is_refused(sock_dir):
    """Two instances given one engine_id: the second worker refuses to start, naming it, and the
    first's files stay (zmq would have bound over them without a word and taken its writer's
    commands and handshakes)."""
    s = P.Settings(f"e{os.getpid()}", 1, "", 0, 1.0, 1.0, 1.0)
    live = _listener(s.cmd_endpoint(0), s.handshake_endpoint(0))
    ws = WorkerSide(s, 0, "prefill")
    try:
        with pytest.raises(RuntimeError, match=f"engine_id 'e{os.getpid()}' rank 0: another live process listens on"):
            ws._open_sockets()
        assert live.poll() is None and ws.events is None
        assert sorted(os.listdir(sock_dir)) == sorted(f"{s.engine_id}-0-{k}" for k in ("cmd", "hs"))
    finally:
        live.kill()
        live.wait()
        live.stdout.close()
        ws.shutdown()
