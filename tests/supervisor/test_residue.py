"""Crash residue: pool segments of writers that died without cleaning up (kill -9 of a host)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tools.launch import launched
from pushkv.supervisor import lifecycle
from tests.support import ROOT


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_residue_lists_only_dead_writers_segments_and_sweep_removes_them(tmp_path):
    dead = tmp_path / f"pushkv-dep1-prefill-0-{_dead_pid()}"
    live = tmp_path / f"pushkv-dep1-decode-0-{os.getpid()}"
    other = tmp_path / "pushkv-dep1-decode-0"  # no writer pid: not ours to judge
    unrelated = tmp_path / f"something-{_dead_pid()}"
    for f in (dead, live, other, unrelated):
        f.write_bytes(b"x" * 64)
    got = lifecycle.residue(str(tmp_path))
    assert [p for p, _ in got] == [str(dead)]
    assert "is gone" in got[0][1]
    assert lifecycle.sweep_residue(str(tmp_path)) == got
    assert not dead.exists() and live.exists() and other.exists() and unrelated.exists()
    assert lifecycle.residue(str(tmp_path)) == []


@pytest.mark.timeout(180)
def test_pushkv_up_removes_a_killed_deployments_pools(tmp_path, capsys):
    """Every process of a deployment killed (kill -9, as in a crash): its pools stay in /dev/shm
    and its run dir on disk. `pushkv status` lists the pools; the next `pushkv up` of the same
    user removes pools and run dir and says so."""
    from processes.cli import main

    reg = str(tmp_path / "reg")
    with launched("--mode", "local", "--model", "tiny", "--num-blocks", "64", registry=reg,
                  log_path=str(tmp_path / "first.log")) as dep:
        dep_id, run_dir = dep.cfg.deployment_id, dep.cfg.run_dir
        os.kill(dep.proc.pid, signal.SIGKILL)  # the supervisor; its children die with it, cleaning nothing
        dep.proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not lifecycle.residue():
            time.sleep(0.05)
    left = lifecycle.shm_leftovers(dep_id)
    assert left, "a killed writer's pool should still be there"
    assert {p for p, _ in lifecycle.residue()} >= set(left)
    assert os.path.isdir(run_dir)
    capsys.readouterr()
    main(["status", dep_id])  # no live deployment has that id: only what is left is listed
    listed = capsys.readouterr().err
    for path in left:
        assert f"residue: {path} (writer pid" in listed, listed
    with launched("--mode", "local", "--model", "tiny", "--num-blocks", "64", registry=reg,
                  log_path=str(tmp_path / "second.log")):
        assert lifecycle.shm_leftovers(dep_id) == []
        assert not os.path.exists(run_dir)
    log = open(tmp_path / "second.log").read()
    assert f"removed dead deployment {dep_id}" in log, log[-2000:]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_parent_death_signal_is_what_the_kernel_holds(sig):
    """The one prctl both the supervisor's children (SIGKILL) and the vLLM writer (SIGTERM) use;
    read back with PR_GET_PDEATHSIG in a child of its own, so this test process keeps none."""
    code = ("import ctypes, sys\n"
            "from pushkv.supervisor.lifecycle import _LIBC, parent_death_signal\n"
            f"assert parent_death_signal({int(sig)})\n"
            "got = ctypes.c_int()\n"
            "assert _LIBC.prctl(2, ctypes.byref(got), 0, 0, 0) == 0\n"  # PR_GET_PDEATHSIG
            "print(got.value)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0 and out.stdout.strip() == str(int(sig)), out.stderr
