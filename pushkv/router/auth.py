"""The router's API key, as vLLM's ``--api-key`` / ``VLLM_API_KEY``.

With a key set, every ``/v1/*`` request needs ``Authorization: Bearer <key>`` or gets a
401 with an OpenAI-style error body (the ``openai`` client raises AuthenticationError);
``/metrics`` too with ``--metrics-auth`` (off by default, as vLLM leaves it open for
scrapers), and ``/reset_prefix_cache`` (it changes every user's service); ``/health`` stays
open, for probes. The key reaches the router process through its environment (``pushkv up
--api-key`` sets it for the children), never through the config file in the run dir.
"""
from __future__ import annotations

import logging
from typing import Callable

from aiohttp import web

from pushkv.floods import worth_logging
from pushkv.router import api
from pushkv.security import API_KEY_ENV, bearer_ok  # noqa: F401 (API_KEY_ENV re-exported: the router's key variable)

log = logging.getLogger(__name__)

PROTECTED_PREFIX = "/v1/"
METRICS_PATH = "/metrics"
ADMIN_PATHS = ("/reset_prefix_cache",)  # what changes every user's service: behind the key too


def protected(path: str, metrics: bool) -> bool:
    return path.startswith(PROTECTED_PREFIX) or path in ADMIN_PATHS or (metrics and path == METRICS_PATH)


def authorized(path: str, authorization: str, key: str, metrics: bool = False) -> bool:
    """Whether a request may pass: no key set, an open path, or the right bearer token.
    ``metrics``: /metrics is protected too (``--metrics-auth``)."""
    if not key or not protected(path, metrics):
        return True
    return bearer_ok(authorization, key)


def unrooted(path: str, root: str) -> str:
    """``path`` as the API names it: with the router's ``--root-path`` ``root`` taken off its front where it is
    there (``/api/v1/models`` -> ``/v1/models``), so that a route served under the root is protected as its
    bare twin is."""
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


def middleware(key: str, on_refused: Callable[[], None], metrics: bool = False, root: str = ""):
    refused = 0

    @web.middleware
    async def check_api_key(request: web.Request, handler) -> web.StreamResponse:
        nonlocal refused
        given = request.headers.get("Authorization", "")
        # the path as given and as the API names it under the root: guarded if either is (a root of /v1 must not
        # open /v1/completions)
        if authorized(request.path, given, key, metrics) and authorized(unrooted(request.path, root), given, key,
                                                                            metrics):
            return await handler(request)
        on_refused()
        refused += 1
        if worth_logging(refused):  # a flood must not flood the log
            log.warning("refused %s %s from %s: missing or wrong API key (refused so far: %d)",
                        request.method, request.path, request.remote, refused)
        body = api.error_body("missing or incorrect API key: send 'Authorization: Bearer <key>'",
                              "authentication_error", 401)
        return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})
    return check_api_key
