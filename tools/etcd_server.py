"""A real etcd server for tests and tools: free ports, a temp data dir, always stopped.

``etcd_server(tmp_path)`` starts ``/usr/bin/etcd`` (Debian's ``etcd-server``; ``tools/install.sh``
installs it) listening on 127.0.0.1 (plus any ``extra_hosts``, e.g. a netns bridge address),
waits until ``/health`` answers, yields an ``EtcdServer`` and stops it (SIGTERM, then SIGKILL
against one deadline) however the test ends. ``enable_auth`` turns on authentication with a
root user and a ``pushkv`` user whose role may read and write only the given prefix.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

ETCD_BIN = shutil.which("etcd") or "/usr/bin/etcd"
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0
MISSING = f"{ETCD_BIN} not found: install Debian's etcd-server (tools/install.sh does, as root)"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


@dataclass
class EtcdServer:
    client_port: int
    peer_port: int
    data_dir: str
    log_path: str
    proc: subprocess.Popen
    hosts: tuple[str, ...] = ("127.0.0.1",)
    argv: list = field(default_factory=list, repr=False)
    token: str = field(default="", repr=False)
    root_password: str = field(default="", repr=False)  # set with auth: a restart needs a new token
    ca_file: str = ""  # set when the client port speaks TLS

    @property
    def _ctx(self) -> Optional[ssl.SSLContext]:
        return ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None

    @property
    def _base(self) -> str:
        return f"{'https' if self.ca_file else 'http'}://127.0.0.1:{self.client_port}"

    def stop(self) -> None:
        _stop(self.proc)

    def start(self) -> None:
        """Start a stopped etcd again on the same ports and data."""
        self.proc = _start(self.argv, self.log_path)
        if not _wait_healthy(self.proc, self._base, self._ctx):
            raise RuntimeError(f"etcd did not come back; log: {self.log_path}")
        if self.root_password:  # tokens do not outlive the server
            self.token = ""
            self.token = self.call("auth/authenticate", {"name": "root", "password": self.root_password})["token"]

    def restart(self) -> None:
        """Stop etcd and start it again (clients see a break)."""
        self.stop()
        self.start()

    def url(self, host: str = "127.0.0.1", user: str = "", password: str = "",
            prefix: str = "/pushkv") -> str:
        cred = f"{user}:{password}@" if user else ""
        if self.ca_file:
            return f"etcds://{cred}{host}:{self.client_port}{prefix}?ca={self.ca_file}"
        return f"etcd://{cred}{host}:{self.client_port}{prefix}"

    def call(self, path: str, body: dict, timeout_s: float = 5.0) -> dict:
        """One v3 gateway call as the test's operator (root token once auth is on)."""
        req = urllib.request.Request(f"{self._base}/v3/{path}",
                                     data=json.dumps(body).encode(), method="POST")
        if self.token:
            req.add_header("Authorization", self.token)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s, context=self._ctx) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"etcd {path}: {e.code} {e.read()[:300]!r}") from None

    def enable_auth(self, root_password: str, user: str, password: str, prefix: str) -> None:
        key, end = prefix.encode(), bytearray(prefix.encode())
        end[-1] += 1
        for path, body in (
            ("auth/user/add", {"name": "root", "password": root_password}),
            ("auth/role/add", {"name": "root"}),
            ("auth/user/grant", {"user": "root", "role": "root"}),
            ("auth/user/add", {"name": user, "password": password}),
            ("auth/role/add", {"name": user}),
            ("auth/role/grant", {"name": user, "perm": {
                "permType": "READWRITE", "key": base64.b64encode(key).decode(),
                "range_end": base64.b64encode(bytes(end)).decode()}}),
            ("auth/user/grant", {"user": user, "role": user}),
            ("auth/enable", {}),
        ):
            self.call(path, body)
        self.root_password = root_password
        self.token = self.call("auth/authenticate", {"name": "root", "password": root_password})["token"]

    def keys(self, prefix: str) -> list[str]:
        end = bytearray(prefix.encode())
        end[-1] += 1
        got = self.call("kv/range", {"key": _b64(prefix),
                                     "range_end": base64.b64encode(bytes(end)).decode()})
        return [base64.b64decode(kv["key"]).decode() for kv in got.get("kvs", [])]


def _healthy(base: str, ctx: Optional[ssl.SSLContext]) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=1.0, context=ctx) as r:
            return json.loads(r.read()).get("health") == "true"
    except (OSError, ValueError):
        return False


def _start(argv: list, log_path: str) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)


def _wait_healthy(proc: subprocess.Popen, base: str, ctx: Optional[ssl.SSLContext]) -> bool:
    deadline = time.monotonic() + START_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        if _healthy(base, ctx):
            return True
        time.sleep(0.05)  # polling a readiness probe, not synchronising on time
    return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)


def make_tls(tmp_dir) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl): (ca, cert, key) paths."""
    d = os.path.join(str(tmp_dir), "tls")
    os.makedirs(d, exist_ok=True)
    ca, ca_key, cert, key, csr = (os.path.join(d, n) for n in ("ca.pem", "ca.key", "server.pem",
                                                               "server.key", "server.csr"))
    ext = os.path.join(d, "ext.cnf")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    def run(*a: str) -> None:
        subprocess.run(["openssl", *a], check=True, capture_output=True, timeout=30)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "1",
        "-subj", "/CN=pushkv-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=localhost")
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
        "-days", "1", "-extfile", ext)
    return ca, cert, key


@contextmanager
def etcd_server(tmp_dir, extra_hosts: tuple[str, ...] = (), tls: Optional[tuple[str, str, str]] = None):
    """Start etcd in ``tmp_dir``; yield an EtcdServer; always stop it. ``tls``: (ca, cert, key)
    from ``make_tls``, for a client port that speaks only TLS."""
    if not os.path.exists(ETCD_BIN):
        raise FileNotFoundError(MISSING)
    data_dir = os.path.join(str(tmp_dir), "etcd-data")
    log_path = os.path.join(str(tmp_dir), "etcd.log")
    for _attempt in range(3):  # a free port can be taken between probing and binding
        cport, pport = free_port(), free_port()
        hosts = ("127.0.0.1",) + tuple(extra_hosts)
        scheme = "https" if tls else "http"
        listen = ",".join(f"{scheme}://{h}:{cport}" for h in hosts)
        peer = f"http://127.0.0.1:{pport}"
        argv = [ETCD_BIN, "--name", "pushkv-test", "--data-dir", data_dir,
                "--listen-client-urls", listen, "--advertise-client-urls", listen,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"pushkv-test={peer}", "--initial-cluster-state", "new",
                "--logger", "zap", "--log-outputs", "stderr"]
        if tls:
            argv += ["--cert-file", tls[1], "--key-file", tls[2]]
        ctx = ssl.create_default_context(cafile=tls[0]) if tls else None
        proc = _start(argv, log_path)
        if _wait_healthy(proc, f"{scheme}://127.0.0.1:{cport}", ctx):
            break
        _stop(proc)
        shutil.rmtree(data_dir, ignore_errors=True)
    else:
        with open(log_path, "rb") as f:
            tail = f.read()[-2000:].decode(errors="replace")
        raise RuntimeError(f"etcd did not start; log tail:\n{tail}")
    server = EtcdServer(cport, pport, data_dir, log_path, proc, hosts, argv, ca_file=tls[0] if tls else "")
    try:
        yield server
    finally:
        _stop(server.proc)
        shutil.rmtree(data_dir, ignore_errors=True)
