"""A request's parse (its chat template, tokenizing, a grammar's check) runs on the router's parse threads: while one
request's tokenizing is held, the router answers other requests, /tokenize and its health check."""
import asyncio
import json
import threading
import urllib.parse

import pytest

from pushkv import messages as m
from pushkv.router import edge
from pushkv.router.text import ByteTokenizer
from tests.support.router_fakes import Harness, make_cfg, stage, tokens

pytestmark = pytest.mark.timeout(30)


class HeldTokenizer(ByteTokenizer):
    """Bytes as tokens; the text "hold" blocks its caller until the test opens ``gate``."""

    def __init__(self):
        self.entered = threading.Event()
        self.gate = threading.Event()

    def encode(self, text: str) -> list[int]:
        if text == "hold":
            self.entered.set()
            if not self.gate.wait(15):
                raise RuntimeError("the gate never opened")
        return super().encode(text)


def answer(g):
    return [(None, tokens(g, [72], True, "length", (stage("scheduled"), stage("finished"))))]


@pytest.mark.parametrize("route", ["/v1/completions", "/invocations"])
def test_a_held_parse_holds_no_other_request(tmp_path, route):
    """(/invocations too: its body read, its route chosen and its fields parsed all on a parse thread.)"""
    async def body():
        async with Harness(make_cfg(tmp_path, "local"), {"local": answer}) as h:
            tok = HeldTokenizer()
            h.router.tokenizer = tok
            held = asyncio.ensure_future(h.http.post(route, json={"prompt": "hold", "max_tokens": 1, "model": "tiny"}))
            assert await asyncio.to_thread(tok.entered.wait, 10)
            other = await h.http.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 1, "model": "tiny"})
            assert other.status == 200 and (await other.json())["choices"][0]["text"] == "H"
            counted = await h.http.post("/tokenize", json={"prompt": "abc", "model": "tiny"})
            assert counted.status == 200 and (await counted.json())["tokens"] == [97, 98, 99]
            assert (await h.http.get("/health")).status == 200
            assert not held.done() and len(h.log.received("local", m.Generate)) == 1
            tok.gate.set()
            done = await held
            assert done.status == 200 and (await done.json())["choices"][0]["text"] == "H"
            assert len(h.log.received("local", m.Generate)) == 2

    asyncio.run(asyncio.wait_for(body(), 25))


def test_a_parse_error_raised_on_a_parse_thread_is_the_same_400(tmp_path):
    async def body():
        async with Harness(make_cfg(tmp_path, "local"), {"local": answer}) as h:
            bad = await h.http.post("/v1/completions", json={"prompt": "Hey", "max_tokens": -1, "model": "tiny"})
            assert bad.status == 400 and "max_tokens" in (await bad.json())["error"]["message"]
            assert not h.log.received("local", m.Generate)

    asyncio.run(asyncio.wait_for(body(), 25))



def test_the_router_loads_xgrammar_once_ready(tmp_path, monkeypatch):
    """xgrammar (about 1.5 s to load) loads on a parse thread once the router is up (``PUSHKV_WARM_GRAMMARS``, on by
    default), so no structured-output request's check waits for it; /health says when it has. Off, nothing loads it
    until a request asks."""
    pytest.importorskip("xgrammar")
    from pushkv.router import server

    threads = []
    real = server.structured_warm

    def warm():
        threads.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(server, "structured_warm", warm)

    async def body(on: bool):
        monkeypatch.setenv("PUSHKV_WARM_GRAMMARS", "1" if on else "0")
        async with Harness(make_cfg(tmp_path, "local"), {"local": answer}) as h:
            if on:
                await asyncio.wait_for(h.router._warm_task, 20)
            health = await (await h.http.get("/health")).json()
            assert health["structured_ready"] is on and h.router.structured_ready is on

    asyncio.run(asyncio.wait_for(body(False), 25))
    assert threads == []
    asyncio.run(asyncio.wait_for(body(True), 25))
    assert len(threads) == 1 and threads[0].startswith("router-parse"), threads



@pytest.mark.parametrize("held,drain_s", [("body", 0.0), ("body", 5.0), ("parse", 5.0)])
def test_a_request_whose_body_or_parse_spans_the_stop_gets_503_and_never_reaches_an_instance(tmp_path, monkeypatch,
                                                                                           held, drain_s):
    """The stop begins while a request's body is on its way (or its parse runs): it is no run yet, and before, the
    stop neither waited for it nor failed it. aiohttp's shutdown then read no more of its connection, so the body never
    came, and the client got a closed connection with no answer after the router's grace (5 s); a parse that ended
    went on to send its Generate to instances that may be stopping. Now the stop waits for it, and it is refused."""
    reading = threading.Event()
    read_body = edge.read_body

    async def read_held(request, timeout_s):
        reading.set()
        return await read_body(request, timeout_s)

    monkeypatch.setattr(edge, "read_body", read_held)

    async def body():
        async with Harness(make_cfg(tmp_path, "local", shutdown_timeout_s=drain_s), {"local": answer}) as h:
            tok = HeldTokenizer()
            h.router.tokenizer = tok
            text = "hold" if held == "parse" else "Hey"
            req = json.dumps({"prompt": text, "max_tokens": 1, "model": "tiny"}).encode()
            u = urllib.parse.urlsplit(h.router.url)
            reader, writer = await asyncio.open_connection(u.hostname, u.port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(req) + (req if held == "parse" else req[:5]))
            await writer.drain()
            if held == "parse":
                assert await asyncio.to_thread(tok.entered.wait, 10)
            else:
                assert await asyncio.to_thread(reading.wait, 10)  # its handler reads the body
            stop = asyncio.ensure_future(h.router.stop())
            while not h.router.stopping:
                await asyncio.sleep(0)
            if held == "parse":
                tok.gate.set()
            else:
                writer.write(req[5:])
                await writer.drain()
            answer_ = await asyncio.wait_for(reader.read(), 3)
            writer.close()
            assert answer_.startswith(b"HTTP/1.1 503") and b"router shutting down" in answer_, answer_[:200]
            assert not h.log.received("local", m.Generate)
            await asyncio.wait_for(stop, 10)

    asyncio.run(asyncio.wait_for(body(), 25))
