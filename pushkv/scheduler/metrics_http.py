"""An instance's ``/metrics`` over HTTP: prometheus_client's WSGI app on a thread, behind the
deployment's API key when ``--metrics-auth`` asks for it (``Authorization: Bearer KEY``, else 401).

prometheus_client's own ``start_http_server`` takes TLS client certificates but no bearer
token, so the app is wrapped here; the server is the same threading WSGI server it uses."""
from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from pushkv.floods import worth_logging
from pushkv.security import bearer_ok

log = logging.getLogger(__name__)

REFUSED_BODY = b"missing or incorrect API key: send 'Authorization: Bearer <key>'\n"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # a scrape every few seconds: no line each
        pass


def guarded(app: Callable, key: str) -> Callable:
    """``app`` answering only requests that carry the bearer ``key``; the others get a 401."""
    refused = 0

    def check(environ: dict, start_response: Callable) -> Iterable[bytes]:
        nonlocal refused
        if bearer_ok(environ.get("HTTP_AUTHORIZATION", ""), key):
            return app(environ, start_response)
        refused += 1
        if worth_logging(refused):
            log.warning("refused /metrics from %s: missing or wrong API key (refused so far: %d)",
                        environ.get("REMOTE_ADDR", "?"), refused)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer"),
                                            ("Content-Length", str(len(REFUSED_BODY)))])
        return [REFUSED_BODY]
    return check


def serve(port: int, host: str, registry: Any, key: str = "") -> WSGIServer:
    """Start serving ``registry`` on ``host:port`` (behind ``key`` when given) on a daemon
    thread; stop with ``shutdown()`` and ``server_close()``."""
    app = make_wsgi_app(registry)
    if key:
        app = guarded(app, key)

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = make_server(host, port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd
