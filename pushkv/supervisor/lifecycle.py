"""OS-level process handling: spawn, watch, stop, reap, clean up.

Children die with the supervisor (PR_SET_PDEATHSIG=SIGKILL). Exits are
watched through pidfds so they sit in the same poller as the sockets.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

from pushkv.config import SHM_DIR, shm_prefix
from pushkv.security import API_KEY_ENV

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before fork: preexec_fn must not import


def parent_death_signal(sig: int) -> bool:
    """This process gets ``sig`` when its parent dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG);
    False when the kernel refuses. Imports nothing: it runs between fork and exec too."""
    return _LIBC.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def _die_with_parent(parent_pid: int) -> None:
    """Runs in the child between fork and exec."""
    if not parent_death_signal(signal.SIGKILL):
        os._exit(127)
    if os.getppid() != parent_pid:  # parent died before prctl took effect
        os._exit(127)
    # in a process group of its own the child is a background job of our terminal: where it has TOSTOP set (`stty
    # tostop`) its first log line would stop it (SIGTTOU) and the deployment with it; ignored, the write goes through
    # (the disposition outlives exec, and Python leaves it)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)


# the environment variables that hold a secret, and which kinds of child read each: a child gets
# only those it uses (a worker that never sees the API key cannot leak it, through a crash dump,
# a profiler or /proc/PID/environ)
SECRET_VARS = (API_KEY_ENV,)


def secrets_used(kind: str, metrics_auth: bool) -> frozenset[str]:
    """The secret variables a child of ``kind`` reads: the router the API key, and the schedulers
    too when their /metrics sits behind it."""
    if kind == "router" or (kind == "scheduler" and metrics_auth):
        return frozenset({API_KEY_ENV})
    return frozenset()


def child_env(name: str, deployment_id: str, base: Optional[dict] = None, kind: str = "",
              metrics_auth: bool = False) -> dict[str, str]:
    """The environment of child ``name`` of ``kind``: ours, less the secrets it does not use."""
    env = dict(os.environ if base is None else base)
    for var in set(SECRET_VARS) - secrets_used(kind, metrics_auth):
        env.pop(var, None)
    env["PUSHKV_NAME"] = name
    env["PUSHKV_DEPLOYMENT_ID"] = deployment_id
    env["PYTHONUNBUFFERED"] = "1"
    return env


def spawn(argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
    """Start a child; its stdout goes to our stderr so our stdout stays parseable. It gets a process group of its
    own: a terminal's Ctrl-C (SIGINT to the foreground group) reaches only the supervisor, which stops the children
    in order (the router first, draining for --shutdown-timeout), instead of every child stopping on its own at once
    (a scheduler gone before the router, its requests ending 'scheduler shutting down')."""
    parent = os.getpid()
    return subprocess.Popen(
        list(argv), env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
        close_fds=True, preexec_fn=lambda: _die_with_parent(parent), process_group=0,
    )


def signal_child(proc: subprocess.Popen, sig: int) -> None:
    if proc.returncode is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def stop_all(procs: Sequence[subprocess.Popen], grace_s: float, deadline_s: float) -> list[subprocess.Popen]:
    """Wait ``grace_s`` for voluntary exits, SIGTERM, wait to ``deadline_s``
    (one deadline for all), SIGKILL the rest, reap. Returns the killed ones."""
    start = time.monotonic()
    _join(procs, start + grace_s)
    for p in procs:
        signal_child(p, signal.SIGTERM)
    _join(procs, start + deadline_s)
    killed = [p for p in procs if p.returncode is None]
    for p in killed:
        signal_child(p, signal.SIGKILL)
    for p in killed:
        p.wait()
    return killed


def _join(procs: Sequence[subprocess.Popen], deadline: float) -> None:
    for p in procs:
        left = deadline - time.monotonic()
        try:
            p.wait(timeout=max(left, 0.0))
        except subprocess.TimeoutExpired:
            pass


def shm_leftovers(deployment_id: str, shm_dir: str = SHM_DIR) -> list[str]:
    if not deployment_id:
        return []
    return sorted(glob.glob(os.path.join(shm_dir, glob.escape(shm_prefix(deployment_id)) + "*")))


def cleanup(deployment_id: str, run_dir: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the deployment's shared memory and delete its run dir."""
    removed = []
    for path in shm_leftovers(deployment_id, shm_dir):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.error("could not unlink %s: %s", path, e)
    if removed:
        log.info("unlinked %d leftover shared memory segment(s): %s", len(removed), " ".join(removed))
    if run_dir and os.path.isdir(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)
    return removed


def cleanup_instance_shm(deployment_id: str, role: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink one instance's pool segments (its writers are dead or about to be replaced)."""
    removed = []
    for path in shm_leftovers(deployment_id, shm_dir):
        if os.path.basename(path).startswith(shm_prefix(deployment_id, role)):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    if removed:
        log.info("unlinked orphaned pool segment(s): %s", " ".join(removed))
    return removed


def residue(shm_dir: str = SHM_DIR) -> list[tuple[str, str]]:
    """This user's pool segments whose writer is dead (a host killed outright, kill -9, leaves
    them, and with them the memory they hold): (path, why). A segment is named
    ``pushkv-<deployment>-<instance>-<rank>-<writer pid>`` (config.shm_name); one whose writer
    lives, or that another user owns, is never listed."""
    out = []
    for path in sorted(glob.glob(os.path.join(shm_dir, "pushkv-*"))):
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except FileNotFoundError:
            continue
        pid = os.path.basename(path).rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            out.append((path, f"writer pid {pid} is gone"))
    return out


def sweep_residue(shm_dir: str = SHM_DIR) -> list[tuple[str, str]]:
    """Unlink ``residue()``; returns what was removed."""
    removed = []
    for path, why in residue(shm_dir):
        try:
            os.unlink(path)
            removed.append((path, why))
        except FileNotFoundError:
            pass
    return removed


def read_cpu_seconds(pid: int) -> float:
    """The CPU time (user and system, seconds) process ``pid`` has used, from /proc (OSError where it is gone)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (stat's 14th, 15th)


def cpu_seconds(pid: int) -> float:
    """``read_cpu_seconds``, or -1.0 where it cannot be read (gone, or no /proc)."""
    try:
        return read_cpu_seconds(pid)
    except (OSError, IndexError, ValueError):
        return -1.0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_our_supervisor(pid: int, deployment_id: str) -> bool:
    """Whether ``pid`` is, now, a process of our uid titled as the supervisor of ``deployment_id``
    (processes/cli.py sets ``pushkv supervisor <id>``): a pid from a record is signalled only then,
    never one that was reused by another process or that a record merely names."""
    if pid <= 1 or not deployment_id:
        return False
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").split()
    except OSError:  # gone, or not ours to read
        return False
    return cmdline[:3] == ["pushkv", "supervisor", deployment_id]


def wait_pid_exit(pid: int, timeout_s: float) -> bool:
    """Wait for any process (not only our child) to exit, via a pidfd."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)
