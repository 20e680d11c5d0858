"""Fault injection for tests: kill this process at a named protocol point.

With ``PUSHKV_FAULTS_DIR`` set, a process reaching point ``P`` SIGKILLs
itself if the file ``arm-<process name>-<P>`` exists there, removing it first
(so the restarted process does not fire again). A test arms one fault at a
time on a running deployment. Unset: one falsy check.
"""
from __future__ import annotations

import os
import signal

_DIR = os.environ.get("PUSHKV_FAULTS_DIR", "")


def arm(directory: str, process: str, point_name: str) -> str:
    path = os.path.join(directory, f"arm-{process}-{point_name}")
    open(path, "w").close()
    return path


def point(process: str, name: str) -> None:
    if not _DIR:
        return
    try:
        os.unlink(os.path.join(_DIR, f"arm-{process}-{name}"))
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
