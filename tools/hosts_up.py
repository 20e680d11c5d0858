"""``pushkv up --role ...`` on namespace "hosts" for the several-hosts tests and the link bench:
start one, wait for READY, find its planned config, ask its schedulers for Stats over the network,
stop or kill it, and clean up what a killed host leaves (its shared memory, its run dir)."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Optional

import zmq

from pushkv import messages as m
from pushkv import security
from pushkv.config import DeploymentConfig, decode_config
from pushkv.security import secure_connect
from pushkv.supervisor import lifecycle

START_TIMEOUT_S = 120.0


class HostUp:
    """One ``pushkv up`` (a supervisor and its children) inside ``host`` (a tools.netns Host;
    None: the root namespace)."""

    def __init__(self, name: str, host, flags: list[str], tmp_dir, env: Optional[dict] = None):
        self.name = name
        self.host = host
        self.registry_dir = str(tmp_dir / f"registry-{name}")
        self.log_path = str(tmp_dir / f"{name}.log")
        os.makedirs(self.registry_dir, mode=0o700, exist_ok=True)  # pushkv refuses a registry others can enter
        argv = [sys.executable, "-m", "processes.cli", "up", *flags]
        full_env = dict(os.environ, PUSHKV_REGISTRY_DIR=self.registry_dir, **(env or {}))
        self.log = open(self.log_path, "a")
        argv = host.argv(argv) if host is not None else argv
        # `ip netns exec` execs the command: this pid is the supervisor's
        self.proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.cfg: Optional[DeploymentConfig] = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if line.strip() == "READY":
                self.ready.set()
        self.ready.set()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "HostUp":
        if not self.ready.wait(timeout_s) or "READY" not in self.lines:
            raise RuntimeError(f"{self.name} did not start: {self.lines}\n{self.tail()}")
        rec = json.load(open(glob.glob(os.path.join(self.registry_dir, "*.json"))[0]))
        self.cfg = decode_config(open(os.path.join(rec["run_dir"], "config.json"), "rb").read())
        return self

    def tail(self, n: int = 4000) -> str:
        if not self.log.closed:
            self.log.flush()
        return open(self.log_path).read()[-n:]

    def log_has(self, text: str) -> bool:
        return text in open(self.log_path).read()

    @property
    def engine_ids(self) -> list[str]:
        return [i.engine_id for i in self.cfg.instances()]

    def stats(self, timeout_s: float = 5.0) -> dict[str, m.Stats]:
        """Each instance's scheduler Stats, asked over the network (its tcp:// endpoint)."""
        out = {}
        for inst in self.cfg.instances():
            s = zmq.Context.instance().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            secure_connect(s, inst.sched_endpoint, security.load(self.cfg.secret_file))
            try:
                s.send(m.encode(m.GetStats()))
                if not s.poll(int(timeout_s * 1000)):
                    raise TimeoutError(f"{inst.engine_id} did not answer GetStats")
                out[inst.engine_id] = m.DEC_SCHED_TO_ROUTER.decode(s.recv())
            finally:
                s.close(0)
        return out

    def wait_pools_free(self, timeout_s: float = 30.0) -> dict[str, m.Stats]:
        end = time.monotonic() + timeout_s
        while True:
            try:
                st = self.stats()
            except TimeoutError:  # a scheduler slow to answer on a loaded machine: asked again within the bound
                if time.monotonic() > end:
                    raise
                continue
            if all(s.free_blocks == s.num_blocks and s.running == 0 and s.waiting == 0 for s in st.values()):
                return st
            if time.monotonic() > end:
                raise AssertionError(f"{self.name}: blocks not returned: {st}")
            time.sleep(0.05)  # polling a remote counter, not synchronising on time

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self.cleanup()

    def kill(self) -> None:
        """kill -9 every process of this host: the supervisor and all its children."""
        pids = self.host.pids() if self.host is not None else [self.proc.pid]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)

    def cleanup(self) -> None:
        """What a killed host leaves on this machine (another machine's disk in real life)."""
        if self.cfg is not None:
            lifecycle.cleanup(self.cfg.deployment_id, self.cfg.run_dir)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()


def http(url: str, body: Optional[dict] = None, timeout: float = 60.0) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


def health(url: str) -> dict:
    return http(url + "/health", timeout=5)[1]


def up_engines(url: str) -> set[str]:
    return {i["engine_id"] for i in health(url).get("instances", []) if i["up"]}


def wait_for(cond, timeout_s: float, what: str):
    """``cond()``'s first truthy answer; AssertionError naming ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.02)  # polling the router's view, not synchronising on time
