"""Supervisor control commands.

One small class per command; its docstring is the help text. Commands run
against a ``CommandContext`` (the process table plus a few requests), never
against sockets, so tests use a fake context. Every reply carries a status.

Wire (types in ``pushkv.messages``): a plain REQ client sends ``ControlCommand``
to the supervisor's control ROUTER (the same socket children send
``Ready``/``Pong`` on) and receives a ``ControlReply``. Lifecycle events go out
on the events PUB socket as two frames: topic (``pushkv.decode.writer.exit``)
and a ``LifecycleEvent``.
"""
from __future__ import annotations

from typing import Optional, Protocol

import zmq

from pushkv import limits
from pushkv import messages as m
from pushkv.supervisor.table import ProcessTable, Row, State, describe_exit

OK = "ok"
ERROR = "error"


class CommandContext(Protocol):
    table: ProcessTable

    def deployment_info(self) -> dict[str, str]: ...

    def request_stop(self, reason: str) -> None: ...

    def request_restart(self, name: str, reason: str) -> Optional[str]:
        """Returns an error text, or None when the restart was scheduled."""


def process_info(row: Row, now: float) -> m.ProcessInfo:
    alive = row.state in (State.STARTED, State.READY, State.STOPPING)
    return m.ProcessInfo(
        name=row.name, kind=row.spec.kind, role=row.spec.role, rank=row.spec.rank,
        pid=row.pid if alive else 0, state=row.state.value,
        uptime_s=round(now - row.started_at, 3) if alive else 0.0,
        restarts=row.restarts, healthy=row.healthy(now),
        last_pong_age_s=round(now - row.last_pong, 3) if row.last_pong else -1.0,
        last_exit=describe_exit(row.exit_code), instance=row.spec.instance,
    )


class Command:
    name = ""

    def execute(self, ctx: CommandContext, args: dict[str, str], now: float) -> m.ControlReply:
        raise NotImplementedError

    def ok(self, **kw) -> m.ControlReply:
        return m.ControlReply(command=self.name, status=OK, **kw)

    def error(self, reason: str) -> m.ControlReply:
        return m.ControlReply(command=self.name, status=ERROR, reason=reason)


class StatusCommand(Command):
    """Show every process: name, pid, state, uptime, restarts, health.

    args: ``name`` (optional) limits the answer to one process.
    """

    name = "status"

    def execute(self, ctx, args, now):
        rows = list(ctx.table)
        if "name" in args:
            row = ctx.table.get(args["name"])
            if row is None:
                return self.error(f"no process named {args['name']!r}")
            rows = [row]
        return self.ok(processes=tuple(process_info(r, now) for r in rows), info=ctx.deployment_info())


class InfoCommand(Command):
    """Show the deployment: id, mode, router URL, run dir, endpoints, supervisor pid."""

    name = "info"

    def execute(self, ctx, args, now):
        return self.ok(info=ctx.deployment_info())


class StopCommand(Command):
    """Stop the whole deployment (children, shared memory, run dir) and the supervisor."""

    name = "stop"

    def execute(self, ctx, args, now):
        ctx.request_stop(args.get("reason", "stop command"))
        return self.ok(info=ctx.deployment_info())


class RestartCommand(Command):
    """Restart one process by name (args: ``name``); it is killed and spawned again."""

    name = "restart"

    def execute(self, ctx, args, now):
        name = args.get("name", "")
        if ctx.table.get(name) is None:
            return self.error(f"no process named {name!r}")
        err = ctx.request_restart(name, args.get("reason", "restart command"))
        return self.error(err) if err else self.ok()


class HelpCommand(Command):
    """List the commands with their help text."""

    name = "help"

    def execute(self, ctx, args, now):
        return self.ok(info={c.name: help_text(c) for c in COMMANDS.values()})


def help_text(cmd: Command) -> str:
    return " ".join((type(cmd).__doc__ or "").split())


COMMANDS: dict[str, Command] = {
    c.name: c for c in (StatusCommand(), InfoCommand(), StopCommand(), RestartCommand(), HelpCommand())
}


def dispatch(ctx: CommandContext, req: m.ControlCommand, now: float) -> m.ControlReply:
    """Run one command; a command that raises answers with its error."""
    cmd = COMMANDS.get(req.command)
    if cmd is None:
        return m.ControlReply(command=req.command, status=ERROR,
                            reason=f"unknown command {req.command!r}; known: {sorted(COMMANDS)}")
    try:
        return cmd.execute(ctx, dict(req.args), now)
    except Exception as e:  # answer the caller instead of dropping the request
        return m.ControlReply(command=req.command, status=ERROR, reason=f"{type(e).__name__}: {e}")


def ask(endpoint: str, command: str, args: Optional[dict[str, str]] = None, timeout_s: float = 3.0) -> m.ControlReply:
    """Client side: one request on a fresh REQ socket. Raises TimeoutError."""
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.CONTROL_MSG_BYTES)
    try:
        sock.connect(endpoint)
        sock.send(m.encode(m.ControlCommand(command=command, args=args or {})))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from supervisor at {endpoint} within {timeout_s:.1f} s")
        return m.DEC_REPLY.decode(sock.recv())
    finally:
        sock.close(0)
