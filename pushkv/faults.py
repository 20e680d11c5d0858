"""Fault injection for tests: kill this process at a named protocol point.

``PUSHKV_FAULTS="prefill-writer-0:post_write,decode-scheduler:after_alloc"``
makes the named process SIGKILL itself the first time it reaches that point.
``PUSHKV_FAULTS_DIR`` holds a marker per fired fault so a restarted process
does not fire again. Off (one dict lookup) when the variable is unset.
"""
from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("PUSHKV_FAULTS", "")
_FAULTS = {tuple(f.split(":", 1)) for f in _SPEC.split(",") if ":" in f}


def point(process: str, name: str) -> None:
    if not _FAULTS or (process, name) not in _FAULTS:
        return
    marker = os.path.join(os.environ.get("PUSHKV_FAULTS_DIR", "/tmp"), f"fault-{process}-{name}")
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # fired once already (this is the restarted process)
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)
