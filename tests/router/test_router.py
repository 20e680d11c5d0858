"""Router logic against fake schedulers (real router, real zmq, real HTTP)."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading

import aiohttp
import msgspec
import pytest
import zmq

from pushkv import messages as m
from pushkv.config import Timeouts, encode_config
from tests.support import ROOT
from tests.support.router_fakes import WAIT_S, Harness, make_cfg, stage, tokens

pytestmark = pytest.mark.timeout(30)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 25))


async def read_sse(resp) -> list:
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def local_script(chunks, reason="length"):
    def script(g):
        out = [(None, tokens(g, ids)) for ids in chunks[:-1]]
        out.append((None, tokens(g, chunks[-1], True, reason, (stage("scheduled"), stage("finished")))))
        return out
    return script


# ---------------------------------------------------------------------------
def test_local_unary_shape(tmp_path):
    async def body():
        cfg = make_cfg(tmp_path, "local")
        async with Harness(cfg, {"local": local_script([[72], [105, 33]], "stop")}) as h:
            r = await h.http.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 3, "model": "tiny"})
            assert r.status == 200
            out = await r.json()
            gen = h.log.received("local", m.Generate)[0]
            assert gen.leg == "local" and gen.generation == 0 and gen.max_tokens == 3
            assert gen.prompt_token_ids == tuple(b"Hey")
            assert out["object"] == "text_completion" and out["id"] == f"cmpl-{gen.transfer_id}"
            assert out["choices"] == [{"index": 0, "text": "Hi!", "token_ids": [72, 105, 33], "finish_reason": "stop",
                                       "stop_reason": None, "logprobs": None}]
            assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                    "prompt_tokens_details": {"cached_tokens": 0}}
            ext = out["pushkv"]
            assert ext["transfer_id"] == gen.transfer_id
            for k in ("router.arrival", "router.send_local", "router.first_token", "router.finish",
                      "local.scheduled", "local.finished"):
                assert k in ext["timeline"], k
            assert {"created", "model"} <= set(out)
    run(body())


@pytest.mark.parametrize("served, aliases, ok, unknown", [
    ((), (), ["tiny"], ["x", "Tiny", "tiny "]),
    (("qwen/qwen3", "q3"), (), ["qwen/qwen3", "q3"], ["tiny", "x"]),
    # --model ORG/NAME alone: its snapshot path answers too, unlisted (/v1/models listed the cache's path as a model)
    (("org/m",), ("/hub/models--org--m/snapshots/0",), ["org/m", "/hub/models--org--m/snapshots/0"], ["m", "tiny"]),
])
def test_the_model_field_is_checked_against_the_served_names(tmp_path, served, aliases, ok, unknown):
    """As OpenAI: an unknown model is 404 with code model_not_found (before any leg is sent); no
    model field at all is served; /v1/models lists the served names, not the aliases. The answer names the first
    served name, whichever one the request gave, as vLLM's (pushkv named the request's, so the same model answered
    under two names)."""
    async def body():
        cfg = make_cfg(tmp_path, "local", served_model_name=served, model_aliases=aliases)
        async with Harness(cfg, {"local": local_script([[72]], "stop")}) as h:
            listed = await (await h.http.get("/v1/models")).json()
            assert [c["id"] for c in listed["data"]] == [n for n in ok if n not in aliases]
            for card in listed["data"]:  # vLLM's ModelCard: parent, and one ModelPermission
                assert card["parent"] is None and [p["object"] for p in card["permission"]] == ["model_permission"]
                assert card["permission"][0]["allow_sampling"] is True and card["permission"][0]["organization"] == "*"
            for name in unknown:
                for path, extra in (("/v1/completions", {"prompt": "Hey"}),
                                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hey"}]})):
                    r = await h.http.post(path, json={"model": name, "max_tokens": 1, **extra})
                    err = (await r.json())["error"]
                    assert r.status == 404 and err["code"] == "model_not_found" and err["param"] == "model", err
                    assert err["type"] == "invalid_request_error" and f"`{name}`" in err["message"]
            r = await h.http.post("/v1/completions", json={"model": 5, "prompt": "Hey", "max_tokens": 1})
            assert r.status == 400 and (await r.json())["error"]["param"] == "model"
            assert not h.log.received("local", m.Generate)
            for name in [*ok, None, ""]:  # none, or "" (as vLLM): the base model
                for path, extra in (("/v1/completions", {"prompt": "Hey"}),
                                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hey"}]})):
                    req = {"max_tokens": 1, **extra, **({"model": name} if name is not None else {})}
                    r = await h.http.post(path, json=req)
                    assert r.status == 200 and (await r.json())["model"] == ok[0], (name, path)
    run(body())


@pytest.mark.parametrize("name, checkpoint, root", [
    ("org/m", "/hub/models--org--m/snapshots/0", "org/m"),  # a repo id: the id, not the Hub cache's snapshot
    ("m", "/models/m", "/models/m"),  # a directory: its path
    ("tiny", None, "tiny"),  # a random shape
])
def test_models_root_is_the_model_as_given_as_vllm(tmp_path, name, checkpoint, root):
    """vLLM's ModelCard root is its --model string; pushkv gave a repo id's snapshot path in the Hub cache."""
    async def body():
        cfg = make_cfg(tmp_path, "local")
        cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, name=name, checkpoint=checkpoint))
        async with Harness(cfg, {"local": local_script([[72]], "stop")}) as h:
            listed = await (await h.http.get("/v1/models")).json()
            assert [(c["id"], c["root"]) for c in listed["data"]] == [(name, root)]
    run(body())


def test_push_sends_both_legs_at_once(tmp_path):
    d_got_generate = threading.Event()

    def p_script(g):  # P answers only once D holds its leg: the router must not wait for P
        return [(d_got_generate, m.PrefillFinished(g.transfer_id, 0, 7, None, (stage("prefill_done"),)))]

    def d_script(g):
        d_got_generate.set()
        return [(None, tokens(g, [7, 8])), (None, tokens(g, [9], True, "length", (stage("kv_received"),)))]

    async def body():
        cfg = make_cfg(tmp_path, "push")
        async with Harness(cfg, {"prefill": p_script, "decode": d_script}) as h:
            r = await h.http.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 3})
            assert r.status == 200, await r.text()
            out = await r.json()
            p = h.log.received("prefill", m.Generate)[0]
            d = h.log.received("decode", m.Generate)[0]
            assert p.transfer_id == d.transfer_id == out["pushkv"]["transfer_id"]
            assert (p.leg, p.max_tokens, p.generation) == ("prefill", 1, 0)
            assert (d.leg, d.max_tokens, d.generation, d.pull) == ("decode", 3, 0, None)
            assert d.source == m.PrefillSource("prefill-engine", 1, (f"ipc://{tmp_path}/prefill.hs0",))
            assert p.prompt_token_ids == d.prompt_token_ids == (1, 2, 3, 4)
            assert out["choices"][0]["token_ids"] == [7, 8, 9]
            tl = out["pushkv"]["timeline"]
            assert "prefill.prefill_done" in tl and "decode.kv_received" in tl and "router.prefill_finished" in tl
            assert not h.log.received("prefill", m.Abort) and not h.log.received("decode", m.Abort)
    run(body())


def test_pull_sends_decode_after_prefill_with_params(tmp_path):
    release_p = threading.Event()
    params = {}

    def p_script(g):
        src = m.PrefillSource("prefill-engine", 1, ("ipc://hs",))
        params["pull"] = m.PullParams(src, (3, 4, 5), len(g.prompt_token_ids), 42, 123.0)
        return [(release_p, m.PrefillFinished(g.transfer_id, 0, 42, params["pull"], (stage("held"),)))]

    def d_script(g):
        return [(None, tokens(g, [42, 43], True, "length"))]

    async def body():
        cfg = make_cfg(tmp_path, "pull")
        async with Harness(cfg, {"prefill": p_script, "decode": d_script}) as h:
            req = asyncio.create_task(h.http.post("/v1/completions", json={"prompt": [5] * 20, "max_tokens": 2}))
            await h.wait(lambda e: any(r == "prefill" and d == "recv" and isinstance(x, m.Generate) for r, d, x in e))
            assert not h.log.received("decode", m.Generate)  # P has not answered yet
            release_p.set()
            r = await req
            assert r.status == 200
            out = await r.json()
            assert h.log.index("prefill", "send", m.PrefillFinished) < h.log.index("decode", "recv", m.Generate)
            d = h.log.received("decode", m.Generate)[0]
            assert d.pull == params["pull"] and d.source == params["pull"].source
            assert d.transfer_id == h.log.received("prefill", m.Generate)[0].transfer_id
            assert out["choices"][0]["token_ids"] == [42, 43]
            assert "prefill.held" in out["pushkv"]["timeline"]
    run(body())


def test_streaming_shape_and_split_utf8(tmp_path):
    async def body():
        cfg = make_cfg(tmp_path, "local")
        # "é" is two bytes sent in two messages: the first chunk carries no text
        async with Harness(cfg, {"local": local_script([[104], [195], [169], [33]])}) as h:
            r = await h.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, "stream": True})
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            ev = await read_sse(r)
            assert ev[-1] == "[DONE]"
            chunks, final = ev[:-1], ev[-2]
            assert [c["choices"][0]["token_ids"] for c in chunks] == [[104], [195], [169], [33]]
            # vLLM's: the finish_reason on the last token's chunk, no token-less chunk after it
            assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
            assert [c["choices"][0]["text"] for c in chunks] == ["h", "", "é", "!"]
            assert final["choices"][0]["stop_reason"] is None
            assert "usage" not in final  # no stream_options: no usage at all, as vLLM's
            assert "router.first_token" in final["pushkv"]["timeline"]
            assert len({c["id"] for c in ev[:-1]}) == 1
    run(body())


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_usage_only_in_the_chunk_after_the_last(tmp_path, chat, include_usage):
    """vLLM's (serving_completion's completion_stream_generator, as its chat one): usage comes once, in an extra
    chunk of no choices after the last, and only with stream_options.include_usage; pushkv's extension stays on a
    one-choice completion's finish chunk."""
    async def body():
        cfg = make_cfg(tmp_path, "local")
        async with Harness(cfg, {"local": local_script([[104], [105], [33]])}) as h:
            req: dict = {"max_tokens": 3, "stream": True}
            if include_usage:
                req["stream_options"] = {"include_usage": True}
            path = "/v1/chat/completions" if chat else "/v1/completions"
            req.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
            ev = await read_sse(await h.http.post(path, json=req))
            assert ev[-1] == "[DONE]"
            with_usage = [e for e in ev[:-1] if e.get("usage") is not None]
            if include_usage:
                assert with_usage == [ev[-2]] and ev[-2]["choices"] == []
                assert ev[-2]["usage"]["completion_tokens"] == 3
            else:
                assert with_usage == [] and ev[-2]["choices"]
            finish = [e for e in ev[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
            assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
            assert ("pushkv" in finish[0]) is not chat
    run(body())


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_completion_stop_reason_is_the_stop_token_id(tmp_path, stream, chat):
    """vLLM's stop_reason, in completion and chat choices: the stop_token_ids entry that ended the choice; None
    where it ended otherwise (an id not asked for: EOS, here) or on length."""
    stopped, capped = local_script([[104], [7]], "stop"), local_script([[104], [105]])

    async def body():
        cfg = make_cfg(tmp_path, "local")
        async with Harness(cfg, {"local": lambda g: capped(g) if g.max_tokens == 2 else stopped(g)}) as h:
            got = []
            for extra in ({"stop_token_ids": [9, 7]}, {}, {"stop_token_ids": [7], "max_tokens": 2}):
                ask = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
                r = await h.http.post("/v1/chat/completions" if chat else "/v1/completions",
                                      json={**ask, "max_tokens": 4, "stream": stream, **extra})
                if stream:
                    ev = await read_sse(r)
                    assert all(e["choices"][0]["stop_reason"] is None for e in ev[:-2])
                    c = ev[-2]["choices"][0]
                else:
                    c = (await r.json())["choices"][0]
                got.append((c["finish_reason"], c["stop_reason"]))
            assert got == [("stop", 7), ("stop", None), ("length", None)]
    run(body())


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_gives_the_prompts_and_the_outputs_ids(tmp_path, stream, chat):
    """vLLM's return_token_ids: completion choices add their prompt's ids (in a stream, the choice's first chunk);
    chat adds the prompt's ids to the response (a stream's opening chunk) and each choice's (chunk's) output ids."""
    sent: list = []  # the prompt each instance was given

    def script(g):
        sent.append(list(g.prompt_token_ids))
        return local_script([[104], [105]])(g)

    async def body():
        cfg = make_cfg(tmp_path, "local")
        async with Harness(cfg, {"local": script}) as h:
            ask = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [5, 6, 7]}
            r = await h.http.post("/v1/chat/completions" if chat else "/v1/completions",
                                  json={**ask, "max_tokens": 2, "stream": stream, "return_token_ids": True})
            if not stream:
                out = await r.json()
                c = out["choices"][0]
                prompt = out["prompt_token_ids"] if chat else c["prompt_token_ids"]
                assert c["token_ids"] == [104, 105]
            else:
                ev = [e for e in await read_sse(r) if e != "[DONE]"]
                got = [e.get("prompt_token_ids", e["choices"][0].get("prompt_token_ids")) for e in ev]
                assert all(p is None for p in got[1:]), got  # the first chunk only
                prompt = got[0]
                assert sum((e["choices"][0].get("token_ids", []) for e in ev), []) == [104, 105]
            assert prompt == sent[0] and (chat or prompt == [5, 6, 7])
            plain = await h.http.post("/v1/chat/completions" if chat else "/v1/completions",
                                      json={**ask, "max_tokens": 2})
            c = (await plain.json())["choices"][0]
            assert "prompt_token_ids" not in c and ("token_ids" in c) is not chat
    run(body())


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_return_token_ids_gives_the_prompt_as_ids_not_text(tmp_path, stream):
    """vLLM's serving_completion: with return_token_ids an echoed prompt comes back as prompt_token_ids only, the
    choice's text being its output's alone (in a stream too: the first chunk's text is the first tokens'); without
    it, the prompt's text opens the choice's."""
    async def body():
        cfg = make_cfg(tmp_path, "local")
        async with Harness(cfg, {"local": local_script([[104], [105]])}) as h:
            async def ask(**extra) -> tuple[str, list, list]:
                r = await h.http.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 2, "echo": True,
                                                               "stream": stream, **extra})
                assert r.status == 200, await r.text()
                if not stream:
                    c = (await r.json())["choices"][0]
                    return c["text"], c.get("prompt_token_ids"), c["token_ids"]
                chunks = [e["choices"][0] for e in await read_sse(r) if e != "[DONE]" and e["choices"]]
                return ("".join(c["text"] for c in chunks), chunks[0].get("prompt_token_ids"),
                        sum((c["token_ids"] for c in chunks), []))

            assert await ask(return_token_ids=True) == ("hi", list(b"Hey"), [104, 105])
            assert await ask() == ("Heyhi", None, [104, 105])
    run(body())


