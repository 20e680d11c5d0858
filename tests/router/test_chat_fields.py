"""No request field silently ignored: ``chat_template_kwargs`` (Qwen3's ``enable_thinking``) and
``add_generation_prompt`` reach the chat template, ``--chat-template`` replaces the checkpoint's, and structured
output (``response_format``, vLLM's ``structured_outputs`` and ``guided_*``) is taken from whichever field names it,
a malformed one a 400 naming the field, in OpenAI's error shape, before anything is computed."""
from __future__ import annotations

import json

import msgspec
import pytest
import transformers

from pushkv import messages as m
from pushkv.config_flags import chat_template_text, user_config
from pushkv.router import api, chat, text
from tests.model.test_model import write_tokenizer
from tests.router.test_router import local_script, run
from tests.support.router_fakes import Harness, make_cfg

pytestmark = pytest.mark.timeout(30)

# the tail of Qwen3's template: enable_thinking false writes an empty think block
QWEN3_LIKE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}]
LIMITS = api.Limits(vocab_size=320, max_model_len=4096)


def prompt(body: dict, template: str = QWEN3_LIKE) -> str:
    p = chat.parse_chat({"messages": MESSAGES, **body}, text.ByteTokenizer(), LIMITS, chat.ChatTemplate(template))
    return bytes(p.prompt_token_ids).decode()


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    write_tokenizer(str(path), 300)
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("gen", [True, False])
def test_template_kwargs_render_as_transformers_renders_them(hf_tok, kwargs, gen):
    want = hf_tok.apply_chat_template(MESSAGES, chat_template=QWEN3_LIKE, tokenize=False, add_generation_prompt=gen,
                                      **kwargs)
    assert prompt({"chat_template_kwargs": kwargs, "add_generation_prompt": gen}) == want
    assert ("<think>" in want) == (gen and kwargs.get("enable_thinking") is False)  # the switch matters


@pytest.mark.parametrize("body, param, says", [
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set 'messages'"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set 'tools'"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt", "must be a boolean"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "--chat-template"),
    ({"continue_final_message": True}, "continue_final_message", "cannot both be true"),
    ({"response_format": {"type": "yaml"}}, "response_format", "'yaml' is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs a json_schema object with a schema"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"guided_regex": "("}, "guided_regex", "does not compile"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice", "both ask for structured output"),
    ({"structured_outputs": {}}, "structured_outputs",
     "You must use one kind of structured outputs constraint but none are specified"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs",  # vLLM 0.32's words
     "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice')."),
    ({"structured_outputs": {"json": {}, "regex": 7, "choice": "x"}}, "structured_outputs",  # before their shapes
     "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice')."),
    ({"structured_outputs": {"json": {}, "grammar": "root ::= \"a\""}}, "structured_outputs",
     "You can only use one kind of structured outputs constraint but multiple are specified: json, grammar"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "not supported"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "needs a format object"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "nonsense"}}}, "response_format",
     "does not compile"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f>"}], "triggers": ["<f"]}},
     "response_format", "string begin and end and a schema"),
    ({"structured_outputs": {"structural_tag": "{"}}, "structured_outputs.structural_tag", "JSON text"),
])
def test_what_would_change_the_answer_and_is_not_built_is_refused(body, param, says):
    with pytest.raises(api.ApiError) as e:
        prompt(body)
    assert (e.value.status, e.value.param) == (400, param) and says in str(e.value)


PREFIX = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]


@pytest.mark.parametrize("final", ["The answer is", "The answer is ", "  The answer"])
def test_continue_final_message_renders_as_transformers_renders_it(hf_tok, final):
    """vLLM's and transformers' continue_final_message: the final (assistant) message left open, the prompt cut
    right after its text, so the model goes on with it (a trailing space kept only where the template keeps it)."""
    msgs = [*MESSAGES, {"role": "assistant", "content": final}]
    want = hf_tok.apply_chat_template(msgs, chat_template=QWEN3_LIKE, tokenize=False, add_generation_prompt=False,
                                      continue_final_message=True)
    p = chat.parse_chat({"messages": msgs, "continue_final_message": True, "add_generation_prompt": False},
                        text.ByteTokenizer(), LIMITS, chat.ChatTemplate(QWEN3_LIKE))
    assert bytes(p.prompt_token_ids).decode() == want and want.rstrip().endswith(final.strip())
    with pytest.raises(api.ApiError, match="whose text the chat template writes"):
        chat.parse_chat({"messages": msgs, "continue_final_message": True, "add_generation_prompt": False},
                        text.ByteTokenizer(), LIMITS,
                        chat.ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}"))


