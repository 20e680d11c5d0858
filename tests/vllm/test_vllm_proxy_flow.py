"""``pushkv vllm-proxy`` over loopback against fake P and D instances (aiohttp servers that
answer as vLLM does, no vLLM needed): what reaches the instances when a client hangs up."""
import asyncio

import aiohttp
import pytest
from aiohttp import web

from pushkv.vllm.proxy import SERVE, Proxy

pytestmark = pytest.mark.timeout(60)

SOURCE = {"engine_id": "p", "tp": 1, "handshake": ["ipc:///x"]}
WAIT_S = 10.0


async def serve(app: web.Application, **kw) -> tuple[web.AppRunner, str]:
    """``app`` on a free loopback port, its server made with ``kw`` (aiohttp's TestServer would
    force handler_cancellation on, the setting under test)."""
    runner = web.AppRunner(app, shutdown_timeout=1.0, **kw)  # a handler left waiting ends at cleanup
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


class Instance:
    """A fake vLLM instance: answers /v1/models and P's probe; a leg's request waits until its
    connection closes (vLLM aborts such a request), and says so; or, given ``refuse_after``, is
    refused as vLLM refuses a bad request once that event is set."""

    def __init__(self, refuse_after: "asyncio.Event | None" = None, kv_role: str = "kv_both", key: str = "",
                 answer: bool = False):
        self.refuse_after = refuse_after
        self.kv_role = kv_role
        self.key = key  # vllm serve --api-key: a request without it is a 401
        self.answer = answer  # a leg is answered at once (else it waits until its connection closes)
        self.leg_auth: list = []
        self.leg_arrived = asyncio.Event()
        self.leg_ended = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/completions", self.completions)
        self.runner: web.AppRunner

    async def start(self) -> str:
        self.runner, url = await serve(self.app, handler_cancellation=True)  # as vLLM notices a hang-up
        return url

    def _unauthorized(self, req):
        if self.key and req.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return None

    async def models(self, req):
        return self._unauthorized(req) or web.json_response({"data": [{"id": "m"}]})

    async def completions(self, req):
        refused = self._unauthorized(req)
        if refused is not None:
            return refused
        body = await req.json()
        if (body.get("kv_transfer_params") or {}).get("pushkv_probe"):
            params = {"pushkv_source": SOURCE, "pushkv_kv_role": self.kv_role}
            return web.json_response({"choices": [{"text": ""}], "kv_transfer_params": params})
        self.leg_arrived.set()
        self.leg_auth.append(req.headers.get("Authorization"))
        if self.answer:
            return web.json_response({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})
        if self.refuse_after is not None:
            await self.refuse_after.wait()
            error = {"message": "prompt too long", "type": "invalid_request_error", "param": "input_tokens"}
            return web.json_response({"error": dict(error, code=400)}, status=400)
        try:
            await asyncio.Event().wait()
        finally:
            self.leg_ended.set()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_ends_both_legs(stream):
    """The client closes its connection while P and D are still at work: both legs' connections
    close, so vLLM aborts them (before, a non-streamed request, or a streamed one before its
    first chunk, ran on D to its max_tokens)."""

    async def run():
        p, d = Instance(), Instance()
        proxy = Proxy([await p.start()], [await d.start()])
        front, url = await serve(proxy.app(), **SERVE)
        try:
            async with aiohttp.ClientSession() as client:
                body = {"prompt": "hello", "max_tokens": 1000, "stream": stream}
                call = asyncio.create_task(client.post(url + "/v1/completions", json=body))
                await asyncio.wait_for(asyncio.gather(p.leg_arrived.wait(), d.leg_arrived.wait()), WAIT_S)
                call.cancel()  # the client hangs up
                await asyncio.gather(call, return_exceptions=True)
                await asyncio.wait_for(asyncio.gather(d.leg_ended.wait(), p.leg_ended.wait()), WAIT_S)
        finally:
            for r in (front, p.runner, d.runner):
                await r.cleanup()

    asyncio.run(run())