def test_a_batchs_prompts_sample_as_requests_of_their_own(tmp_path):
    """vLLM's: each prompt of a completions batch is its own request, so choice c of every prompt samples from the
    same seeded stream, and two equal prompts with one seed draw the same tokens."""
    seeds: dict[tuple, int] = {}

    def script(g):
        seeds[(tuple(g.prompt_token_ids), len(seeds))] = g.sampling.seed
        return local_script([[104]])(g)

    async def body():
        cfg = make_cfg(tmp_path, "local")
        async with Harness(cfg, {"local": script}) as h:
            r = await h.http.post("/v1/completions", json={"prompt": [[5, 6], [5, 6], [7]], "n": 2, "max_tokens": 1,
                                                           "temperature": 1.0})
            assert r.status == 200 and len(set(seeds.values())) == 6  # unseeded: each choice its own stream
            seeds.clear()
            r = await h.http.post("/v1/completions", json={"prompt": [[5, 6], [5, 6], [7]], "n": 2, "max_tokens": 1,
                                                           "temperature": 1.0, "seed": 3})
            assert r.status == 200
    run(body())
    got = sorted(seeds.values())
    assert len(seeds) == 6 and len(set(got)) == 2 and got.count(got[0]) == 3  # choice 0 and choice 1, per prompt


