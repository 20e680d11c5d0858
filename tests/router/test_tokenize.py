"""vLLM's ``/tokenize``, ``/detokenize``, ``/version`` and ``/ping`` on the router: a prompt counted as a completion's
is encoded, chat messages as a chat request's are rendered and encoded (the ids the router would send, checked
against the Generate it sends), transformers' tokens for a real tokenizer, and a bad field a 400 naming it; nothing
reaches an instance."""
from __future__ import annotations

import pytest
import transformers

from pushkv import __version__
from pushkv import messages as m
from pushkv.model.tokenizer import HFTokenizer
from pushkv.router import api, tokenize
from pushkv.router.chat import ChatTemplate
from tests.model.test_hf_reference import _tokenizer
from tests.router.test_chat_fields import MESSAGES, QWEN3_LIKE
from tests.router.test_router import local_script, run
from tests.support.router_fakes import Harness, make_cfg

pytestmark = pytest.mark.timeout(30)
LIMITS = api.Limits(vocab_size=300, max_model_len=512)


@pytest.fixture(scope="module")
def llama_tok(tmp_path_factory):
    """A Llama-style tokenizer whose post-processor puts <s> (id 2) in front, and transformers' of it."""
    path = str(tmp_path_factory.mktemp("tok"))
    _tokenizer(path)
    return HFTokenizer(f"{path}/tokenizer.json", bos_token_id=2), transformers.AutoTokenizer.from_pretrained(path)


def test_a_prompt_is_counted_as_transformers_encodes_it(llama_tok):
    ours, theirs = llama_tok
    text = "the quick brown fox jumps over the lazy dog"
    body = tokenize.tokenize({"prompt": text, "return_token_strs": True}, ours, LIMITS, lambda: None)
    want = theirs(text).input_ids
    assert body["tokens"] == want and want[0] == 2 and body["count"] == len(want)
    assert body["max_model_len"] == 512
    assert body["token_strs"] == theirs.convert_ids_to_tokens(want)
    bare = tokenize.tokenize({"prompt": text, "add_special_tokens": False}, ours, LIMITS, lambda: None)
    assert bare["tokens"] == theirs(text, add_special_tokens=False).input_ids and bare["token_strs"] is None
    assert tokenize.detokenize({"tokens": bare["tokens"]}, ours, LIMITS) == {"prompt": text}


def test_messages_are_rendered_and_encoded_as_a_chat_request_is(llama_tok):
    ours, _ = llama_tok
    template = ChatTemplate(QWEN3_LIKE)
    body = tokenize.tokenize({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}, ours,
                             LIMITS, lambda: template)
    rendered = template.render(MESSAGES, add_generation_prompt=True, enable_thinking=False)
    assert body["tokens"] == ours.encode(rendered)[1:]  # the template writes its specials: no <s> added
    assert tokenize.tokenize({"messages": MESSAGES, "add_generation_prompt": False}, ours, LIMITS,
                             lambda: template)["count"] < body["count"]


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"), ({"prompt": "x", "messages": MESSAGES}, "prompt"), ({"prompt": ["x"]}, "prompt"),
    ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
])
def test_a_bad_tokenize_body_names_its_field(llama_tok, body, param):
    with pytest.raises(api.ApiError) as e:
        tokenize.tokenize(body, llama_tok[0], LIMITS, lambda: ChatTemplate(QWEN3_LIKE))
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("tokens", [None, "1 2", [1, "2"], [1, True], [1, 300], [-1]])
def test_a_bad_detokenize_body_names_tokens(llama_tok, tokens):
    with pytest.raises(api.ApiError) as e:
        tokenize.detokenize({} if tokens is None else {"tokens": tokens}, llama_tok[0], LIMITS)
    assert e.value.status == 400 and e.value.param == "tokens"


def test_through_the_router_the_counts_are_what_a_request_sends(tmp_path):
    async def body():
        cfg = make_cfg(tmp_path, "local", chat_template=QWEN3_LIKE)
        async with Harness(cfg, {"local": local_script([[33]], "stop")}) as h:
            r = await h.http.post("/tokenize", json={"messages": MESSAGES, "model": cfg.model.name})
            assert r.status == 200, await r.text()
            counted = await r.json()
            r = await h.http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
            assert r.status == 200, await r.text()
            (g,) = h.log.received("local", m.Generate)
            assert counted["tokens"] == list(g.prompt_token_ids)
            r = await h.http.post("/detokenize", json={"tokens": counted["tokens"]})
            assert (await r.json())["prompt"] == bytes(g.prompt_token_ids).decode()
            r = await h.http.post("/tokenize", json={"prompt": "hi", "model": "another"})
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
            r = await h.http.post("/tokenize", data=b"{not json")
            assert r.status == 400
            r = await h.http.get("/version")
            assert await r.json() == {"version": __version__}
            for method in (h.http.get, h.http.post):
                r = await method("/ping")
                assert r.status == 200
            assert len(h.log.received("local", m.Generate)) == 1  # only the chat request reached the instance
    run(body())


def test_a_checkpoint_without_a_chat_template_refuses_chat_as_vllm(tmp_path):
    """vLLM answers a chat request to a tokenizer with no template (a base model's) with a 400; pushkv rendered it
    through its plain ``role: content`` template, a prompt the model never saw, and answered 200. Completions are
    still served, and --chat-template supplies one; the presets keep the plain template."""
    import msgspec

    from pushkv.router.chat import NO_TEMPLATE

    _tokenizer(str(tmp_path))  # tokenizer.json and a tokenizer_config.json without chat_template

    async def body(template, want):
        cfg = make_cfg(tmp_path, "local", chat_template=template)
        cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, tokenizer=str(tmp_path)))
        async with Harness(cfg, {"local": local_script([[33]] * 3, "stop")}) as h:
            for path, req in (("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}),
                              ("/tokenize", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "hi"})):
                r = await h.http.post(path, json=req)
                status = 200 if path == "/v1/completions" else want
                assert r.status == status, (path, await r.text())
                if status == 400:
                    assert (await r.json())["error"] == {"message": NO_TEMPLATE, "type": "invalid_request_error",
                                                         "param": None, "code": 400}
    run(body(None, 400))
    run(body(QWEN3_LIKE, 200))
