"""vLLM's routes beside the OpenAI ones: SageMaker's /invocations (a chat completion or a completion, by what the body
holds), /load and /reset_prefix_cache."""
import asyncio

import pytest

from pushkv import messages as m
from tests.support.router_fakes import Harness, make_cfg, stage, tokens

pytestmark = pytest.mark.timeout(30)


def answer(g):
    return [(None, tokens(g, [72], True, "length", (stage("scheduled"), stage("finished"))))]


def test_invocations_serves_a_chat_completion_or_a_completion_as_vllm_does(tmp_path, monkeypatch):
    """SageMaker's /invocations: a body with messages is a chat completion, one with a prompt a completion, the
    answer each route gives; a body with neither is a 400 naming messages. Each body is read as JSON once, on a
    parse thread."""
    import threading

    from pushkv.router import api

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    parsed = []
    real_parse = api.parse_json

    def counted(raw):
        parsed.append(threading.current_thread() is threading.main_thread())
        return real_parse(raw)

    monkeypatch.setattr(api, "parse_json", counted)

    async def body():
        async with Harness(make_cfg(tmp_path, "local", chat_template=template), {"local": answer}) as h:
            chat = await h.http.post("/invocations", json={"messages": [{"role": "user", "content": "Hi"}],
                                                            "max_tokens": 1, "model": "tiny"})
            got = await chat.json()
            assert chat.status == 200 and got["object"] == "chat.completion", got
            assert got["choices"][0]["message"]["content"] == "H"
            plain = await h.http.post("/invocations", json={"prompt": "Hey", "max_tokens": 1, "model": "tiny"})
            got = await plain.json()
            assert plain.status == 200 and got["object"] == "text_completion" and got["choices"][0]["text"] == "H"
            prompts = [list(g.prompt_token_ids) for g in h.log.received("local", m.Generate)]
            assert prompts == [list(b"Hi"), list(b"Hey")]
            neither = await h.http.post("/invocations", json={"input": "Hey", "model": "tiny"})
            err = (await neither.json())["error"]
            assert neither.status == 400 and err["param"] == "messages" and "prompt" in err["message"]
            broken = await h.http.post("/invocations", data=b"{not json")
            assert broken.status == 400 and "malformed JSON" in (await broken.json())["error"]["message"]
            assert len(h.log.received("local", m.Generate)) == 2
            assert parsed == [False] * 4, parsed  # once a body, never on the event loop's thread

    asyncio.run(asyncio.wait_for(body(), 25))


def test_load_counts_the_generation_requests_in_flight(tmp_path):
    """vLLM's GET /load: the requests being served now, each once whatever its n, back to 0 when they end."""
    import threading

    gate = threading.Event()

    def held(g):
        return [(gate, tokens(g, [72], True, "length", (stage("scheduled"), stage("finished"))))]

    async def body():
        async with Harness(make_cfg(tmp_path, "local"), {"local": held}) as h:
            assert await (await h.http.get("/load")).json() == {"server_load": 0}
            two = asyncio.ensure_future(h.http.post("/v1/completions", json={
                "prompt": "Hey", "max_tokens": 1, "model": "tiny", "n": 2, "temperature": 1.0}))
            await h.wait(lambda e: len([x for r, d, x in e if d == "recv" and isinstance(x, m.Generate)]) == 2)
            assert await (await h.http.get("/load")).json() == {"server_load": 1}
            gate.set()
            assert (await two).status == 200
            assert await (await h.http.get("/load")).json() == {"server_load": 0}

    asyncio.run(asyncio.wait_for(body(), 25))


def test_reset_prefix_cache_asks_every_scheduler_and_says_who_did_not_answer(tmp_path):
    """POST /reset_prefix_cache: each scheduler is sent ResetPrefixCache; 200 with vLLM's {"success": true} and each
    one's cache after it once all answered, 503 naming one that did not (the end to end reset:
    tests/e2e/test_reset_prefix_cache.py)."""
    async def body():
        async with Harness(make_cfg(tmp_path, "local"), {"local": answer}) as h:
            silent = await h.http.post("/reset_prefix_cache")
            err = (await silent.json())["error"]
            assert silent.status == 503 and "local-engine" in err["message"], err
            h.fakes["local"].stats = m.Stats("local-engine", "local", 100, 100, 0, 0, {}, 0)
            done = await h.http.post("/reset_prefix_cache")
            assert done.status == 200
            got = await done.json()
            assert got["success"] is True  # vLLM's answer, which a client of vLLM's reads
            assert got["reset"] == [{"engine_id": "local-engine", "role": "local", "cached_blocks": 0}]
            assert len(h.log.received("local", m.ResetPrefixCache)) == 2

    asyncio.run(asyncio.wait_for(body(), 25))