def test_a_batchs_max_tokens_is_cut_to_each_prompts_own_room(tmp_path):
    """vLLM's get_max_tokens per prompt: a short prompt of a batch keeps the max_tokens asked for where a long one
    beside it is cut to its room (both had been cut to the long one's)."""
    asked: dict[int, tuple[int, int]] = {}

    def script(g):
        asked[len(g.prompt_token_ids)] = (g.max_tokens, g.sampling.min_tokens)
        return local_script([[104]])(g)

    async def body():
        cfg = make_cfg(tmp_path, "local", max_model_len=64)
        async with Harness(cfg, {"local": script}) as h:
            r = await h.http.post("/v1/completions", json={"prompt": [[1, 2], [1] * 59], "max_tokens": 30,
                                                           "min_tokens": 10})
            assert r.status == 200
    run(body())
    assert asked == {2: (30, 10), 59: (5, 5)}


BAD_BODIES = [
    ("malformed json", b"{not json"),
    ("not an object", [1, 2]),
    ("missing prompt", {"max_tokens": 4}),
    ("prompt wrong type", {"prompt": 5}),
    ("prompt mixed list", {"prompt": [1, "a"]}),
    ("empty string", {"prompt": ""}),
    ("empty token list", {"prompt": []}),
    ("batch with an empty prompt", {"prompt": ["a", ""]}),
    ("token id above vocab", {"prompt": [1, 320]}),
    ("negative token id", {"prompt": [-1]}),
    ("bool token id", {"prompt": [True]}),
    ("too long", {"prompt": [1] * 64, "max_tokens": 5}),  # no room left (a max_tokens past the room is cut to it)
    ("max_tokens zero", {"prompt": "hi", "max_tokens": 0}),
    ("max_tokens string", {"prompt": "hi", "max_tokens": "4"}),
    ("temperature negative", {"prompt": "hi", "temperature": -0.5}),
    ("temperature string", {"prompt": "hi", "temperature": "hot"}),
    ("top_p zero", {"prompt": "hi", "top_p": 0}),
    ("top_k float", {"prompt": "hi", "top_k": 1.5}),
    ("min_p above one", {"prompt": "hi", "min_p": 2}),
    ("seed string", {"prompt": "hi", "seed": "7"}),
    ("presence penalty", {"prompt": "hi", "presence_penalty": 3}),
    ("frequency penalty", {"prompt": "hi", "frequency_penalty": -2.5}),
    ("logit_bias list", {"prompt": "hi", "logit_bias": [1, 2]}),
    ("logit_bias key", {"prompt": "hi", "logit_bias": {"a": 1}}),
    ("logit_bias id", {"prompt": "hi", "logit_bias": {"999": 1}}),
    ("logit_bias value", {"prompt": "hi", "logit_bias": {"5": 101}}),
    ("stop number", {"prompt": "hi", "stop": 5}),
    ("stop empty", {"prompt": "hi", "stop": [""]}),
    ("min_tokens over max", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}),
    ("logprobs too many", {"prompt": "hi", "logprobs": 21}),
    ("logprobs bool", {"prompt": "hi", "logprobs": True}),
    ("prompt_logprobs too many", {"prompt": "hi", "prompt_logprobs": 21}),
    ("prompt_logprobs negative", {"prompt": "hi", "prompt_logprobs": -1}),
    ("prompt_logprobs streamed", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}),
    ("max_tokens 0 without echo", {"prompt": "hi", "max_tokens": 0}),
    ("n zero", {"prompt": "hi", "n": 0}),
    ("n too many", {"prompt": "hi", "n": 17}),
    ("best_of", {"prompt": "hi", "best_of": 3}),
    ("suffix", {"prompt": "hi", "suffix": "x"}),
    ("repetition penalty zero", {"prompt": "hi", "repetition_penalty": 0}),
    ("repetition penalty huge", {"prompt": "hi", "repetition_penalty": 1e9}),
    ("stream_options", {"prompt": "hi", "stream": True, "stream_options": 1}),
    ("stream not bool", {"prompt": "hi", "stream": "yes"}),
    ("stop ids wrong type", {"prompt": "hi", "stop_token_ids": "a"}),
    ("stop id outside vocab", {"prompt": "hi", "stop_token_ids": [999]}),
]


