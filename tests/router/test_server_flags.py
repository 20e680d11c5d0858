"""vLLM's server flags over a request's answer, through the router's HTTP server (fake schedulers behind it):
``--enable-force-include-usage`` (every stream carries usage, each chunk's and the total, whatever stream_options
asks) and ``--return-tokens-as-token-ids`` (logprob tokens written ``token_id:N`` unless the request says false)."""
from __future__ import annotations

import pytest

from pushkv import messages as m
from pushkv.router import api, text
from tests.router.test_router import read_sse, run
from tests.support.router_fakes import Harness, make_cfg

LP = m.TokenLogprob(-0.5, (105,), (-0.7,))


def script(g: m.Generate):
    lps = (LP,) if g.sampling is not None and g.sampling.logprobs >= 0 else ()
    return [(None, m.TokensGenerated(g.transfer_id, g.generation, (104,), False, "", len(g.prompt_token_ids),
                                     logprobs=lps)),
            (None, m.TokensGenerated(g.transfer_id, g.generation, (105,), True, "length", len(g.prompt_token_ids),
                                     logprobs=lps))]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("options", [None, {"include_usage": False}, {"include_usage": True}])
def test_force_include_usage_puts_usage_in_every_stream(tmp_path, chat, options):
    """vLLM's should_include_usage: with the flag, include_usage and continuous_usage_stats both, whatever the
    request's stream_options say."""
    async def body():
        async with Harness(make_cfg(tmp_path, "local", force_include_usage=True), {"local": script}) as h:
            req: dict = {"max_tokens": 2, "stream": True}
            if options is not None:
                req["stream_options"] = options
            path = "/v1/chat/completions" if chat else "/v1/completions"
            req.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
            ev = await read_sse(await h.http.post(path, json=req))
            assert ev[-1] == "[DONE]" and ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 2
            seen = [e["usage"]["completion_tokens"] for e in ev[:-2]]
            assert seen[-1] == 2 and seen == sorted(seen)
            unary = await h.http.post(path, json={**req, "stream": False, "stream_options": None})
            assert (await unary.json())["usage"]["completion_tokens"] == 2
    run(body())


def test_without_the_flag_a_stream_has_usage_only_when_asked(tmp_path):
    async def body():
        async with Harness(make_cfg(tmp_path, "local"), {"local": script}) as h:
            ev = await read_sse(await h.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                                           "stream": True}))
            assert all(e.get("usage") is None for e in ev[:-1])
    run(body())


@pytest.mark.parametrize("flag, asked, want", [
    (True, None, ["token_id:104", "token_id:105"]),  # the flag, where the request says nothing
    (True, False, ["h", "i"]),  # the request's own false wins, as vLLM's
    (False, True, ["token_id:104", "token_id:105"]),
    (False, None, ["h", "i"]),
])
def test_return_tokens_as_token_ids_is_the_default_a_request_may_override(tmp_path, flag, asked, want):
    async def body():
        async with Harness(make_cfg(tmp_path, "local", return_tokens_as_token_ids=flag), {"local": script}) as h:
            req: dict = {"prompt": "hi", "max_tokens": 2, "logprobs": 1}
            if asked is not None:
                req["return_tokens_as_token_ids"] = asked
            r = await h.http.post("/v1/completions", json=req)
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"][0]["logprobs"]["tokens"] == want
    run(body())


def test_the_limits_carry_the_flags_defaults():
    tok, on = text.ByteTokenizer(), api.Limits(vocab_size=258, max_model_len=64, force_usage=True, token_ids=True)
    p = api.parse_completion({"prompt": "x", "stream": True, "stream_options": {"include_usage": False}}, tok, on)
    assert (p.include_usage, p.continuous_usage, p.return_tokens_as_token_ids) == (True, True, True)
    off = api.parse_completion({"prompt": "x", "stream": True}, tok, api.Limits(vocab_size=258, max_model_len=64))
    assert (off.include_usage, off.continuous_usage, off.return_tokens_as_token_ids) == (False, False, False)
