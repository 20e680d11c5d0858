"""Cross-origin requests, answered as vLLM's server answers them: its CORS middleware with its flags
(``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers``, ``--allow-credentials``) and their defaults (every
origin, method and header; no credentials), so a browser page that calls a vLLM server calls the router alike.

- A preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered here, before the API
  key's check and the routes: 200 with what may be sent, or 400 naming what is not allowed.
- Any other request with an allowed ``Origin`` gets ``Access-Control-Allow-Origin`` (and ``-Credentials``) on its
  response, streamed ones included (added as its headers go out); a request without ``Origin`` gets nothing.

The decisions are pure functions of the policy and the request's headers; ``middleware`` and ``on_prepare`` are the
aiohttp shells."""
from __future__ import annotations

from typing import Awaitable, Callable, Mapping, NamedTuple

from aiohttp import web

METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
# the headers a browser may always send (CORS's safelisted request headers)
SAFELISTED = ("Accept", "Accept-Language", "Content-Language", "Content-Type")
MAX_AGE_S = 600


class Policy(NamedTuple):
    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def allows(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins


def _origin_headers(policy: Policy, origin: str) -> dict[str, str]:
    if "*" in policy.origins and not policy.credentials:
        out = {"Access-Control-Allow-Origin": "*"}
    else:  # a named origin, or every origin with credentials (where "*" is not allowed): the request's own
        out = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if policy.credentials:
        out["Access-Control-Allow-Credentials"] = "true"
    return out


def response_headers(policy: Policy, headers: Mapping[str, str]) -> dict[str, str]:
    """What a (non-preflight) response gets for a request with these headers: nothing without an allowed Origin."""
    origin = headers.get("Origin")
    if not origin or not policy.allows(origin):
        return {}
    return _origin_headers(policy, origin)


def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
    return method == "OPTIONS" and "Origin" in headers and "Access-Control-Request-Method" in headers


def preflight(policy: Policy, headers: Mapping[str, str]) -> tuple[int, dict[str, str], str]:
    """A preflight's answer: (status, headers, body)."""
    origin = headers["Origin"]
    method = headers["Access-Control-Request-Method"]
    asked = [h.strip() for h in headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
    refused = []
    if not policy.allows(origin):
        refused.append("origin")
    if "*" not in policy.methods and method not in policy.methods:
        refused.append("method")
    allowed = {h.lower() for h in (*policy.headers, *SAFELISTED)}
    if "*" not in policy.headers and any(h.lower() not in allowed for h in asked):
        refused.append("headers")
    out = {"Access-Control-Allow-Methods": ", ".join(METHODS if "*" in policy.methods else policy.methods),
           "Access-Control-Max-Age": str(MAX_AGE_S), "Vary": "Origin"}
    out["Access-Control-Allow-Headers"] = (", ".join(asked) if "*" in policy.headers
                                           else ", ".join(sorted({*policy.headers, *SAFELISTED})))
    if refused:
        return 400, out, "Disallowed CORS " + ", ".join(refused)
    out.update({k: v for k, v in _origin_headers(policy, origin).items() if k != "Vary"})
    return 200, out, "OK"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def middleware(policy: Policy):
    """aiohttp middleware answering preflights (before the routes and the API key's check)."""

    @web.middleware
    async def cors(request: web.Request, handler: Handler) -> web.StreamResponse:
        if is_preflight(request.method, request.headers):
            status, headers, body = preflight(policy, request.headers)
            return web.Response(status=status, headers=headers, text=body)
        return await handler(request)

    return cors


def on_prepare(policy: Policy):
    """aiohttp's on_response_prepare hook: a response's CORS headers, added as its headers go out."""

    async def add(request: web.Request, response: web.StreamResponse) -> None:
        for k, v in response_headers(policy, request.headers).items():
            if k == "Vary" and "Vary" in response.headers:
                response.headers["Vary"] = response.headers["Vary"] + ", Origin"
            else:
                response.headers[k] = v

    return add
