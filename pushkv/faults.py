"""Fault injection for tests: kill a process at a named protocol point, stall it, or have it damage
the KV it moves.

A process's faults are one ``Faults`` object made at its start (``from_env``: ``PUSHKV_FAULTS_DIR``,
read once) and injected where they act; without that variable there is no object, and the product's
paths hold no fault check. A test arms one fault at a time on a running deployment, as a file in
that directory:

- ``arm-<process>-<P>``: the process SIGKILLs itself at point ``P`` (``point``), or, where it cannot
  die where it stands (the scheduler, which has messages to hand over first), its shell's filter on
  the core's effects kills it after the effect that marks ``P`` (``scheduler/fault_filter.py``);
- ``fire-<process>-<P>``: ``fire`` is True once, for a writer or worker to damage the KV it moves
  (flip a byte, post fewer bytes, swap two destinations) so that a test sees ``--kv-verify`` catch it;
- ``delay-<process>-<P>``: the seconds written there (``delay``), for the process to hold back
  without blocking its loop (D's scheduler, ``admit``: admit nothing and run no step that long, as a
  long READ ahead in the queue would; P's writer, ``hold``: handle the next ``HoldKV`` that late, so
  D's ``ReadDone`` comes first).

Each file is removed as it is taken, so a restarted process does not fire again. One is not:

- ``hold-<process>-stage_out``: the seconds written there (``copy_hold_s``, read once at the
  writer's start) each copy into its staging area is reported still running after it was issued.
  A CPU pool's copy is done when it is issued; with this, P's writer on the CPU meets what a GPU's
  copy stream makes it do (a WRITE, a last WRITE among them, waiting for its bytes).
"""
from __future__ import annotations

import os
import signal
from functools import cache
from typing import Any, Callable, Optional

from pushkv import envs


class Faults:
    """The armed points of one process (``process``: its name, as the files spell it)."""

    def __init__(self, directory: str, process: str):
        self.directory = directory
        self.process = process

    def _take(self, kind: str, name: str) -> bool:
        try:
            os.unlink(os.path.join(self.directory, f"{kind}-{self.process}-{name}"))
        except FileNotFoundError:
            return False
        return True

    def armed(self, name: str) -> bool:
        """True once if point ``name`` was armed (removed as it is read)."""
        return self._take("arm", name)

    def point(self, name: str) -> None:
        """Die here if point ``name`` was armed."""
        if self.armed(name):
            kill_self()

    def before(self, name: str, handler: Callable[..., Any]) -> Callable[..., Any]:
        """``handler`` with point ``name`` at its start: wired once at start, so that a process without
        faults runs the bare handler."""

        def at_point(*args: Any, **kw: Any) -> Any:
            self.point(name)
            return handler(*args, **kw)

        return at_point

    def fire(self, name: str) -> bool:
        """True once if ``fire-<process>-<name>`` was armed (removed as it fires)."""
        return self._take("fire", name)

    def delay(self, name: str) -> float:
        """Seconds to hold back at point ``name`` once (0.0: not armed)."""
        path = os.path.join(self.directory, f"delay-{self.process}-{name}")
        try:
            with open(path) as f:
                text = f.read()
            os.unlink(path)
        except FileNotFoundError:
            return 0.0
        return float(text)

    def copy_hold_s(self) -> float:
        """Seconds each staging copy is reported running after its issue (0.0: not armed; not removed)."""
        try:
            with open(os.path.join(self.directory, f"hold-{self.process}-stage_out")) as f:
                return float(f.read())
        except FileNotFoundError:
            return 0.0


def from_env(process: str) -> Optional[Faults]:
    """``process``'s faults when ``PUSHKV_FAULTS_DIR`` is set, else None: called once, at its start."""
    directory = envs.PUSHKV_FAULTS_DIR
    return Faults(directory, process) if directory else None


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# -- the test's side: arming --------------------------------------------------------------------
def _arm(directory: str, kind: str, process: str, point_name: str) -> str:
    path = os.path.join(directory, f"{kind}-{process}-{point_name}")
    open(path, "w").close()
    return path


def arm(directory: str, process: str, point_name: str) -> str:
    return _arm(directory, "arm", process, point_name)


def arm_fire(directory: str, process: str, point_name: str) -> str:
    return _arm(directory, "fire", process, point_name)


def _arm_seconds(directory: str, kind: str, process: str, point_name: str, seconds: float) -> str:
    path = os.path.join(directory, f"{kind}-{process}-{point_name}")
    with open(path + ".tmp", "w") as f:
        f.write(repr(float(seconds)))
    os.replace(path + ".tmp", path)  # never seen half-written
    return path


def arm_delay(directory: str, process: str, point_name: str, seconds: float) -> str:
    return _arm_seconds(directory, "delay", process, point_name, seconds)


def arm_copy_hold(directory: str, process: str, seconds: float) -> str:
    return _arm_seconds(directory, "hold", process, "stage_out", seconds)


# -- by process name: the writers' kill points (their KV damage is injected: writer/kv_damage.py) ---
@cache
def _dir() -> str:
    return envs.PUSHKV_FAULTS_DIR  # read once per process


def point(process: str, name: str) -> None:
    if _dir():
        Faults(_dir(), process).point(name)


def delay(process: str, name: str) -> float:
    """Seconds ``delay-<process>-<name>`` asks to hold back once (0.0: not armed, or no faults)."""
    return Faults(_dir(), process).delay(name) if _dir() else 0.0
