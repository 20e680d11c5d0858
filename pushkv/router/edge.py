"""The router's HTTP edge: what bounds a client before a handler runs.

- **Header read timeout.** aiohttp closes a connection whose request is not complete when its
  keep-alive timer fires, and that timer starts at the connection's accept; so
  ``keepalive_timeout`` = the header timeout (``router_header_timeout_s``, 10 s) bounds both an idle
  keep-alive connection and one that sends its headers a byte at a time (slowloris).
- **Body read timeout.** ``read_body`` gives a request whose headers arrived
  ``router_body_timeout_s`` (30 s) for its body, then answers 408.
- **A connection cap.** ``CappedSite`` serves at most ``cap`` connections; one past it gets a 503
  with ``Retry-After`` and is closed at once, before any parsing. The cap is also kept under the
  open-file limit, which ``raise_fd_limit`` lifts from its soft value to its hard one at start
  (1,024 by default on many systems: 1,100 half-sent connections took the port before).
- **Logs that a flood cannot amplify.** ``OncePerInterval`` lets one line per kind through per
  interval, without the traceback, and says how many it held back: aiohttp logged a traceback per
  malformed request, and asyncio one per failed accept (245 MB in 100 s under a slowloris).
"""
from __future__ import annotations

import asyncio
import logging
import os
import resource
import ssl
import time
from typing import Any, Callable, Optional

from aiohttp import web

from pushkv import uds
from pushkv.router import api

log = logging.getLogger(__name__)

FD_RESERVE = 256  # open files kept for the router's own use (ZMQ sockets, logs) under the limit
BACKLOG = 1024  # the accept queue: a burst of connections waits there instead of being dropped
LOG_INTERVAL_S = 10.0
NOISY_LOGGERS = ("aiohttp.server", "asyncio")  # per-request tracebacks, failed accepts
_FULL_BODY = (b'{"error": {"message": "too many connections", "type": "service_unavailable", "param": null, '
              b'"code": 503}}\n')
FULL_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(_FULL_BODY) + _FULL_BODY)


def raise_fd_limit() -> tuple[int, int]:
    """Lift RLIMIT_NOFILE's soft limit to the hard one; (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, e)
            return soft, soft
        return soft, hard
    return soft, soft


def connection_cap(wanted: int, fd_limit: int) -> int:
    """The connections the router serves at once: ``wanted``, kept ``FD_RESERVE`` under the limit."""
    return max(1, min(wanted, fd_limit - FD_RESERVE))


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise api.ApiError(408, f"request body not received within {timeout_s:.0f}s") from None


class _Refuse(asyncio.Protocol):
    """A connection past the cap: a 503 and closed, nothing read."""

    def connection_made(self, transport: Any) -> None:
        transport.write(FULL_RESPONSE)
        transport.close()


class _Counted(asyncio.Protocol):
    """aiohttp's handler, counted from its creation to its connection's end: aiohttp's own list
    of connections grows only once a connection is made, after a whole batch of accepts has
    been handed handlers, so it lags behind exactly when a burst arrives."""

    __slots__ = ("inner", "site")

    def __init__(self, inner: Any, site: "CappedSite"):
        self.inner, self.site = inner, site

    def connection_made(self, transport: Any) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.site.live -= 1
        self.inner.connection_lost(exc)


class CappedSite(web.TCPSite):
    """aiohttp's TCPSite, whose protocol factory refuses connections past ``cap``; with ``path``, on that Unix
    domain socket instead of host:port (``uds``: a stale socket file replaced, a live one refused, the file made
    ``uds.PERMS`` and removed at stop)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, cap: int,
                 on_refused: Callable[[], None], backlog: int = BACKLOG, ssl_context: Optional[ssl.SSLContext] = None,
                 path: str = ""):
        super().__init__(runner, host, port, backlog=backlog, ssl_context=ssl_context)
        self.path = path
        self._inode = 0
        self.cap = cap
        self.on_refused = on_refused
        self.live = 0  # connections handed to aiohttp and not yet lost
        self.refused = 0

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        assert server is not None
        if self.live >= self.cap:
            self.refused += 1
            self.on_refused()
            if self.refused == 1 or self.refused % 1000 == 0:
                log.warning("connection cap %d reached: refusing with 503 (refused so far: %d)", self.cap,
                            self.refused)
            return _Refuse()
        self.live += 1
        return _Counted(server(), self)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner (TCPSite.start's first step)
        loop = asyncio.get_running_loop()
        if self.path:
            uds.claim(self.path)
            self._server = await loop.create_unix_server(self._protocol, self.path, backlog=self._backlog)
            os.chmod(self.path, uds.PERMS)
            self._inode = os.lstat(self.path).st_ino
            return
        self._server = await loop.create_server(
            self._protocol, self._host, self._port, backlog=self._backlog, reuse_address=self._reuse_address,
            reuse_port=self._reuse_port, ssl=self._ssl_context)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port

    async def stop(self) -> None:
        await super().stop()
        if self.path and self._inode:
            uds.release(self.path, self._inode)


class OncePerInterval(logging.Filter):
    """One record per (logger, message template) per ``interval_s``, its traceback cut to the
    exception's one line; the next one let through says how many were held back."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self._last: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        self._last[key] = now
        text = record.getMessage()
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            text += f": {type(exc).__name__}: {exc}"
        held = self._held.pop(key, 0)
        if held:
            text += f" ({held} more like it in the last {self.interval_s:.0f}s, not logged)"
        record.msg, record.args, record.exc_info, record.exc_text = text, (), None, None
        return True


def quiet_noisy_loggers(interval_s: float = LOG_INTERVAL_S) -> Optional[OncePerInterval]:
    """Put one ``OncePerInterval`` on aiohttp's server logger and asyncio's (once)."""
    f = OncePerInterval(interval_s)
    for name in NOISY_LOGGERS:
        lg = logging.getLogger(name)
        if any(isinstance(x, OncePerInterval) for x in lg.filters):
            return None
        lg.addFilter(f)
    return f
