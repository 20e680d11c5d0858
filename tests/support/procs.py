"""Real child processes for tests: spawn, wait for Ready, always clean up."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import zmq

from pushkv import messages as m
from pushkv.config import DeploymentConfig, encode_config
from pushkv.supervisor.lifecycle import shm_leftovers
from pushkv.supervisor.plan import plan_deployment



def planned(cfg: DeploymentConfig, tmp_path) -> DeploymentConfig:
    cfg = plan_deployment(cfg, run_root=str(tmp_path))
    os.makedirs(cfg.run_dir, exist_ok=True)
    with open(os.path.join(cfg.run_dir, "config.json"), "wb") as f:
        f.write(encode_config(cfg))
    return cfg


class Children(list):
    """The child processes, plus each one's Ready by name (e.g. a writer's pool handle)."""

    def __init__(self):
        super().__init__()
        self.ready: dict[str, m.Ready] = {}


def leftover_shm(dep_id: str) -> list[str]:
    return shm_leftovers(dep_id)


@contextmanager
def children(cfg: DeploymentConfig, specs: list[tuple[str, str, int]], timeout_s: float = 60.0):
    """Start (kind, role, rank) children with cfg's control endpoint bound here;
    yield once all sent Ready; terminate, reap and check shm on exit."""
    ctx = zmq.Context.instance()
    ctl = ctx.socket(zmq.ROUTER)
    ctl.setsockopt(zmq.LINGER, 0)
    ctl.bind(cfg.control_endpoint)
    procs = Children()
    try:
        for kind, role, rank in specs:
            argv = [sys.executable, "-m", f"processes.{kind}", "--config",
                    os.path.join(cfg.run_dir, "config.json"), "--role", role, "--rank", str(rank)]
            procs.append(subprocess.Popen(argv))
        pending = {f"{role}-{kind}-{rank}" if kind != "scheduler" else f"{role}-scheduler"
                   for kind, role, rank in specs}
        deadline = time.monotonic() + timeout_s
        while pending:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"child {p.args} exited with {p.returncode} during startup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready: {sorted(pending)}")
            if ctl.poll(200):
                _, data = ctl.recv_multipart()
                msg = m.DEC_CONTROL.decode(data)
                if isinstance(msg, m.Ready):
                    pending.discard(msg.name)
                    procs.ready[msg.name] = msg
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + 15
        for p in procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        ctl.close(0)


def recv(sock: zmq.Socket, decoder, timeout_s: float = 30.0):
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError("no message within %.0fs" % timeout_s)
    return decoder.decode(sock.recv_multipart()[-1])


def dealer(endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s