def test_d_refusing_the_request_ends_ps_leg():
    """D refuses the request itself (a 400, as vLLM answers a prompt longer than its
    --max-model-len): the client gets D's words and P's leg is ended (before, P finished its
    prefill and held the blocks until D's registration, which never came, timed out)."""

    async def run():
        p = Instance()
        d = Instance(refuse_after=p.leg_arrived)  # (P's leg at work when D refuses)
        proxy = Proxy([await p.start()], [await d.start()])
        front, url = await serve(proxy.app(), **SERVE)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as client:
                async with client.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}) as r:
                    assert r.status == 400
                    assert (await r.json())["error"]["message"] == "prompt too long"
                await asyncio.wait_for(p.leg_ended.wait(), WAIT_S)
        finally:
            for r in (front, p.runner, d.runner):
                await r.cleanup()

    asyncio.run(run())


@pytest.mark.parametrize("p_role,d_role,says", [
    ("kv_consumer", "kv_producer", "--prefill http://"),  # the URLs swapped: P's is refused first
    ("kv_producer", "kv_producer", "--decode http://"),
])
def test_instances_the_wrong_way_round_are_refused_at_start(p_role, d_role, says):
    """The proxy learns each instance's kv_role from its probe answer and refuses to start with a
    --prefill URL that serves no prefill leg, or a --decode URL no decode leg (before, the legs
    went there: vLLM does not defer a producer's block frees for loads)."""

    async def run():
        p, d = Instance(kv_role=p_role), Instance(kv_role=d_role)
        proxy = Proxy([await p.start()], [await d.start()])
        try:
            with pytest.raises(RuntimeError, match="the router has P and D the wrong way round") as e:
                await serve(proxy.app(), **SERVE)
            assert says in str(e.value)
        finally:
            await proxy.stop()
            for r in (p.runner, d.runner):
                await r.cleanup()

    asyncio.run(run())


def test_instances_with_an_api_key():
    """Instances run with vllm serve --api-key: the proxy probes them with its --api-key, and each
    leg carries the client's Authorization (before, the proxy sent none: every leg was a 401, and its
    start retried the 401 for 300 s, then said the instance was not reachable: 'data'); without a key
    its start fails at once, saying to give one."""

    async def run():
        p, d = Instance(key="k", answer=True), Instance(key="k", answer=True)
        urls = [await p.start()], [await d.start()]
        try:
            proxy = Proxy(*urls, api_key="k")
            front, url = await serve(proxy.app(), **SERVE)
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as client:
                    async with client.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                                           headers={"Authorization": "Bearer k"}) as r:
                        assert r.status == 200, await r.text()
                    async with client.post(url + "/v1/completions", json={"prompt": "hi"}) as r:
                        assert r.status == 401  # a client without the key: the instances refuse it
            finally:
                await front.cleanup()
            assert p.leg_auth == ["Bearer k"] and d.leg_auth == ["Bearer k"]  # (the keyless one: refused)
            keyless = Proxy(*urls)
            try:
                with pytest.raises(RuntimeError, match="answered 401 .*give vllm-proxy --api-key KEY"):
                    await asyncio.wait_for(serve(keyless.app(), **SERVE), WAIT_S)
            finally:
                await keyless.stop()
        finally:
            for r in (p.runner, d.runner):
                await r.cleanup()

    asyncio.run(run())


def test_a_long_generation_is_not_cut_by_the_proxy():
    """No bound on a whole request (a long generation streams as long as it takes; before, every
    request was cut at 600 s): only reaching an instance is bounded."""
    proxy = Proxy(["http://p"], ["http://d"])
    assert proxy.timeout.total is None and proxy.timeout.sock_connect


def test_an_instance_that_never_answers_its_probe_fails_the_start(monkeypatch):
    """The session has no total bound, so each probe request is bounded by what is left of the
    probe's own: an instance that takes the connection and never answers fails the start at the
    probe's deadline, naming it (before, the start waited for it forever)."""
    from pushkv.vllm import proxy as proxy_mod

    monkeypatch.setattr(proxy_mod, "PROBE_TIMEOUT_S", 1.0)

    async def hang(req):
        await asyncio.Event().wait()

    async def run():
        mute = web.Application()
        mute.router.add_get("/v1/models", hang)
        runner, mute_url = await serve(mute, handler_cancellation=True)
        d = Instance(kv_role="kv_consumer")
        try:
            proxy = Proxy([mute_url], [await d.start()])
            try:
                with pytest.raises(RuntimeError, match=f"prefill {mute_url} not reachable: no answer in 1 s"):
                    await asyncio.wait_for(proxy.start(), WAIT_S)
            finally:
                await proxy.stop()
        finally:
            for r in (runner, d.runner):
                await r.cleanup()

    asyncio.run(run())
