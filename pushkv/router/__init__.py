"""The router: OpenAI-compatible HTTP front that drives the schedulers.

``server.Router`` owns the aiohttp site, the scheduler links (``links``) and the supervisor
control socket; each choice of a request is a pure state machine (``request``: a phase and a
``ledger``), fed by its asyncio shell (``flow.RequestRun``); ``generate`` answers the HTTP
request from its choices, shaped per endpoint by ``render``; ``api`` parses the bodies;
``balance`` places requests over the pure ``policy``; ``metrics`` holds the Prometheus
collectors; ``text`` adapts the tokenizer.

Importing the package imports nothing else: ``pushkv.router.server`` is the process's entry.
"""
