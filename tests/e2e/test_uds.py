"""The router on a Unix domain socket, as vLLM's ``--uds``: ``pushkv up --uds PATH`` serves the OpenAI API over the
socket (and nothing on TCP), the socket file is made 0660 and removed at stop, ``pushkv status`` reads the router's
health through it; a stale socket file is replaced and a live one refused; and a path that cannot be bound, or
``--uds`` with HTTPS, is refused before anything starts, naming the flag."""
from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys

import pytest

from pushkv import uds
from tools.launch import launched

pytestmark = pytest.mark.timeout(240)


def _short_dir(tmp_path) -> str:
    """A directory whose socket paths fit the 107 bytes (pytest's tmp_path may be long)."""
    d = os.path.join("/tmp", f"pushkv-uds-{os.getpid()}-{abs(hash(str(tmp_path))) % 10**6}")
    os.makedirs(d, exist_ok=True)
    return d


def test_the_router_serves_on_a_unix_socket(tmp_path):
    d_ = _short_dir(tmp_path)
    path = os.path.join(d_, "router.sock")
    # a socket file left by a router that is gone (bound, then closed: nothing accepts on it) is replaced
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()
    assert os.path.exists(path)
    reg = str(tmp_path / "registry")
    os.makedirs(reg, mode=0o700)
    try:
        with launched("--mode", "push", "--num-blocks", "256", "--uds", path, registry=reg,
                      log_path=str(tmp_path / "up.log")) as d:
            assert d.url == uds.url(path) and uds.path_of(d.url) == path, d.url
            assert stat.S_ISSOCK(os.lstat(path).st_mode) and stat.S_IMODE(os.lstat(path).st_mode) == uds.PERMS
            assert len(d.tokens([1, 2, 3, 4], 5)) == 5  # /v1/completions through the socket, P to D by push
            assert d.health()["status"] == "ok"
            with pytest.raises(OSError):  # nothing on TCP
                socket.create_connection(("127.0.0.1", d.port), timeout=5).close()
            # pushkv status reads the router's health through the socket: the router's view of each instance
            out = subprocess.run([sys.executable, "-m", "processes.cli", "status", "--json"], capture_output=True,
                                 text=True, timeout=60, env=dict(os.environ, PUSHKV_REGISTRY_DIR=reg))
            report = json.loads(out.stdout)
            assert report[0]["router_url"] == d.url and report[0]["state"] == "running", report
            assert all("blocks_committed" in row for row in report[0]["instances"]), report[0]["instances"]
            # a second deployment on the same, live socket is refused, and leaves the first serving
            second = subprocess.run([sys.executable, "-m", "processes.cli", "up", "--mode", "local", "--num-blocks",
                                     "64", "--uds", path], capture_output=True, text=True, timeout=120,
                                    env=dict(os.environ, PUSHKV_REGISTRY_DIR=reg))
            assert second.returncode != 0 and "another process is serving on that socket" in second.stderr, \
                second.stderr[-2000:]
            assert len(d.tokens([5, 6, 7], 2)) == 2
            d.wait_pools_free()
        assert not os.path.lexists(path), "the socket file outlived the router"
    finally:
        if os.path.lexists(path):
            os.unlink(path)
        os.rmdir(d_)


@pytest.mark.unit
def test_socket_paths_that_cannot_be_bound_are_refused_by_name(tmp_path):
    from pushkv.config_flags import user_config

    plain = tmp_path / "plain.txt"
    plain.write_text("keep me")
    cases = [
        (str(plain), "a file that is not a socket is there"),
        (str(tmp_path / "no" / "such" / "r.sock"), "does not exist"),
        ("/tmp/" + "x" * 120 + ".sock", "over a Unix socket path's 107"),
    ]
    for path, said in cases:
        with pytest.raises(ValueError, match=said):
            user_config({"mode": "local", "device": "cpu", "uds": path})
    assert plain.read_text() == "keep me"  # never deleted
    with pytest.raises(ValueError, match="HTTPS .* is for the router on TCP"):
        user_config({"mode": "local", "device": "cpu", "uds": "/tmp/r.sock", "ssl_keyfile": "/k",
                     "ssl_certfile": "/c"})
    cfg = user_config({"mode": "local", "device": "cpu", "uds": os.path.relpath(str(tmp_path / "r.sock"))})
    assert cfg.uds == str(tmp_path / "r.sock")  # made absolute: the router starts elsewhere


@pytest.mark.unit
def test_the_url_names_the_path_and_claim_takes_only_stale_sockets(tmp_path):
    d_ = _short_dir(tmp_path)
    path = os.path.join(d_, "a b%.sock")
    try:
        assert uds.path_of(uds.url(path)) == path and uds.url(path).startswith("http+unix://%2F")
        assert uds.path_of("http://127.0.0.1:8000") is None
        uds.claim(path)  # nothing there: nothing to do
        live = socket.socket(socket.AF_UNIX)
        live.bind(path)
        live.listen(1)
        with pytest.raises(ValueError, match="another process is serving"):
            uds.claim(path)
        inode = os.lstat(path).st_ino
        live.close()
        uds.claim(path)  # closed: stale, removed
        assert not os.path.lexists(path)
        # release removes only the file the router bound
        other = socket.socket(socket.AF_UNIX)
        other.bind(path)
        uds.release(path, inode + 1)
        assert os.path.lexists(path)
        uds.release(path, os.lstat(path).st_ino)
        assert not os.path.lexists(path)
        other.close()
    finally:
        if os.path.lexists(path):
            os.unlink(path)
        os.rmdir(d_)