def test_client_errors_are_4xx(tmp_path):
    async def body():
        cfg = make_cfg(tmp_path, "push", max_model_len=64, timeouts=Timeouts(request_s=0.5))
        async with Harness(cfg, {"prefill": None, "decode": None}) as h:
            for name, payload in BAD_BODIES:
                kw = {"data": payload} if isinstance(payload, bytes) else {"json": payload}
                r = await h.http.post("/v1/completions", **kw)
                assert r.status == 400, name
                err = (await r.json())["error"]
                assert err["type"] == "invalid_request_error" and err["message"], name
            # nothing reached a scheduler but the router's epoch
            assert not [e for e in h.log.entries if not isinstance(e[2], m.RouterEpoch)]
            # exactly at the limit is accepted; the silent fakes then time it out
            r = await h.http.post("/v1/completions", json={"prompt": "hi", "temperature": 0, "max_tokens": 62})
            assert r.status == 504
            assert (await r.json())["error"]["type"] == "timeout"
            await h.wait_abort("prefill")
            await h.wait_abort("decode")
    run(body())


def failing(status, reason="no free blocks"):
    return lambda g: [(None, m.RequestFailed(g.transfer_id, 0, reason, status))]


@pytest.mark.parametrize("stream", [False, True])
def test_failed_decode_leg_aborts_prefill(tmp_path, stream):
    async def body():
        cfg = make_cfg(tmp_path, "push")
        async with Harness(cfg, {"prefill": None, "decode": failing(507)}) as h:
            r = await h.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, "stream": stream})
            if stream:
                ev = await read_sse(r)
                assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == 507
                assert "no free blocks" in ev[-2]["error"]["message"]
            else:
                assert r.status == 507
                assert "no free blocks" in (await r.json())["error"]["message"]
            await h.wait_abort("prefill")
            tid = h.log.received("decode", m.Generate)[0].transfer_id
            assert h.log.received("prefill", m.Abort)[0].transfer_id == tid
            assert not h.log.received("decode", m.Abort)  # the failed leg is not aborted again
    run(body())


