"""vLLM's ``--skip-tokenizer-init``: the router loads no tokenizer. A completion's prompt of token ids is served and
each choice comes back as its token ids with empty text; what needs text (a text prompt, chat, the Responses API,
stop strings, structured output, /tokenize) is refused by name with a 400, nothing reaching the instance; and the
parsers and a chat template are refused with it before anything starts."""
import asyncio

import pytest

from pushkv import messages as m
from tests.support.router_fakes import Harness, make_cfg, stage, tokens

pytestmark = pytest.mark.timeout(30)


def _answer(g):
    return [(None, tokens(g, [72, 105], True, "length", (stage("scheduled"), stage("finished"))))]


def test_token_ids_in_token_ids_out_and_text_refused_by_name(tmp_path):
    async def body():
        cfg = make_cfg(tmp_path, "local", skip_tokenizer_init=True)
        async with Harness(cfg, {"local": _answer}) as h:
            r = await h.http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2,
                                                           "logprobs": 1})
            got = await r.json()
            assert r.status == 200, got
            [choice] = got["choices"]
            assert choice["token_ids"] == [72, 105] and choice["text"] == ""
            assert got["usage"]["prompt_tokens"] == 3 and got["usage"]["completion_tokens"] == 2
            [g] = h.log.received("local", m.Generate)
            assert list(g.prompt_token_ids) == [5, 6, 7]
            # streamed: the same ids, no text
            r = await h.http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2,
                                                           "stream": True})
            assert r.status == 200 and "[DONE]" in await r.text()
            refusals = [
                ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}, "prompt", "token ids"),
                ("/v1/completions", {"prompt": [1, 2], "stop": ["x"]}, "stop", "stop_token_ids"),
                ("/v1/completions", {"prompt": [1, 2], "response_format": {"type": "json_object"}},
                 "response_format", "tokenizer"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages", "chat"),
                ("/v1/responses", {"input": "hi"}, "input", "chat"),
                ("/invocations", {"messages": [{"role": "user", "content": "hi"}]}, "messages", "chat"),
            ]
            sent = len(h.log.received("local", m.Generate))
            for path, req, param, says in refusals:
                r = await h.http.post(path, json={"model": "tiny", **req})
                err = (await r.json())["error"]
                assert r.status == 400 and err["param"] == param and says in err["message"], (path, err)
            r = await h.http.post("/tokenize", json={"model": "tiny", "prompt": "hi"})
            assert r.status == 400 and "--skip-tokenizer-init" in (await r.json())["error"]["message"]
            assert len(h.log.received("local", m.Generate)) == sent  # nothing refused reached the instance

    asyncio.run(asyncio.wait_for(body(), 25))


@pytest.mark.unit
def test_the_parsers_and_a_template_are_refused_with_it():
    from pushkv.config_flags import user_config

    for flag, value in (("reasoning_parser", "deepseek_r1"), ("tool_call_parser", "hermes"),
                        ("chat_template", "{{ messages }}")):
        with pytest.raises(ValueError, match="--skip-tokenizer-init"):
            user_config({"mode": "local", "device": "cpu", "skip_tokenizer_init": True, flag: value})
    assert user_config({"mode": "local", "device": "cpu", "skip_tokenizer_init": True}).skip_tokenizer_init


@pytest.mark.timeout(240)
def test_a_push_deployment_without_a_tokenizer_gives_the_tokens_of_one_with(tmp_path):
    from tests.support.deploy import deployment

    prompt = [(i * 11 + 5) % 256 for i in range(40)]
    for sub in ("with", "without"):
        (tmp_path / sub).mkdir()
    with deployment(tmp_path / "with", "--mode", "local", "--num-blocks", "128") as dep:
        want = dep.tokens(prompt, 8)
    with deployment(tmp_path / "without", "--mode", "push", "--num-blocks", "128", "--skip-tokenizer-init") as dep:
        status, body = dep.post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == want and body["choices"][0]["text"] == ""
        status, body = dep.post("/v1/completions", {"prompt": "text", "max_tokens": 2})
        assert status == 400 and body["error"]["param"] == "prompt"
