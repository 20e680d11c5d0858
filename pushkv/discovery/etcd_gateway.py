"""etcd's v3 JSON gateway, spoken over the HTTP clients the project already has.

``SyncGateway`` (http.client, one kept-alive connection; for the supervisor's sync loop) and
``AsyncGateway`` (aiohttp; for the router) make the same calls: a JSON POST to ``/v3/<path>``,
with the token from ``/v3/auth/authenticate`` as ``Authorization`` when the registry URL names a
user (renewed once when etcd says it expired). Errors map to ``EtcdUnavailable`` (cannot reach,
5xx: retry), ``EtcdAuthError`` (credentials or permissions: do not retry) and ``EtcdError``. The
watch is one streamed POST whose answer is one JSON object per line. Why the gateway and not a
gRPC client: ``etcd.py``.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import ssl
from typing import AsyncIterator, Optional, Union

from pushkv.discovery.etcd_keys import EtcdTarget, parse_registry_url

CALL_TIMEOUT_S = 1.0  # one gateway call; bounds how long a supervisor tick can block


class EtcdError(RuntimeError):
    """etcd answered with an error."""


class EtcdAuthError(EtcdError):
    """etcd refused our credentials (or needs some we were not given)."""


class EtcdUnavailable(EtcdError):
    """etcd could not be reached (connection refused, timed out, reset, or 5xx)."""


def target_of(url: Union[str, EtcdTarget]) -> EtcdTarget:
    return url if isinstance(url, EtcdTarget) else parse_registry_url(url)


def ssl_context(t: EtcdTarget) -> Optional[ssl.SSLContext]:
    if not t.tls:
        return None
    ctx = ssl.create_default_context(cafile=t.ca_file or None)
    if t.cert_file:
        ctx.load_cert_chain(t.cert_file, t.key_file or None)
    return ctx


def _check(status: int, body: bytes, path: str) -> dict:
    """The decoded answer, or the error it carries as an exception."""
    try:
        got = json.loads(body or b"{}")
    except ValueError:
        got = {"message": body[:200].decode(errors="replace")}
    if status < 300 and "error" not in got:
        return got
    err = got.get("error")
    msg = got.get("message") or (err.get("message") if isinstance(err, dict) else err) or str(status)
    if status >= 500:
        raise EtcdUnavailable(f"etcd {path}: {status} {msg}")
    if "authentication failed" in msg or "user name is empty" in msg or "invalid auth token" in msg \
            or "permission denied" in msg or status == 401:
        raise EtcdAuthError(f"etcd {path}: {msg}")
    raise EtcdError(f"etcd {path}: {status} {msg}")


def auth_error(t: EtcdTarget, e: EtcdAuthError) -> EtcdAuthError:
    who = f"user {t.user!r}" if t.user else "no user (give user:password in the registry URL)"
    return EtcdAuthError(f"etcd at {t.redacted()} refused {who}: {e}")


class SyncGateway:
    """Blocking gateway calls over one kept-alive http.client connection."""

    def __init__(self, target: EtcdTarget, timeout_s: float = CALL_TIMEOUT_S):
        self.t, self.timeout_s = target, timeout_s
        self._conn: Optional[http.client.HTTPConnection] = None
        self._token = ""

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self.t.tls:
                self._conn = http.client.HTTPSConnection(self.t.host, self.t.port, timeout=self.timeout_s,
                                                         context=ssl_context(self.t))
            else:
                self._conn = http.client.HTTPConnection(self.t.host, self.t.port, timeout=self.timeout_s)
        return self._conn

    def _post(self, path: str, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = self._token
        for attempt in (0, 1):
            reused = self._conn is not None
            try:
                conn = self._connection()
                conn.request("POST", f"/v3/{path}", json.dumps(body), headers)
                resp = conn.getresponse()
                status, data = resp.status, resp.read()
                break
            except (OSError, http.client.HTTPException) as e:
                self.drop()
                stale = reused and isinstance(e, ConnectionError)
                if attempt or not stale:  # a kept-alive connection the server closed: once more
                    raise EtcdUnavailable(f"etcd {self.t.base_url} {path}: {e!r}") from None
        return _check(status, data, path)

    def authenticate(self) -> None:
        if not self.t.user:
            return
        self._token = ""
        try:
            got = self._post("auth/authenticate", {"name": self.t.user, "password": self.t.password})
        except EtcdAuthError as e:
            raise auth_error(self.t, e) from None
        self._token = got["token"]

    def call(self, path: str, body: dict) -> dict:
        if self.t.user and not self._token:
            self.authenticate()
        try:
            return self._post(path, body)
        except EtcdAuthError as e:
            if "invalid auth token" not in str(e) or not self.t.user:
                raise auth_error(self.t, e) from None
            self.authenticate()  # the token expired: once more with a fresh one
            return self._post(path, body)

    def drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class AsyncGateway:
    """Gateway calls and the watch stream over one aiohttp session."""

    def __init__(self, target: EtcdTarget, timeout_s: float = CALL_TIMEOUT_S * 5):
        import aiohttp

        self.t, self.timeout_s, self._aiohttp = target, timeout_s, aiohttp
        self._session: Optional["aiohttp.ClientSession"] = None
        self._token = ""
        self._ssl = ssl_context(target)

    def _sess(self):
        if self._session is None:
            self._session = self._aiohttp.ClientSession()
        return self._session

    def _headers(self) -> dict:
        return {"Authorization": self._token} if self._token else {}

    async def _post(self, path: str, body: dict) -> dict:
        a = self._aiohttp
        try:
            async with self._sess().post(f"{self.t.base_url}/v3/{path}", json=body,
                                         headers=self._headers(), ssl=self._ssl,
                                         timeout=a.ClientTimeout(total=self.timeout_s)) as r:
                status, data = r.status, await r.read()
        except (a.ClientError, asyncio.TimeoutError, OSError) as e:
            raise EtcdUnavailable(f"etcd {self.t.base_url} {path}: {e!r}") from None
        return _check(status, data, path)

    async def authenticate(self) -> None:
        if not self.t.user:
            return
        self._token = ""
        try:
            got = await self._post("auth/authenticate", {"name": self.t.user, "password": self.t.password})
        except EtcdAuthError as e:
            raise auth_error(self.t, e) from None
        self._token = got["token"]

    async def call(self, path: str, body: dict) -> dict:
        if self.t.user and not self._token:
            await self.authenticate()
        try:
            return await self._post(path, body)
        except EtcdAuthError as e:
            if "invalid auth token" not in str(e) or not self.t.user:
                raise auth_error(self.t, e) from None
            await self.authenticate()
            return await self._post(path, body)

    async def watch(self, body: dict, idle_s: float) -> AsyncIterator[dict]:
        """Each JSON object of one watch stream; ends quietly when the stream is idle
        ``idle_s``; raises EtcdUnavailable when it breaks."""
        a = self._aiohttp
        if self.t.user and not self._token:
            await self.authenticate()
        # sock_read: a backstop for a server that accepts and then never answers the headers
        timeout = a.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=idle_s + self.timeout_s)
        try:
            async with self._sess().post(f"{self.t.base_url}/v3/watch", json=body, headers=self._headers(),
                                         ssl=self._ssl, timeout=timeout) as r:
                if r.status != 200:
                    _check(r.status, await r.read(), "watch")
                buf = b""
                it = r.content.iter_any().__aiter__()
                while True:
                    try:
                        async with asyncio.timeout(idle_s):
                            chunk = await it.__anext__()
                    except TimeoutError:
                        return
                    except StopAsyncIteration:
                        raise EtcdUnavailable("etcd watch stream ended") from None
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield json.loads(line)
        except (a.ClientError, OSError, ValueError) as e:
            raise EtcdUnavailable(f"etcd watch: {e!r}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
