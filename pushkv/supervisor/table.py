"""The process table: one row per child, a transition table, restart policy.

Pure: no sockets, no processes, no clock reads (``now`` comes in). An
illegal event raises ``IllegalTransition`` naming state and event and leaves
the row unchanged.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from pushkv import messages as m
from pushkv.supervisor.plan import ProcessSpec

HEALTH_TIMEOUT_S = 10.0  # no Pong for this long: reported unhealthy


class State(str, enum.Enum):
    NEW = "NEW"  # planned, not spawned
    STARTED = "STARTED"  # spawned, no Ready yet
    READY = "READY"  # sent Ready
    STOPPING = "STOPPING"  # asked to stop (Shutdown / signal)
    EXITED = "EXITED"  # reaped


class Event(str, enum.Enum):
    SPAWNED = "spawned"
    READY = "ready"
    STOP = "stop"
    EXITED = "exited"


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.NEW, Event.SPAWNED): State.STARTED,
    (State.EXITED, Event.SPAWNED): State.STARTED,  # restart
    (State.STARTED, Event.READY): State.READY,
    (State.STARTED, Event.STOP): State.STOPPING,
    (State.READY, Event.STOP): State.STOPPING,
    (State.STARTED, Event.EXITED): State.EXITED,
    (State.READY, Event.EXITED): State.EXITED,
    (State.STOPPING, Event.EXITED): State.EXITED,
}


class IllegalTransition(Exception):
    def __init__(self, name: str, state: State, event: Event):
        super().__init__(f"{name}: illegal event {event.value!r} in state {state.value}")
        self.name, self.state, self.event = name, state, event


@dataclass
class Row:
    spec: ProcessSpec
    state: State = State.NEW
    pid: int = 0
    started_at: float = 0.0  # monotonic, last spawn
    started_wall: float = 0.0  # wall clock, last spawn (for display)
    ready_at: float = 0.0
    restarts: int = 0
    restart_times: deque = field(default_factory=deque)  # monotonic
    last_pong: float = 0.0
    exit_code: Optional[int] = None  # last exit: >=0 code, <0 -signal; kept across a restart (status says why)
    identity: Optional[bytes] = None  # control socket identity of the live process
    ready: Optional[m.Ready] = None  # what the live process said when it got ready

    @property
    def name(self) -> str:
        return self.spec.name

    def healthy(self, now: float, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
        if self.state is not State.READY:
            return False
        last = max(self.last_pong, self.ready_at)
        return now - last <= timeout_s


class ProcessTable:
    def __init__(self, specs: list[ProcessSpec]):
        self.rows: dict[str, Row] = {s.name: Row(spec=s) for s in specs}

    def __getitem__(self, name: str) -> Row:
        return self.rows[name]

    def __iter__(self):
        return iter(self.rows.values())

    def get(self, name: str) -> Optional[Row]:
        return self.rows.get(name)

    def by_pid(self, pid: int) -> Optional[Row]:
        for row in self.rows.values():
            if row.pid == pid:
                return row
        return None

    def apply(self, name: str, event: Event) -> State:
        row = self.rows[name]
        new = TRANSITIONS.get((row.state, event))
        if new is None:
            raise IllegalTransition(name, row.state, event)
        row.state = new
        return new

    # -- recorded facts (each one transition plus its data) ----------------
    def spawned(self, name: str, pid: int, now: float, wall: float) -> None:
        row = self.rows[name]
        restart = row.state is State.EXITED
        self.apply(name, Event.SPAWNED)
        row.pid, row.started_at, row.started_wall = pid, now, wall
        row.identity, row.last_pong, row.ready_at, row.ready = None, 0.0, 0.0, None
        if restart:
            row.restarts += 1
            row.restart_times.append(now)

    def ready(self, name: str, identity: bytes, msg: m.Ready, now: float) -> None:
        row = self.rows[name]
        self.apply(name, Event.READY)
        row.identity, row.ready, row.ready_at, row.last_pong = identity, msg, now, now

    def exited(self, name: str, code: int) -> None:
        row = self.rows[name]
        self.apply(name, Event.EXITED)
        row.exit_code, row.identity = code, None

    def pong(self, name: str, now: float) -> None:
        self.rows[name].last_pong = now

    # -- queries ----------------------------------------------------------
    def in_state(self, *states: State) -> list[Row]:
        return [r for r in self.rows.values() if r.state in states]

    def alive(self) -> list[Row]:
        return self.in_state(State.STARTED, State.READY, State.STOPPING)

    def all_ready(self, stage: Optional[int] = None) -> bool:
        rows = [r for r in self.rows.values() if stage is None or r.spec.stage == stage]
        return all(r.state is State.READY for r in rows)


@dataclass(frozen=True)
class RestartPolicy:
    """At most ``max_restarts`` restarts of one child within ``window_s``."""

    max_restarts: int = 5
    window_s: float = 60.0

    def allows(self, row: Row, now: float) -> bool:
        while row.restart_times and now - row.restart_times[0] > self.window_s:
            row.restart_times.popleft()
        return len(row.restart_times) < self.max_restarts


def describe_exit(code: Optional[int]) -> str:
    import signal

    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
