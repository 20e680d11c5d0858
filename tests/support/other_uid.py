"""Run ``other_uid_probe.py`` as another uid (65534, through ``setpriv``: CI runs as root), and
knock on a secured endpoint as a peer without the secret. Shared by the tests that show a
stranger gets nothing: pushkv's own writers (tests/e2e) and the vLLM connector's (tests/vllm)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import zmq

from pushkv.security import secure_connect

AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def probe(asks: dict, as_other_uid: bool) -> dict:
    """tests/support/other_uid_probe.py, as root or as uid 65534, run from a copy in a directory
    that uid can read (the checkout may not be). ``asks``: endpoint -> hex of a Hello."""
    from tests.support import other_uid_probe

    d = tempfile.mkdtemp(prefix="pushkv-probe-")
    try:
        os.chmod(d, 0o755)
        script = os.path.join(d, "probe.py")
        shutil.copyfile(other_uid_probe.__file__, script)
        os.chmod(script, 0o644)
        argv = [*(AS_NOBODY if as_other_uid else []), sys.executable, script]
        out = subprocess.run(argv, input=json.dumps(asks), capture_output=True, text=True, timeout=60, cwd=d)
    finally:
        shutil.rmtree(d)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def nobody_runs_python() -> bool:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return False
    return subprocess.run([*AS_NOBODY, sys.executable, "-c", "import zmq"], capture_output=True, timeout=60,
                          cwd="/").returncode == 0


def knock(endpoint: str, security, payload: bytes, wait_s: float = 20.0) -> None:
    """A peer that sends one frame to a secured endpoint and stays until the server has
    thrown it out (its own monitor sees the connection end), so the refusal is complete;
    it must get no answer."""
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        secure_connect(s, endpoint, security)
        s.send(payload)
        assert mon.poll(int(wait_s * 1000)), f"{endpoint} did not throw out a peer without the secret"
        assert not s.poll(0), "a peer without the secret got an answer"
        s.disable_monitor()
    finally:
        ctx.destroy(0)
