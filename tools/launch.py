"""Start a whole deployment with the real `pushkv up` in a child process and
talk to it: used by the demo, the benchmarks and the tests."""
from __future__ import annotations

import glob
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from typing import Iterator, Optional

import zmq

from pushkv import messages as m
from pushkv import security, uds
from pushkv.config import DeploymentConfig, Role, decode_config
from pushkv.security import secure_connect
from pushkv.supervisor.plan import free_tcp_port

START_TIMEOUT_S = 180


class Deployment:
    def __init__(self, url: str, cfg: DeploymentConfig, proc: subprocess.Popen, port: int):
        self.url = url
        self.cfg = cfg
        self.proc = proc
        self.port = port

    def post(self, path: str, body, timeout: float = 300.0) -> tuple[int, dict]:
        """POST JSON; the answer's status and JSON body (an error's non-JSON text as {"raw": ...}).

        With TCP_NODELAY: http.client sends a body over 2 KiB apart from the headers, and with
        Nagle's algorithm on, the body's last segment then waited for the router's delayed ACK of
        the headers (40-200 ms), which the router's arrival stamp (taken at the headers) counted
        into a long prompt's TTFT."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = self.connection(timeout)
        try:
            conn.connect()
            if conn.sock.family != socket.AF_UNIX:
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.request("POST", path, body=data, headers={"content-type": "application/json"})
            r = conn.getresponse()
            raw = r.read() or b"{}"
        finally:
            conn.close()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, {"raw": raw.decode(errors="replace")}

    def complete(self, prompt, max_tokens: int, **kw) -> dict:
        status, body = self.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **kw})
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body}")
        return body

    def connection(self, timeout: float = 300.0) -> http.client.HTTPConnection:
        """A connection to the router: TCP, or its Unix socket where it listens on one (``--uds``)."""
        path = uds.path_of(self.url)
        if path is not None:
            return uds.UnixHTTPConnection(path, timeout=timeout)
        u = urllib.parse.urlsplit(self.url)
        return http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout)

    def health(self) -> dict:
        conn = self.connection(10)
        try:
            conn.request("GET", "/health")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def tokens(self, prompt, max_tokens: int) -> list[int]:
        return self.complete(prompt, max_tokens)["choices"][0]["token_ids"]

    def stats(self, role: Role, timeout_s: float = 10.0, index: int = 0) -> m.Stats:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        secure_connect(s, self.cfg.instance(role, index).sched_endpoint, security.load(self.cfg.secret_file))
        try:
            s.send(m.encode(m.GetStats()))
            if not s.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"{role} scheduler did not answer GetStats")
            return m.DEC_SCHED_TO_ROUTER.decode(s.recv())
        finally:
            s.close(0)

    def roles(self) -> list[Role]:
        return ["local"] if self.cfg.mode == "local" else ["prefill", "decode"]

    def instance_names(self) -> dict[str, tuple[Role, int]]:
        """Every instance by name (``prefill``, ``prefill1``, ...) -> (role, index)."""
        return {i.name: (i.role, i.index) for i in self.cfg.instances()}

    def wait_pools_free(self, timeout_s: float = 30.0) -> dict[str, m.Stats]:
        """Block accounting invariant: every block of every instance is back once traffic stops
        (by instance name: ``prefill``, ``decode``, and ``prefill1``, ... with several)."""
        end = time.monotonic() + timeout_s
        while True:
            st = {n: self.stats(r, index=i) for n, (r, i) in self.instance_names().items()}
            if all(s.free_blocks == s.num_blocks and s.running == 0 and s.waiting == 0 for s in st.values()):
                return st
            if time.monotonic() > end:
                raise AssertionError(f"blocks not returned: {st}")
            time.sleep(0.05)  # polling a remote counter, not synchronising on time


@contextmanager
def launched(*flags: str, log_path: Optional[str] = None, registry: Optional[str] = None,
             port: Optional[int] = None, start_timeout_s: float = START_TIMEOUT_S,
             session: bool = False) -> Iterator[Deployment]:
    """`pushkv up FLAGS` until the block exits; then SIGINT and reap. ``session``: `pushkv up` leads a session (and
    process group) of its own, as in a terminal, so that a test can send Ctrl-C's SIGINT to the whole group."""
    port = port or free_tcp_port()
    reg = registry or tempfile.mkdtemp(prefix="pushkv-registry-")
    env = dict(os.environ, PUSHKV_REGISTRY_DIR=reg)
    argv = [sys.executable, "-m", "processes.cli", "up", "--port", str(port), *flags]
    log = open(log_path or os.devnull, "w")
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=session)
    lines: list[str] = []
    ready = threading.Event()

    def reader():
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == "READY":
                ready.set()
        ready.set()

    threading.Thread(target=reader, daemon=True).start()
    try:
        if not ready.wait(start_timeout_s) or "READY" not in lines:
            tail = open(log_path).read()[-3000:] if log_path else ""
            raise RuntimeError(f"deployment did not start: {lines}\n{tail}")
        rec = json.load(open(sorted(glob.glob(os.path.join(reg, "*.json")))[-1]))
        cfg = decode_config(open(os.path.join(rec["run_dir"], "config.json"), "rb").read())
        yield Deployment(lines[0], cfg, proc, port)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        if registry is None:
            shutil.rmtree(reg, ignore_errors=True)
