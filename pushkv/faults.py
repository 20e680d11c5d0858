"""Fault injection for tests: kill this process at a named protocol point, or stall it.

With ``PUSHKV_FAULTS_DIR`` set, a process reaching point ``P`` SIGKILLs
itself if the file ``arm-<process name>-<P>`` exists there, removing it first
(so the restarted process does not fire again). A test arms one fault at a
time on a running deployment. Unset: one falsy check.

``fire(process, P)`` is the kind that corrupts instead of killing: True once
after ``arm_fire`` (file ``fire-<process name>-<P>``), for a writer to damage the
KV it moves (flip a byte, post fewer bytes, swap two destinations) so that a
test can see ``--kv-verify`` catch it.

``delay(process, P)`` is the other kind: the seconds written in
``delay-<process name>-<P>`` (removed as it is read), for the process to hold
back there without blocking its loop (D's scheduler: admit nothing and run no
step that long, as a long READ ahead in the queue would).
"""
from __future__ import annotations

import os
import signal

from pushkv import envs

_DIR = envs.get("PUSHKV_FAULTS_DIR")


def _arm(directory: str, kind: str, process: str, point_name: str) -> str:
    path = os.path.join(directory, f"{kind}-{process}-{point_name}")
    open(path, "w").close()
    return path


def _take(kind: str, process: str, name: str) -> bool:
    """True once if ``<kind>-<process>-<name>`` was armed (removed as it is taken)."""
    if not _DIR:
        return False
    try:
        os.unlink(os.path.join(_DIR, f"{kind}-{process}-{name}"))
    except FileNotFoundError:
        return False
    return True


def arm(directory: str, process: str, point_name: str) -> str:
    return _arm(directory, "arm", process, point_name)


def point(process: str, name: str) -> None:
    if armed(process, name):
        kill_self()


def armed(process: str, name: str) -> bool:
    """True once if point ``name`` was armed for ``process`` (removed as it is read): a caller
    that cannot die where it stands (the scheduler core, which has messages to hand over first)
    asks this and has its shell call ``kill_self``."""
    return _take("arm", process, name)


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm_delay(directory: str, process: str, point_name: str, seconds: float) -> str:
    path = os.path.join(directory, f"delay-{process}-{point_name}")
    with open(path + ".tmp", "w") as f:
        f.write(repr(float(seconds)))
    os.replace(path + ".tmp", path)  # never seen half-written
    return path


def delay(process: str, name: str) -> float:
    """Seconds to hold back at point ``name`` once (0.0: not armed)."""
    if not _DIR:
        return 0.0
    path = os.path.join(_DIR, f"delay-{process}-{name}")
    try:
        with open(path) as f:
            text = f.read()
        os.unlink(path)
    except FileNotFoundError:
        return 0.0
    return float(text)


def arm_fire(directory: str, process: str, point_name: str) -> str:
    return _arm(directory, "fire", process, point_name)


def fire(process: str, name: str) -> bool:
    """True once if ``fire-<process>-<name>`` was armed (removed as it fires)."""
    return _take("fire", process, name)