def test_failed_prefill_leg_in_pull_never_sends_decode(tmp_path):
    async def body():
        cfg = make_cfg(tmp_path, "pull")
        async with Harness(cfg, {"prefill": failing(500, "worker died"), "decode": None}) as h:
            r = await h.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})
            assert r.status == 500 and "worker died" in (await r.json())["error"]["message"]
            assert not h.log.received("decode", m.Generate) and not h.log.received("prefill", m.Abort)
    run(body())


def test_failed_prefill_leg_in_push_aborts_decode(tmp_path):
    async def body():
        cfg = make_cfg(tmp_path, "push")
        async with Harness(cfg, {"prefill": failing(503, "overloaded"), "decode": None}) as h:
            r = await h.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})
            assert r.status == 503
            await h.wait_abort("decode")
    run(body())


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_every_leg(tmp_path, stream):
    def d_script(g):  # one token, then nothing: the request would hang without the abort
        return [(None, tokens(g, [65]))]

    async def body():
        cfg = make_cfg(tmp_path, "push")
        async with Harness(cfg, {"prefill": None, "decode": d_script}) as h:
            if stream:
                r = await h.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 8, "stream": True})
                first = await r.content.readline()
                assert first.startswith(b"data: ")
                r.close()  # drop the connection mid-stream
            else:
                # a raw connection, so that closing it is a real disconnect
                host, port = h.router.url[len("http://"):].rsplit(":", 1)
                reader, writer = await asyncio.open_connection(host, int(port))
                payload = json.dumps({"prompt": [1], "max_tokens": 8}).encode()
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
                await writer.drain()
                await h.wait(lambda e: any(r == "decode" and d == "send" for r, d, _ in e))
                writer.close()
                await writer.wait_closed()
            await h.wait_abort("prefill")
            await h.wait_abort("decode")
            tid = h.log.received("decode", m.Generate)[0].transfer_id
            assert {a.transfer_id for a in h.log.received("prefill", m.Abort) + h.log.received("decode", m.Abort)} == {tid}
            await asyncio.wait_for(h.router._handlers_idle.wait(), WAIT_S)
            metrics = await (await h.http.get("/metrics")).text()
            assert 'pushkv_router_requests_total{outcome="aborted"} 1.0' in metrics
    run(body())


def test_push_decode_done_before_prefill_reports(tmp_path):
    def d_script(g):
        return [(None, tokens(g, [1], True, "length"))]

    async def body():
        cfg = make_cfg(tmp_path, "push")
        async with Harness(cfg, {"prefill": None, "decode": d_script}) as h:
            r = await h.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
            assert r.status == 200  # answered after the short grace for P's timeline
            await h.wait_abort("prefill")
            assert not h.log.received("decode", m.Abort)
    run(body())


def test_abort_endpoint(tmp_path):
    async def body():
        cfg = make_cfg(tmp_path, "local")
        async with Harness(cfg, {"local": lambda g: [(None, tokens(g, [65]))]}) as h:
            r = await h.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 8, "stream": True})
            first = json.loads((await r.content.readline())[len(b"data: "):])
            a = await h.http.post(f"/v1/abort/{first['id']}")
            assert a.status == 200
            ev = await read_sse(r)
            assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == 499
            await h.wait_abort("local")
            assert (await h.http.post("/v1/abort/cmpl-nope")).status == 404
    run(body())