def test_echo_opens_each_choice_with_the_continued_message():
    """vLLM's chat echo: the final message, where it is the assistant's, opens each choice's content (whole; streamed,
    in a chunk of its own after the role's, as vLLM's: pushkv sent it in the role's); with a user's last message there
    is nothing to echo, the role's chunk alone."""
    from pushkv.router import output, render

    body = {"messages": PREFIX, "continue_final_message": True, "add_generation_prompt": False, "echo": True}
    p = chat.parse_chat(body, text.ByteTokenizer(), LIMITS, chat.ChatTemplate(QWEN3_LIKE))
    assert p.echo_text == "The answer is"
    r = render.for_endpoint(text.ByteTokenizer(), p)
    out = output.ChoiceOutput(0, text.ByteTokenizer())
    out.add(list(b" 42"))
    out.finish("length")
    assert r.choice(out)["message"]["content"] == "The answer is 42"
    assert [c["delta"] for c in r.openings(out)] == [{"role": "assistant", "content": ""},
                                                     {"content": "The answer is"}]
    plain = chat.parse_chat({"messages": MESSAGES, "echo": True}, text.ByteTokenizer(), LIMITS,
                            chat.ChatTemplate(QWEN3_LIKE))
    assert plain.echo_text == ""
    assert [c["delta"] for c in render.for_endpoint(text.ByteTokenizer(), plain).openings(out)] == [
        {"role": "assistant", "content": ""}]


OLDER_TAG = {"structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}], "triggers": ["<f"]}
TAG = {"format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
    {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
     "end": "</f>"}]}}


@pytest.mark.parametrize("body, want", [
    ({"response_format": {"type": "json_object"}}, m.Structured("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     m.Structured("json", '{"type": "object"}')),
    ({"guided_json": '{"type": "integer"}'}, m.Structured("json", '{"type": "integer"}')),
    ({"guided_regex": "[a-c]+"}, m.Structured("regex", "[a-c]+")),
    ({"guided_choice": ["a", "b", "a"], "guided_decoding_backend": "xgrammar"}, m.Structured("choice", '["a", "b"]')),
    ({"guided_grammar": 'root ::= "x"'}, m.Structured("grammar", 'root ::= "x"')),
    ({"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}},
     m.Structured("json", '{"type": "object"}', any_whitespace=False)),
    ({"structured_outputs": {"json_object": True}}, m.Structured("json_object")),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "structural_tag", **OLDER_TAG}},
     m.Structured("structural_tag", json.dumps(OLDER_TAG))),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG)}}, m.Structured("structural_tag", json.dumps(TAG))),
], ids=["json_object", "json_schema", "guided_json", "regex", "choice", "grammar", "outputs_json", "outputs_object",
        "text", "structural_tag_older", "structural_tag"])
def test_structured_output_is_taken_from_each_field_that_names_it(body, want):
    pytest.importorskip("xgrammar")
    p = chat.parse_chat({"messages": MESSAGES, **body}, text.ByteTokenizer(), LIMITS, chat.ChatTemplate(QWEN3_LIKE))
    assert p.structured == want
    assert api.parse_completion({"prompt": "hi", **body}, text.ByteTokenizer(), LIMITS).structured == want
    if want is not None:  # with a reasoning parser the grammar holds what follows the reasoning's end tag
        r = chat.parse_chat({"messages": MESSAGES, **body}, text.ByteTokenizer(), LIMITS,
                            chat.ChatTemplate(QWEN3_LIKE), reasoning_parser="qwen3")
        assert r.structured == msgspec.structs.replace(want, after=tuple(b"</think>"))


def test_response_format_text_is_what_runs_anyway():
    assert prompt({"response_format": {"type": "text"}}) == prompt({})


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(QWEN3_LIKE)
    assert chat_template_text(str(f)) == QWEN3_LIKE == chat_template_text(QWEN3_LIKE)
    assert user_config({"model": "tiny", "chat_template": str(f)}).chat_template == QWEN3_LIKE
    with pytest.raises(ValueError, match="no such file, and not a Jinja template"):
        chat_template_text(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        chat_template_text("{% for m in messages %}")


def test_through_the_router_kwargs_reach_the_deployments_template_and_a_format_is_refused(tmp_path):
    async def body():
        cfg = make_cfg(tmp_path, "local", chat_template=QWEN3_LIKE)
        async with Harness(cfg, {"local": local_script([[33]], "stop")}) as h:
            r = await h.http.post("/v1/chat/completions", json={
                "messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
            assert r.status == 200, await r.text()
            (g,) = h.log.received("local", m.Generate)
            # the rendering the test above checks against transformers'
            assert bytes(g.prompt_token_ids).decode() == prompt({"chat_template_kwargs": {"enable_thinking": False}})
            assert "<think>" in bytes(g.prompt_token_ids).decode()
            for path, req in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})):
                r = await h.http.post(path, json={**req, "response_format": {"type": "yaml"}})
                err = (await r.json())["error"]
                assert r.status == 400 and err["param"] == "response_format" and err["type"] == "invalid_request_error"
                assert "'yaml' is not supported" in err["message"]
            assert len(h.log.received("local", m.Generate)) == 1  # the refused ones sent nothing
    run(body())


