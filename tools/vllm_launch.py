"""Start and stop vLLM API servers (P, D, or plain) and the proxy, for the
tests and the benchmark. Each instance gets its own port, writer handshake
port and core, and is stopped with its whole process group."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from typing import Optional

from pushkv.supervisor.lifecycle import pid_alive

START_TIMEOUT_S = 240.0
GROUP_EXIT_S = 15.0  # a stopped server's other processes, to end by themselves


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except Exception:
        return 0


class Server:
    def __init__(self, name: str, cmd: list[str], env: dict, url: str, log_path: str, cwd: Optional[str] = None):
        self.name, self.url, self.log_path = name, url, log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd)

    def wait_ready(self, path: str = "/health", timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) at start; log {self.log_path}:\n"
                                   + self.tail())
            if _get(self.url + path) == 200:
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s; log {self.log_path}:\n" + self.tail())

    def tail(self, n: int = 40) -> str:
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")

    def stop(self, timeout: float = 30.0) -> None:
        self.terminate()
        self.reap(timeout)

    def terminate(self) -> None:
        """SIGTERM to the server's process group: it begins its shutdown (``reap`` waits for it)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def reap(self, timeout: float = 30.0) -> None:
        """Wait for the terminated server and its group to exit, killing what outlives its time."""
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # the rest of the group (engine core, workers, writers) ends on the SIGTERM it got too: give it
        # the time to unlink its shared memory (vLLM's message queues), killed only once that is up
        deadline = time.monotonic() + GROUP_EXIT_S
        while pid_alive(-self.proc.pid) and time.monotonic() < deadline:  # (a negative pid: its group)
            time.sleep(0.1)
        try:  # children that outlived the server and that time
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


def vllm_server(name: str, model: str, port: int, core: int, log_dir: str, role: Optional[str] = None,
                handshake_port: int = 0, connector: str = "PushKVConnector", extra_args=(),
                kv_cache_bytes: int = 256 * 2**20, code: Optional[str] = None,
                connector_config: Optional[dict] = None, env: Optional[dict] = None) -> Server:
    """role None: a plain instance; "prefill"/"decode": with ``connector`` (pushkv's takes
    ``connector_config`` into its extra config, e.g. ``{"stream_groups": 2}``). ``code``: a directory
    holding another ``pushkv`` package (another commit's, for A/B runs): the instance, its engine
    and its writers import pushkv from there (run in it, and first on PYTHONPATH). ``env`` is added
    to the server's environment."""
    env = dict(os.environ, **(env or {}), HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=str(core),
               VLLM_NIXL_SIDE_CHANNEL_PORT=str(handshake_port or port + 1000), OMP_NUM_THREADS="1",
               VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "2048", "--seed", "0",
           "--kv-cache-memory-bytes", str(kv_cache_bytes), "--enforce-eager", *extra_args]
    if role is not None:
        cfg: dict[str, object] = {"kv_connector": connector, "engine_id": f"{name}-{port}",
                                  "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"}
        if connector == "PushKVConnector":
            cfg["kv_connector_module_path"] = "pushkv.vllm"
            cfg["kv_connector_extra_config"] = {"handshake_port": handshake_port or port + 1000,
                                                **(connector_config or {})}
        else:  # vLLM's NIXL connectors: both roles, host buffers on CPU
            cfg["kv_role"] = "kv_both"
            cfg["kv_buffer_device"] = "cpu"
        cmd += ["--kv-transfer-config", json.dumps(cfg)]
    if code is not None:  # `python -m` puts the working directory first on sys.path, then PYTHONPATH
        env["PYTHONPATH"] = os.pathsep.join(p for p in (code, env.get("PYTHONPATH", "")) if p)
    return Server(name, cmd, env, f"http://127.0.0.1:{port}", os.path.join(log_dir, f"{name}.log"), cwd=code)


def proxy_server(prefill: list[str], decode: list[str], port: int, log_dir: str, protocol: str = "pushkv",
                 name: str = "proxy") -> Server:
    cmd = [sys.executable, "-m", "pushkv.vllm.proxy", "--port", str(port), "--protocol", protocol]
    for u in prefill:
        cmd += ["--prefill", u]
    for u in decode:
        cmd += ["--decode", u]
    return Server(name, cmd, dict(os.environ), f"http://127.0.0.1:{port}", os.path.join(log_dir, f"{name}.log"))


@contextmanager
def servers(*made: Server, ready: bool = True):
    """Wait for all to be ready (they start in parallel); stop all on exit."""
    try:
        if ready:
            for s in made:
                s.wait_ready()
        yield made
    finally:  # all begin their shutdown at once, then each is waited for: the slowest's time, not the sum
        for s in made:
            s.terminate()
        for s in made:
            s.reap()