@pytest.mark.parametrize("chat", [False, True])
def test_the_clients_request_id_names_the_response_and_aborts_it(tmp_path, chat):
    """vLLM's X-Request-Id (over the body's request_id): the response's id is the endpoint's prefix and it, the
    response's header echoes it, /v1/abort takes it; a malformed one is a 400 naming the header."""
    async def body():
        cfg = make_cfg(tmp_path, "local")
        async with Harness(cfg, {"local": lambda g: [(None, tokens(g, [65]))] if g.max_tokens == 8
                                 else local_script([[65], [66]])(g)}) as h:
            path = "/v1/chat/completions" if chat else "/v1/completions"
            ask = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [1]}
            prefix = "chatcmpl" if chat else "cmpl"
            r = await h.http.post(path, json={**ask, "max_tokens": 2, "request_id": "body-1"},
                                  headers={"X-Request-Id": "gw-7f3a"})
            assert (await r.json())["id"] == f"{prefix}-gw-7f3a" and r.headers["X-Request-Id"] == "gw-7f3a"
            r = await h.http.post(path, json={**ask, "max_tokens": 2, "request_id": "body-1"})
            assert (await r.json())["id"] == f"{prefix}-body-1" and r.headers["X-Request-Id"] == f"{prefix}-body-1"
            r = await h.http.post(path, json={**ask, "max_tokens": 2})
            own = (await r.json())["id"]
            assert r.headers["X-Request-Id"] == own and len(own) == len(prefix) + 33  # pushkv's: a uuid
            r = await h.http.post(path, json={**ask, "max_tokens": 8, "stream": True}, headers={"X-Request-Id": "s-1"})
            assert r.headers["X-Request-Id"] == "s-1"
            await r.content.readline()
            assert (await h.http.post("/v1/abort/s-1")).status == 200
            ev = await read_sse(r)
            assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == 499
            await h.wait_abort("local")
            bad = await h.http.post(path, json={**ask, "max_tokens": 2}, headers={"X-Request-Id": "a b"})
            assert bad.status == 400 and (await bad.json())["error"]["param"] == "X-Request-Id"
            # an id of the endpoint's own shape is taken as sent; a bare prefix names no request (it had named every
            # request that gave no id of its own)
            r = await h.http.post(path, json={**ask, "max_tokens": 8, "stream": True},
                                  headers={"X-Request-Id": f"{prefix}-abc"})
            plain = await h.http.post(path, json={**ask, "max_tokens": 8, "stream": True})
            await r.content.readline()
            plain_id = json.loads((await plain.content.readline())[len(b"data: "):])["id"]
            assert (await h.http.post(f"/v1/abort/{prefix}-")).status == 404
            assert (await h.http.post(f"/v1/abort/{prefix}-abc")).status == 200
            assert (await read_sse(r))[-2]["error"]["code"] == 499
            assert (await h.http.post(f"/v1/abort/{plain_id}")).status == 200  # still running after the bare prefix
            assert (await read_sse(plain))[-2]["error"]["code"] == 499
    run(body())


def test_metrics_exposes_counters(tmp_path):
    async def body():
        cfg = make_cfg(tmp_path, "local")
        async with Harness(cfg, {"local": local_script([[65], [66], [67]])}) as h:
            assert (await h.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 3})).status == 200
            assert (await h.http.post("/v1/completions", json={"prompt": ""})).status == 400
            r = await h.http.get("/metrics")
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
            for line in ('pushkv_router_requests_total{outcome="ok"} 1.0',
                         'pushkv_router_requests_total{outcome="rejected"} 1.0',
                         "pushkv_router_ttft_seconds_count 1.0", "pushkv_router_tpot_seconds_count 1.0",
                         "pushkv_router_itl_seconds_count 2.0", "pushkv_router_e2e_seconds_count 1.0",
                         "pushkv_router_requests_in_flight 0.0", "pushkv_router_generation_tokens_total 3.0",
                         'pushkv_router_stage_seconds_count{stage="local.finished"} 1.0'):
                assert line in text, line
            health = await h.http.get("/health")
            assert health.status == 200 and (await health.json())["mode"] == "local"
    run(body())


def test_stop_fails_inflight_with_503_and_frees_port(tmp_path):
    async def body():
        cfg = make_cfg(tmp_path, "local")
        h = Harness(cfg, {"local": None})
        await h.__aenter__()
        try:
            req = asyncio.create_task(h.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 8}))
            await h.wait(lambda e: any(r == "local" and d == "recv" and isinstance(x, m.Generate) for r, d, x in e))
            await h.router.stop()
            r = await req
            assert r.status == 503
            await h.wait_abort("local")
            port = int(h.router.url.rsplit(":", 1)[1])
            with socket.socket() as s:  # nothing listens there any more (TIME_WAIT may linger)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
                s.listen()
        finally:
            await h.__aexit__(None, None, None)
    run(body())



def test_a_restart_drains_nothing_under_shutdown_timeout(tmp_path):
    """A router the supervisor restarts (``restart router``) is killed at --stop-timeout (10 s by default); under
    --shutdown-timeout 60 it drained, was killed mid-drain, and its streams in flight ended with neither an error event
    nor [DONE]. A restart now fails them with 503 at once, as without the flag (the deployment's stop still drains:
    tests/e2e/test_shutdown_drain.py)."""
    async def body():
        h = Harness(make_cfg(tmp_path, "local", shutdown_timeout_s=60.0), {"local": None})
        await h.__aenter__()
        try:
            req = asyncio.create_task(h.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 8}))
            await h.wait(lambda e: any(r == "local" and d == "recv" and isinstance(x, m.Generate) for r, d, x in e))
            h.router.shutdown_asked("restart")
            stop = asyncio.create_task(h.router.stop())
            r = await asyncio.wait_for(req, 5)
            assert r.status == 503 and (await r.json())["error"]["message"] == "router shutting down"
            await asyncio.wait_for(stop, 10)
            await h.wait_abort("local")
        finally:
            await h.__aexit__(None, None, None)
    run(body())


