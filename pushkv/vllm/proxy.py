"""``pushkv vllm-proxy``: an OpenAI front (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``) for vLLM P/D instances that use pushkv's connector.

Each request goes to one P and one D **at the same time**, with one transfer
id in both legs' ``kv_transfer_params`` (see ``params.py`` for what other
routers must send). D registers its blocks as soon as it allocates them, P
WRITEs when its prefill ends, D decodes; the client gets D's response,
streaming or not. A chat request goes to both instances' chat endpoint, so each
applies the same chat template to the same messages: the prompt P computes is the
one D decodes from. P's identity (``pushkv_source``) is learnt from one probe
request per P at start and refreshed from every P response. Errors are OpenAI's
shape (``{"error": {"message", "type", "param", "code"}}``).

    pushkv vllm-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import logging
import uuid
from typing import Any, Optional

import aiohttp
from aiohttp import web

from pushkv import envs
from pushkv.trace import stamp as mark
from pushkv.vllm import params as P

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 300.0
CONNECT_S = 30.0
# what each endpoint's body must carry (the prompt P computes and D decodes from)
ENDPOINTS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}
# the fields of a P leg that only shape D's answer (P samples one token, streamed to no one)
ANSWER_ONLY = ("stream", "stream_options", "n", "best_of", "min_tokens", "logprobs", "top_logprobs", "echo",
               "max_completion_tokens")
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 502: "bad_gateway", 503: "service_unavailable"}
# how the proxy's HTTP server runs: a client that hangs up cancels its handler, which closes the legs'
# connections, and vLLM aborts a request whose connection closed (aiohttp >= 3.9 cancels no handler by
# default: D went on decoding a gone client's request to its max_tokens)
SERVE: dict[str, Any] = {"handler_cancellation": True}


class Instance:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.source: Optional[dict[str, Any]] = None
        self.inflight = 0


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], request_timeout_s: Optional[float] = None,
                 api_key: Optional[str] = None):
        if not prefill or not decode:
            raise ValueError("need at least one --prefill and one --decode URL")
        self.prefill = [Instance(u) for u in prefill]
        self.decode = [Instance(u) for u in decode]
        # no bound on a whole request by default: a long generation streams for as long as it takes (the
        # client's own timeout and hang-up end it); reaching an instance is bounded
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=CONNECT_S)
        # the instances' API key (vllm serve --api-key), for the proxy's own probes; a client's requests
        # carry the client's Authorization, which the instances check
        self.own_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session: Optional[aiohttp.ClientSession] = None
        self.model: Optional[str] = None
        self._rr = itertools.count()
        self.counters = {"requests": 0, "ok": 0, "failed": 0}

    async def start(self, app=None) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout)
        await asyncio.gather(*(self._probe(p, "prefill") for p in self.prefill),
                             *(self._probe(d, "decode") for d in self.decode))

    async def _start_session(self, app=None) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout)
        deadline = asyncio.get_running_loop().time() + PROBE_TIMEOUT_S
        while True:
            try:
                async with self.session.get(self.prefill[0].url + "/v1/models") as r:
                    self.model = (await r.json())["data"][0]["id"]
                return
            except aiohttp.ClientError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def stop(self, app=None) -> None:
        if self.session is not None:
            await self.session.close()

    async def _probe(self, p: Instance, leg: str = "prefill") -> None:
        """Learn an instance's pushkv_source from one tiny request (bounded; it may still be starting), and
        refuse one whose kv_role does not serve ``leg`` (the --prefill and --decode URLs the wrong way round)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PROBE_TIMEOUT_S

        def left() -> aiohttp.ClientTimeout:  # each probe request within the probe's bound (the session has none)
            return aiohttp.ClientTimeout(total=max(deadline - loop.time(), 0.1), sock_connect=CONNECT_S)

        while True:
            try:
                async with self.session.get(p.url + "/v1/models", headers=self.own_headers, timeout=left()) as r:
                    _refused(leg, p.url, r.status, await r.read())
                    models = await r.json()
                self.model = self.model or models["data"][0]["id"]
                body = {"model": self.model, "prompt": [0], "max_tokens": 1,
                        "kv_transfer_params": {"pushkv_probe": True}}
                async with self.session.post(p.url + "/v1/completions", json=body, headers=self.own_headers,
                                             timeout=left()) as r:
                    out = await r.json()
                src = (out.get("kv_transfer_params") or {}).get(P.SOURCE_KEY)
                if src is None:
                    raise RuntimeError(f"{p.url} does not run PushKVConnector (no {P.SOURCE_KEY} in its answer)")
                why = P.leg_refused(leg, str((out.get("kv_transfer_params") or {}).get(P.ROLE_KEY, "kv_both")))
                if why:
                    raise RuntimeError(f"--{leg} {p.url}: {why}")
                p.source = src
                log.info("%s %s: engine %s, writers %s", leg, p.url, src["engine_id"], src["handshake"])
                return
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError) as e:
                if loop.time() > deadline:
                    said = str(e) or f"no answer in {PROBE_TIMEOUT_S:g} s"
                    raise RuntimeError(f"{leg} {p.url} not reachable: {said}") from e
                await asyncio.sleep(0.5)

    @staticmethod
    def _client_headers(req: web.Request) -> dict[str, str]:
        """What of the client's request the legs carry: its Authorization (instances with --api-key)."""
        auth = req.headers.get("Authorization")
        return {"Authorization": auth} if auth else {}

    def _pick(self, pool: list[Instance]) -> Instance:
        low = min(i.inflight for i in pool)
        cands = [i for i in pool if i.inflight == low]
        return cands[next(self._rr) % len(cands)]

    @staticmethod
    def legs(body: dict[str, Any], tid: str, source: dict[str, Any]) -> tuple[dict, dict]:
        """The two request bodies for one client request (pure; tested)."""
        p_body = copy.deepcopy(body)
        for k in ANSWER_ONLY:
            p_body.pop(k, None)
        p_body["max_tokens"] = 1
        p_body["kv_transfer_params"] = {P.KEY: {"role": "prefill", "transfer_id": tid}}
        d_body = copy.deepcopy(body)
        d_body["kv_transfer_params"] = {P.KEY: {"role": "decode", "transfer_id": tid, "source": source}}
        return p_body, d_body

    async def completions(self, req: web.Request) -> web.StreamResponse:
        """``/v1/completions`` and ``/v1/chat/completions``: both legs at once, D's answer relayed."""
        path = req.path
        body = await self._json(req)
        if isinstance(body, web.Response):
            return body
        key = ENDPOINTS[path]
        if not isinstance(body, dict) or body.get(key) in (None, "", []):
            return self._error(400, f"body must be an object with a non-empty '{key}'", param=key)
        if "model" in body and self.model is not None and body["model"] != self.model:
            return self._error(404, f"the model '{body['model']}' does not exist; this proxy serves '{self.model}'",
                               param="model", code="model_not_found")
        body.setdefault("model", self.model)
        self.counters["requests"] += 1
        p, d = self._pick(self.prefill), self._pick(self.decode)
        tid = uuid.uuid4().hex
        p_body, d_body = self.legs(body, tid, p.source)
        p.inflight += 1
        d.inflight += 1
        mark("proxy_arrived", tid)
        hdr = self._client_headers(req)
        p_task = asyncio.create_task(self._prefill(p, p_body, path, hdr))
        try:
            async with self.session.post(d.url + path, json=d_body, headers=hdr) as dr:
                if dr.status != 200 or not body.get("stream"):
                    data = await dr.read()
                    if dr.status != 200:
                        self.counters["failed"] += 1
                        return await self._failed(dr.status, data, p_task, tid)
                    p_err = await p_task
                    out = json.loads(data)
                    if p_err is not None and not out.get("choices"):
                        return self._error(502, f"prefill failed: {p_err}")
                    if any(c.get("finish_reason") == "error" for c in out.get("choices", ())):
                        self.counters["failed"] += 1
                        return self._error(500, f"KV transfer failed (transfer_id={tid}); prefill: "
                                                f"{p_err or 'ok'}; see the decode instance's log")
                    self.counters["ok"] += 1
                    return web.json_response(out)
                resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await resp.prepare(req)
                first = True
                async for chunk in dr.content.iter_any():
                    if first:
                        mark("proxy_first_chunk", tid)
                        first = False
                    if b'"finish_reason":"error"' in chunk:
                        err = {"error": {"message": f"KV transfer failed (transfer_id={tid}); see the decode "
                                                    "instance's log", "type": "server_error", "param": None,
                                         "code": 500}}
                        await resp.write(f"data: {json.dumps(err)}\n\n".encode())
                        self.counters["failed"] += 1
                        break
                    await resp.write(chunk)
                else:
                    self.counters["ok"] += 1
                await resp.write_eof()
                await p_task
                return resp
        except aiohttp.ClientError as e:
            self.counters["failed"] += 1
            p_task.cancel()
            return self._error(502, f"decode {d.url} unreachable: {e}")
        except asyncio.CancelledError:  # the client hung up: P's leg goes too (vLLM aborts it, if still running)
            p_task.cancel()
            raise
        finally:
            p.inflight -= 1
            d.inflight -= 1

    async def completions_nixl(self, req: web.Request) -> web.StreamResponse:
        """``--protocol nixl``: vLLM's NixlConnector (pull) protocol, for side-by-side
        benchmarks through the same front: P first (do_remote_decode), then D with the
        kv_transfer_params P answered; D READs P's blocks."""
        body = await self._json(req)
        if isinstance(body, web.Response):
            return body
        body.setdefault("model", self.model)
        p, d = self._pick(self.prefill), self._pick(self.decode)
        p_body, _ = self.legs(body, "", {})
        p_body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        p.inflight += 1
        d.inflight += 1
        try:
            async with self.session.post(p.url + "/v1/completions", json=p_body) as pr:
                p_out = await pr.json(content_type=None)
                if pr.status != 200:
                    return self._error(pr.status, f"prefill failed: {p_out}")
            d_body = copy.deepcopy(body)
            d_body["kv_transfer_params"] = p_out.get("kv_transfer_params")
            async with self.session.post(d.url + "/v1/completions", json=d_body) as dr:
                return await self._relay_as_is(req, dr, bool(body.get("stream")))
        except aiohttp.ClientError as e:
            return self._error(502, f"upstream unreachable: {e}")
        finally:
            p.inflight -= 1
            d.inflight -= 1

    @staticmethod
    async def _relay_as_is(req: web.Request, dr: aiohttp.ClientResponse, stream: bool) -> web.StreamResponse:
        """D's answer to the client unchanged (the comparison protocols: no pushkv checks)."""
        if dr.status != 200 or not stream:
            return web.Response(body=await dr.read(), status=dr.status, content_type="application/json")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(req)
        async for chunk in dr.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def completions_nixl_push(self, req: web.Request) -> web.StreamResponse:
        """``--protocol nixl-push``: vLLM's NixlPushConnector protocol, for comparisons: both
        legs at once under one X-Request-Id (P matches D's registration by request id), D's
        params naming P's side channel (learnt from a probe of P at start)."""
        body = await self._json(req)
        if isinstance(body, web.Response):
            return body
        body.setdefault("model", self.model)
        p, d = self._pick(self.prefill), self._pick(self.decode)
        rid = uuid.uuid4().hex
        hdr = {"X-Request-Id": rid}
        p_body, _ = self.legs(body, "", {})
        p_body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        d_body = copy.deepcopy(body)
        d_body["kv_transfer_params"] = dict(p.source, do_remote_prefill=True, do_remote_decode=False,
                                            remote_request_id=f"cmpl-{rid}-0")  # P's id for this prompt
        p_task = asyncio.create_task(self.session.post(p.url + "/v1/completions", json=p_body, headers=hdr))
        try:
            async with self.session.post(d.url + "/v1/completions", json=d_body, headers=hdr) as dr:
                return await self._relay_as_is(req, dr, bool(body.get("stream")))
        except aiohttp.ClientError as e:
            return self._error(502, f"upstream unreachable: {e}")
        finally:
            try:
                (await p_task).release()
            except aiohttp.ClientError:
                pass

    async def _probe_nixl(self, app=None) -> None:
        await self._start_session()
        for p in self.prefill:
            body = {"model": self.model, "prompt": [0], "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
            async with self.session.post(p.url + "/v1/completions", json=body) as r:
                kp = (await r.json())["kv_transfer_params"]
            p.source = {k: kp[k] for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size")}

    async def _prefill(self, p: Instance, body: dict, path: str = "/v1/completions",
                       headers: Optional[dict[str, str]] = None) -> Optional[str]:
        """Run the P leg; None when it went well, else why not. Refreshes P's source."""
        try:
            async with self.session.post(p.url + path, json=body, headers=headers) as r:
                data = await r.read()
                if r.status != 200:
                    return f"prefill {p.url} answered {r.status}: {data[:300]!r}"
                src = (json.loads(data).get("kv_transfer_params") or {}).get(P.SOURCE_KEY)
                if src:
                    p.source = src
                return None
        except aiohttp.ClientError as e:
            return f"prefill {p.url} unreachable: {e}"

    async def _failed(self, status: int, data: bytes, p_task, tid: str) -> web.Response:
        """D answered an error. vLLM 0.32 answers a failed KV load (kv_load_failure_policy
        'fail') with a bare 500; the connector logs the cause on D under the transfer id. D refusing
        the request itself ends P's leg: if still computing, vLLM aborts it and its blocks free now
        (P's finished prefill would hold them until D's registration, which never comes, times out)."""
        try:
            err = json.loads(data).get("error")
            msg = (err or {}).get("message") or data[:300].decode(errors="replace")
        except (ValueError, AttributeError):
            err, msg = None, data[:300].decode(errors="replace")
        if 400 <= status < 500 and isinstance(err, dict) and err.get("message"):
            # the client's request is at fault (vLLM validated it: a bad field, too long a prompt),
            # not the transfer: D's own message says what to fix, in OpenAI's shape
            p_task.cancel()
            param = err.get("param")
            return self._error(status, str(err["message"]), param=param if isinstance(param, str) else None)
        p_err = await p_task
        why = f"prefill failed: {p_err}" if p_err else "KV transfer failed"
        return self._error(status, f"{why} (transfer_id={tid}); decode answered {status}: {msg}")

    @staticmethod
    async def _json(req: web.Request):
        """The request's JSON body, or the 400 to answer when it is not JSON."""
        try:
            return await req.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return Proxy._error(400, "body must be JSON")

    @staticmethod
    def _error(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> web.Response:
        """An error as OpenAI's API shapes it (clients read ``error.message`` and ``error.type``)."""
        kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return web.json_response({"error": {"message": message, "type": kind, "param": param,
                                            "code": code if code is not None else status}}, status=status)

    async def models(self, req: web.Request) -> web.Response:
        """``/v1/models``: what the instances serve, as a D instance lists it."""
        d = self._pick(self.decode)
        try:
            async with self.session.get(d.url + "/v1/models", headers=self._client_headers(req)) as r:
                return web.json_response(await r.json(content_type=None), status=r.status)
        except (aiohttp.ClientError, ValueError) as e:
            return self._error(502, f"decode {d.url} unreachable: {e}")

    async def health(self, req: web.Request) -> web.Response:
        return web.json_response({"prefill": [p.source for p in self.prefill], **self.counters})

    def app(self, protocol: str = "pushkv") -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        handler, start = {"pushkv": (self.completions, self.start),
                          "nixl": (self.completions_nixl, self._start_session),
                          "nixl-push": (self.completions_nixl_push, self._probe_nixl)}[protocol]
        app.router.add_post("/v1/completions", handler)
        if protocol == "pushkv":
            app.router.add_post("/v1/chat/completions", handler)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(start)
        app.on_cleanup.append(self.stop)
        return app


def _refused(leg: str, url: str, status: int, data: bytes) -> None:
    """An instance that refuses the proxy's probe for want of an API key fails the start now, saying what to give."""
    if status in (401, 403):
        raise RuntimeError(f"--{leg} {url} answered {status} ({data[:200].decode(errors='replace')}): it takes an API "
                           "key (vllm serve --api-key); give vllm-proxy --api-key KEY")


def probe_key(given: Optional[str]) -> Optional[str]:
    """The instances' key for the proxy's probes: --api-key, else $VLLM_API_KEY (what vllm serve takes where its
    --api-key is not given, so one environment starts both); None: the instances take no key."""
    return given or envs.VLLM_API_KEY or None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="a P vLLM URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="a D vLLM URL (repeatable)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--api-key", default=None,
                    help="the instances' API key (vllm serve --api-key), for the proxy's own probes; clients "
                         "send theirs, which both legs carry (default: $VLLM_API_KEY, as vllm serve reads it)")
    ap.add_argument("--protocol", choices=("pushkv", "nixl", "nixl-push"), default="pushkv",
                    help="nixl: vLLM's NixlConnector pull protocol (P, then D); nixl-push: its "
                         "NixlPushConnector protocol (both at once); for comparisons")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pushkv vllm-proxy %(levelname)s %(message)s")
    proxy = Proxy(args.prefill, args.decode, api_key=probe_key(args.api_key))
    web.run_app(proxy.app(args.protocol), host=args.host, port=args.port, print=lambda *_: print(
        f"pushkv vllm-proxy on http://{args.host}:{args.port} READY", flush=True), **SERVE)


if __name__ == "__main__":
    main()