EFFORT_TEMPLATE = ("{{ messages[0].content }}|effort={{ reasoning_effort | default('unset') }}"
                   "|thinking={{ enable_thinking | default('unset') }}")


@pytest.mark.parametrize("body, want", [
    ({}, "effort=unset|thinking=unset"),
    ({"reasoning_effort": "low"}, "effort=low|thinking=True"),
    ({"reasoning_effort": "none"}, "effort=none|thinking=False"),
    ({"reasoning_effort": "max"}, "effort=max|thinking=True"),
    # the kwargs' own enable_thinking stands; the field's effort wins over the kwargs' (vLLM's merge_kwargs)
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, "effort=none|thinking=True"),
    ({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}, "effort=high|thinking=True"),
    ({"chat_template_kwargs": {"reasoning_effort": "low"}}, "effort=low|thinking=unset"),
])
def test_reasoning_effort_goes_to_the_template_as_vllm_passes_it(body, want):
    """vLLM 0.32's build_chat_params: reasoning_effort is a template variable, and enable_thinking follows it
    (false for "none") where chat_template_kwargs do not set it; it was taken and ignored here."""
    assert prompt(body, EFFORT_TEMPLATE) == f"Hi|{want}"


@pytest.mark.parametrize("effort", ["extreme", 3, ""])
def test_a_reasoning_effort_vllm_does_not_take_is_refused(effort):
    with pytest.raises(api.ApiError) as e:
        prompt({"reasoning_effort": effort}, EFFORT_TEMPLATE)
    assert (e.value.status, e.value.param) == (400, "reasoning_effort") and "must be one of none, minimal" in str(
        e.value)


def test_the_responses_reasoning_effort_reaches_the_template(tmp_path):
    """/v1/responses' reasoning.effort is the chat request's reasoning_effort (vLLM's ResponsesRequest), and the
    response repeats the request's reasoning."""
    async def body():
        cfg = make_cfg(tmp_path, "local", chat_template=EFFORT_TEMPLATE)
        async with Harness(cfg, {"local": local_script([[33]], "stop")}) as h:
            r = await h.http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2,
                                                         "reasoning": {"effort": "minimal"}})
            assert r.status == 200, await r.text()
            assert (await r.json())["reasoning"] == {"effort": "minimal"}
            (g,) = h.log.received("local", m.Generate)
            assert bytes(g.prompt_token_ids).decode().endswith("|effort=minimal|thinking=True")
            r = await h.http.post("/v1/responses", json={"input": "Hi", "reasoning": "high"})
            assert r.status == 400 and (await r.json())["error"]["param"] == "reasoning"
    run(body())


THINKING = "{% for m in messages %}[{{ m.role }}:{{ m.reasoning_content }}|{{ m.reasoning }}]{% endfor %}"


@pytest.mark.parametrize("said, want", [
    ({"reasoning": "r1"}, "[user:|][assistant:r1|r1][user:|]"),  # vLLM 0.32's name
    ({"reasoning_content": "r2"}, "[user:|][assistant:r2|r2][user:|]"),  # the older one, which vLLM renames
    ({"reasoning": "new", "reasoning_content": "old"}, "[user:|][assistant:new|new][user:|]"),
    ({}, "[user:|][assistant:|][user:|]"),
])
def test_an_assistant_messages_reasoning_reaches_the_template_as_vllm_gives_it(said, want):
    """Interleaved thinking (vLLM's): an earlier assistant turn's reasoning reaches the template under both names
    (Qwen3's writes reasoning_content back as <think>); pushkv dropped it, so the prompt differed from vLLM's."""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", **said},
            {"role": "user", "content": "q2", "reasoning": "not an assistant's: not given"}]
    p = chat.parse_chat({"messages": msgs, "add_generation_prompt": False}, text.ByteTokenizer(), LIMITS,
                        chat.ChatTemplate(THINKING))
    assert bytes(p.prompt_token_ids).decode() == want
    with pytest.raises(api.ApiError) as e:
        chat.parse_messages({"messages": [{"role": "assistant", "content": "a", "reasoning": 3}]})
    assert e.value.param == "messages[0].reasoning"