# ---------------------------------------------------------------------------
# The process entry: readiness, Ping/Pong, Shutdown, SIGTERM
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["shutdown", "sigterm"])
def test_router_process_control(tmp_path, how):
    ctx = zmq.Context.instance()
    control = ctx.socket(zmq.ROUTER)
    control.setsockopt(zmq.LINGER, 0)
    control_ep = f"ipc://{tmp_path}/control"
    control.bind(control_ep)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = msgspec.structs.replace(make_cfg(tmp_path, "local"), port=port, control_endpoint=control_ep)
    path = tmp_path / "cfg.json"
    path.write_bytes(encode_config(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "processes.router", "--config", str(path)], cwd=ROOT)
    try:
        assert control.poll(15_000), "no Ready from the router"
        ident, payload = control.recv_multipart()
        ready = m.DEC_CONTROL.decode(payload)
        assert isinstance(ready, m.Ready) and ready.name == "router" and ready.pid == proc.pid
        assert ready.url == f"http://127.0.0.1:{port}"

        async def health():
            async with aiohttp.ClientSession() as s:
                return (await s.get(f"{ready.url}/health")).status
        assert run(health()) == 200

        control.send_multipart([ident, m.encode(m.Ping())])
        assert control.poll(5_000)
        pong = m.DEC_CONTROL.decode(control.recv_multipart()[1])
        assert isinstance(pong, m.Pong) and pong.pid == proc.pid
        if how == "shutdown":
            control.send_multipart([ident, m.encode(m.Shutdown(reason="test"))])
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        control.close(0)


def test_push_first_logprob_comes_from_prefill_even_when_late(tmp_path):
    """D's first token waits for P's logprob of it; the client gets one entry per token."""
    d_sent_first = threading.Event()
    lp = lambda v: m.TokenLogprob(v, (65, 66), (v, v - 1))  # noqa: E731

    def p_script(g):
        assert g.sampling is not None and g.sampling.logprobs == 2
        return [(d_sent_first, m.TokensGenerated(g.transfer_id, 0, (65,), logprobs=(lp(-0.1),))),
                (d_sent_first, m.PrefillFinished(g.transfer_id, 0, 65, None, ()))]

    def d_script(g):
        d_sent_first.set()
        return [(None, tokens(g, [65])),
                (None, msgspec.structs.replace(tokens(g, [66], True, "length"), logprobs=(lp(-0.2),)))]

    async def body():
        cfg = make_cfg(tmp_path, "push")
        async with Harness(cfg, {"prefill": p_script, "decode": d_script}) as h:
            r = await h.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "logprobs": 2})
            out = await r.json()
            c = out["choices"][0]
            assert c["text"] == "AB" and c["token_ids"] == [65, 66]
            assert c["logprobs"]["token_logprobs"] == pytest.approx([-0.1, -0.2])
            assert c["logprobs"]["top_logprobs"] == [{"A": pytest.approx(-0.1), "B": pytest.approx(-1.1)},
                                                     {"A": pytest.approx(-0.2), "B": pytest.approx(-1.2)}]
    run(body())


def test_a_local_choice_a_stop_string_ends_still_counts_its_cached_prompt_tokens(tmp_path):
    """The first token tells the prefix-cache hits (usage.prompt_tokens_details), as the finish does: a stop string
    ends the choice before any finish arrives."""
    never = threading.Event()

    def script(g):
        first = msgspec.structs.replace(tokens(g, [104]), cached_tokens=16)
        return [(None, first)] + [(None, tokens(g, [i])) for i in b"i end"] + [(never, tokens(g, [33], True))]

    async def body():
        cfg = make_cfg(tmp_path, "local")
        async with Harness(cfg, {"local": script}) as h:
            r = await h.http.post("/v1/completions", json={"prompt": [1] * 20, "max_tokens": 9, "stop": ["end"]})
            out = await r.json()
            assert (out["choices"][0]["text"], out["choices"][0]["finish_reason"]) == ("hi ", "stop")
            assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}, out["usage"]
            await h.wait_abort("local")
            never.set()
    run(body())


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_request_and_aborts_its_legs(tmp_path, stream):
    """"end" arrives over three tokens; text stops before it and D's leg is aborted at once."""
    never = threading.Event()

    def p_script(g):
        return [(None, m.PrefillFinished(g.transfer_id, 0, 104, None, ()))]

    def d_script(g):
        return [(None, tokens(g, [i])) for i in b"hi en"] + [(None, tokens(g, [100])), (never, tokens(g, [33], True))]

    async def body():
        cfg = make_cfg(tmp_path, "push")
        async with Harness(cfg, {"prefill": p_script, "decode": d_script}) as h:
            r = await h.http.post("/v1/completions", json={"prompt": [1], "max_tokens": 9, "stop": ["end", "x"],
                                                           "stream": stream})
            if stream:
                ev = await read_sse(r)
                text = "".join(e["choices"][0]["text"] for e in ev[:-1])
                last = ev[-2]["choices"][0]
            else:
                last = (await r.json())["choices"][0]
                text = last["text"]
            # vLLM's stop_reason: the stop string that matched
            assert (text, last["finish_reason"], last["stop_reason"]) == ("hi ", "stop", "end")
            await h.wait_abort("decode")
            never.set()
    run(body())


