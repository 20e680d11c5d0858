"""The router: OpenAI-compatible HTTP front that drives the schedulers.

``server.Router`` owns the aiohttp site, one DEALER per scheduler and the
supervisor control socket; ``flow.RequestRun`` runs one request's legs
(local / push / pull); ``api`` parses and shapes the HTTP bodies; ``metrics``
holds the Prometheus collectors; ``text`` adapts the tokenizer.
"""
from pushkv.router.server import Router, serve

__all__ = ["Router", "serve"]
