"""The bounds on what one request may cost (pushkv/limits.py), as the router applies them: every
field past its bound is refused with 400 naming it; logit_bias keys are canonical integers, so
no two keys name one id. The API doc's table (docs/api.md) says the same values as the code."""
from __future__ import annotations

import os

import pytest

from pushkv import limits as L
from pushkv.router import api, chat, text
from tests.support import ROOT

LIMITS = api.Limits(vocab_size=320, max_model_len=1024)
TOK = text.ByteTokenizer()


def completion(**kw):
    return api.parse_completion({"prompt": "hi", **kw}, TOK, LIMITS)


def refused(body_kw: dict, param: str, needle: str, chat_: bool = False) -> None:
    with pytest.raises(api.ApiError) as e:
        if chat_:
            chat.parse_chat({"messages": [{"role": "user", "content": "hi"}], **body_kw}, TOK, LIMITS,
                            chat.load_template(""))
        else:
            completion(**body_kw)
    assert (e.value.status, e.value.param) == (400, param), e.value.message
    assert needle in e.value.message, e.value.message


@pytest.mark.parametrize("kw, param, needle, chat_", [
    ({"n": L.MAX_N + 1}, "n", f"[1, {L.MAX_N}]", False),
    ({"n": 2, "best_of": L.MAX_BEST_OF + 1}, "best_of", f"[1, {L.MAX_BEST_OF}]", False),
    ({"n": 2, "best_of": 3}, "best_of", "best_of other than n", False),
    ({"logprobs": L.MAX_LOGPROBS + 1}, "logprobs", f"[0, {L.MAX_LOGPROBS}]", False),
    ({"logprobs": True, "top_logprobs": L.MAX_LOGPROBS + 1}, "top_logprobs", f"[0, {L.MAX_LOGPROBS}]", True),
    ({"logit_bias": {str(i): 1 for i in range(L.MAX_LOGIT_BIAS + 1)}}, "logit_bias",
     f"at most {L.MAX_LOGIT_BIAS} logit_bias entries, got {L.MAX_LOGIT_BIAS + 1}", False),
    ({"stop": ["x"] * (L.MAX_STOPS + 1)}, "stop", f"at most {L.MAX_STOPS} stop strings", False),
    ({"stop": ["ok", "y" * (L.MAX_STOP_CHARS + 1)]}, "stop", f"at most {L.MAX_STOP_CHARS} characters", False),
    ({"stop_token_ids": [1] * (L.MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids",
     f"at most {L.MAX_STOP_TOKEN_IDS} stop_token_ids", False),
    ({"tools": [{"type": "function"}] * (L.MAX_TOOLS + 1)}, "tools", f"at most {L.MAX_TOOLS} tools", True),
    ({"tools": "all of them"}, "tools", "list of objects", True),
    ({"temperature": L.MAX_TEMPERATURE + 1}, "temperature", "must be in", False),
    # vLLM's and OpenAI's: a stream's options without the stream (pushkv took them and said nothing)
    ({"stream_options": {"include_usage": True}}, "stream_options", "with stream true", False),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options", "with stream true", True),
], ids=["n", "best_of-bound", "best_of-not-n", "logprobs", "top_logprobs", "logit_bias-entries", "stops",
        "stop-chars", "stop_token_ids", "tools", "tools-type", "temperature", "stream_options", "stream_options-chat"])
def test_past_a_bound_is_400_naming_the_field(kw, param, needle, chat_):
    refused(kw, param, needle, chat_)


def test_at_each_bound_is_served():
    p = completion(n=L.MAX_N, best_of=L.MAX_N, logprobs=L.MAX_LOGPROBS, stop=["z" * L.MAX_STOP_CHARS] * L.MAX_STOPS,
                   stop_token_ids=list(range(L.MAX_STOP_TOKEN_IDS)),
                   logit_bias={str(i): -L.LOGIT_BIAS_ABS for i in range(min(L.MAX_LOGIT_BIAS, 320))})
    assert p.n == L.MAX_N and len(p.stop) == 1 and len(p.sampling.logit_bias) == 320
    assert len(p.stop_token_ids) == L.MAX_STOP_TOKEN_IDS


@pytest.mark.parametrize("key", ["07", " 7", "7 ", "+7", "7.0", "-0", "0x7", "7e0", "\u0667", "", "1" * 11, "-1"])
def test_logit_bias_keys_must_be_canonical_integers(key):
    refused({"logit_bias": {key: 1}}, "logit_bias", repr(key))


def test_logit_bias_canonical_keys_and_values():
    assert completion(logit_bias={"7": 100, "0": -100}).sampling.logit_bias == ((0, -100.0), (7, 100.0))
    refused({"logit_bias": {"7": 100.5}}, "logit_bias", "'7' must be a number in [-100, 100]")
    refused({"logit_bias": {"7": float("inf")}}, "logit_bias", "[-100, 100]")
    refused({"logit_bias": {"320": 1}}, "logit_bias", "token id 320 outside the vocabulary")
    # one id, one key: JSON's duplicate keys keep the last value, never a sum past the bound
    body = api.parse_json(b'{"prompt": "hi", "logit_bias": {"7": 100, "7": 60}}')
    assert api.parse_completion(body, TOK, LIMITS).sampling.logit_bias == ((7, 60.0),)


def test_tiny_temperatures_are_greedy():
    """1/T of a temperature near 0 overflows the logits (a NaN row drew the last id); below
    MIN_TEMPERATURE the request is greedy, as vLLM does."""
    assert completion(temperature=L.MIN_TEMPERATURE / 2).sampling.temperature == 0.0
    assert completion(temperature=5e-324).sampling.temperature == 0.0
    assert completion(temperature=L.MIN_TEMPERATURE).sampling.temperature == L.MIN_TEMPERATURE


def test_a_batch_of_prompts_is_each_prompt_with_its_choices_and_bounded():
    one = completion(prompt=["ab"])
    assert (one.prompt_token_ids, one.batch, one.choices) == ([97, 98], [], 1)  # a batch of one is one prompt
    batch = completion(prompt=["ab", [5, 6, 7], "c"], n=2, echo=True)
    assert batch.prompts() == [([97, 98], "ab"), ([5, 6, 7], "\x05\x06\x07"), ([99], "c")] and batch.choices == 6
    refused({"prompt": ["a"] * (L.MAX_PROMPTS + 1)}, "prompt", f"at most {L.MAX_PROMPTS} prompts")
    refused({"prompt": ["a"] * L.MAX_PROMPTS, "n": 5}, "n", f"more than {L.MAX_CHOICES} choices")
    refused({"prompt": ["a", ""]}, "prompt[1]", "prompt[1] is empty")
    refused({"prompt": ["a", [1, 999]]}, "prompt[1]", "token id 999 outside the vocabulary")
    refused({"prompt": ["a", ["b"]]}, "prompt[1]", "must be a string, a list of token ids")
    # max_tokens must fit beside the longest prompt
    n = LIMITS.max_model_len  # max_tokens past the room is cut to it, per prompt where the router opens its runs
    assert completion(prompt=["a", [1] * (n - 3)], max_tokens=50).max_tokens == 50  # (the short prompt's room)
    assert completion(prompt=[[1] * (n - 3)], max_tokens=50).max_tokens == 3


def test_a_prompt_past_the_model_length_is_refused_in_vllms_words():
    """Clients match vLLM's "maximum context length is N tokens" to shorten the conversation: a prompt that leaves
    no room is refused so, and blames the prompt (or the messages), not a max_tokens the client never sent."""
    n = LIMITS.max_model_len
    refused({"prompt": [1] * (n + 2)}, "prompt", f"This model's maximum context length is {n} tokens. However, your "
            f"prompt contains {n + 2} input tokens, which exceeds this limit even without any output tokens. Please "
            f"reduce the length of the input prompt.")
    refused({"prompt": [1] * n}, "prompt", f"However, your prompt contains {n} input tokens, which leaves no room "
            f"for an output token.")
    with pytest.raises(api.ApiError) as e:
        chat.parse_chat({"messages": [{"role": "user", "content": "a" * n}]}, TOK, LIMITS, chat.load_template(""))
    assert e.value.param == "messages" and "maximum context length is" in e.value.message, e.value.message
    assert "input messages" in e.value.message


def test_api_doc_table_says_what_the_code_does():
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        readme = f.read()
    for b in L.BOUNDS:
        assert f"| {b.field} | {b.bound} |" in readme, b


def _size(n: int) -> str:
    return f"{round(n / 1e3)} KB" if n < 1e6 else f"{n / 1e6:.1f} MB"


def test_api_doc_message_caps_are_the_ones_the_code_computes():
    """docs/api.md gives each preset's two caps (at its defaults); they move whenever a bound or a message grows."""
    from pushkv.config import PRESETS, DeploymentConfig

    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        doc = " ".join(f.read().split())
    for name in ("tiny", "small", "qwen3-8b"):
        cfg = DeploymentConfig(model=PRESETS[name])
        assert f"{_size(L.generate_cap_bytes(cfg))} for `{name}`" in doc, (name, _size(L.generate_cap_bytes(cfg)))
        assert f"{_size(L.msg_cap_bytes(cfg))} for `{name}`" in doc, (name, _size(L.msg_cap_bytes(cfg)))


def test_an_error_names_its_param_or_null():
    """OpenAI's and vLLM's error object always has ``param`` (null where no field is to blame): pushkv left the key
    out, and a client reading ``error["param"]`` failed."""
    assert api.ApiError(404, "no such route").body() == {"error": {
        "message": "no such route", "type": "invalid_request_error", "param": None, "code": 404}}
    with pytest.raises(api.ApiError) as e:
        completion(n=0)
    assert e.value.body()["error"]["param"] == "n"
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream_options=None).include_usage  # null and {} say nothing either way