def test_chat_stream_shape_n2_and_usage(tmp_path):
    async def body():
        cfg = make_cfg(tmp_path, "local")
        script = local_script([[228, 189], [160], [33]])  # "你" split over two messages, then "!"
        async with Harness(cfg, {"local": script}) as h:
            r = await h.http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 1, "seed": 5})
            ev = await read_sse(r)
            assert ev[-1] == "[DONE]" and ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 8
            gens = h.log.received("local", m.Generate)
            assert len(gens) == 2 and len({g.transfer_id for g in gens}) == 2
            assert len({g.sampling.seed for g in gens}) == 2  # each choice its own stream
            assert gens[0].prompt_token_ids == tuple(b"user: hi\nassistant:")
            for i in (0, 1):
                mine = [e["choices"][0] for e in ev[:-2] if e["choices"][0]["index"] == i]
                assert mine[0]["delta"] == {"role": "assistant", "content": ""}
                assert [c["delta"].get("content") for c in mine[1:]] == ["", "你", "!"]
                assert [c["finish_reason"] for c in mine[1:]] == [None, None, "length"]  # on the last token's
            assert all(e["object"] == "chat.completion.chunk" and e["id"].startswith("chatcmpl-") for e in ev[:-1])
    run(body())


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(tmp_path, chat):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, each chunk carries its choice's prompt
    and output tokens so far, growing as the tokens come; the request's total still ends the stream."""
    async def body():
        cfg = make_cfg(tmp_path, "local")
        async with Harness(cfg, {"local": local_script([[104], [105], [33]])}) as h:
            req = {"max_tokens": 3, "n": 2, "stream": True, "temperature": 1, "seed": 5,
                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            path = "/v1/chat/completions" if chat else "/v1/completions"
            req.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
            ev = await read_sse(await h.http.post(path, json=req))
            assert ev[-1] == "[DONE]" and ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 6
            prompt = ev[-2]["usage"]["prompt_tokens"]  # each choice has the one prompt
            for i in (0, 1):
                mine = [e for e in ev[:-2] if e["choices"][0]["index"] == i]
                seen = [e["usage"]["completion_tokens"] for e in mine]
                assert seen == sorted(seen) and seen[-1] == 3 and len(mine) >= 3
                if chat:  # the role chunk, before any output, as vLLM's: 0
                    assert mine[0]["choices"][0]["delta"].get("role") == "assistant" and seen[0] == 0
                assert all(e["usage"]["prompt_tokens"] == prompt and e["usage"]["total_tokens"] ==
                           prompt + e["usage"]["completion_tokens"] for e in mine)
            plain = await read_sse(await h.http.post(path, json={**req, "stream_options": {"include_usage": True}}))
            assert all("usage" not in e or e["usage"] is None for e in plain[:-2])
    run(body())


def test_chat_stream_opens_with_the_first_token(tmp_path):
    """The role chunk goes out with the first output, not before prefill: a client's TTFT is true."""
    first = threading.Event()

    def script(g):
        return [(first, tokens(g, [104])), (first, tokens(g, [105], True, "length"))]

    async def body():
        cfg = make_cfg(tmp_path, "local")
        async with Harness(cfg, {"local": script}) as h:
            r = await h.http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True})
            assert r.status == 200
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(r.content.readline(), 0.5)  # nothing while no token exists
            first.set()
            ev = await read_sse(r)
            assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert [e["choices"][0]["delta"].get("content") for e in ev[1:-1]] == ["h", "i"]
            assert ev[-2]["choices"][0]["finish_reason"] == "length"
    run(body())


class QueueWatcher:
    """Discovery as a test hands it: no instance at start, then each event put."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()

    def snapshot(self):
        return []

    async def events(self):
        while True:
            yield await self.queue.get()

    async def close(self):
        pass


def test_a_router_started_while_a_host_drains_links_its_instance_and_chooses_it_for_nothing(tmp_path):
    """A router that starts while a D host drains (its record already says draining) links the instance all the
    same, so that its scheduler hears the router's epoch (and drops what a router before it at this place left
    running, where the drain would wait it out), and places nothing on it: with no other D, a request is refused."""
    from pushkv.discovery.records import InstanceRecord, InstanceUp

    async def body():
        cfg = make_cfg(tmp_path, "push")
        h = Harness(cfg, {"prefill": None, "decode": None})
        watcher = h.router.watcher = QueueWatcher()
        async with h:
            for role in ("prefill", "decode"):
                inst = cfg.instance(role)
                watcher.queue.put_nowait(InstanceUp(InstanceRecord(
                    engine_id=inst.engine_id, role=role, sched_endpoint=inst.sched_endpoint,
                    handshake_endpoints=inst.handshake_endpoints, num_blocks=64, draining=role == "decode")))
            await h.wait(lambda e: any(r == "decode" and isinstance(x, m.RouterEpoch) for r, d, x in e))
            r = await h.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
            assert r.status == 503 and "no live decode instance" in (await r.json())["error"]["message"]
            health = {i["role"]: i for i in (await (await h.http.get("/health")).json())["instances"]}
            assert health["decode"]["draining"] and not health["prefill"]["draining"]
            assert not h.log.received("decode", m.Generate)
    run(body())
