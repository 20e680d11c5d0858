"""Chat passes what a tool-calling template reads, as transformers' apply_chat_template does:
``tools``, and each message's ``name``, ``tool_call_id`` and ``tool_calls``. The prompt pushkv
renders from an OpenAI-shaped request equals the one transformers renders from the same
conversation, for a template in one piece and for a checkpoint's named ``tool_use`` template."""
from __future__ import annotations

import json

import pytest
import transformers

from pushkv.router import api, chat, text
from tests.model.test_model import write_tokenizer

TEMPLATE = (
    "{%- if tools %}<|system|>You may call:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content }}"
    "{% for c in m.tool_calls %}<call id={{ c.id }}>{{ c.function.name }}({{ c.function.arguments | tojson }})</call>"
    "{% endfor %}<|end|>\n"
    "{%- elif m.role == 'tool' %}<|tool|>[{{ m.tool_call_id }}]{% if m.name %} {{ m.name }}:{% endif %} {{ m.content }}"
    "<|end|>\n"
    "{%- else %}<|{{ m.role }}|>{% if m.name %}({{ m.name }}) {% endif %}{{ m.content }}<|end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
OPENAI_MESSAGES = [  # what a client sends: arguments as a JSON string
    {"role": "system", "content": "Be brief."},
    {"role": "user", "name": "ana", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "4 C, rain"},
]


def hf_messages() -> list[dict]:
    """The same conversation as transformers' docs write it: arguments as an object."""
    call = {**CALL, "function": {**CALL["function"], "arguments": {"city": "Oslo"}}}
    msgs = [dict(m) for m in OPENAI_MESSAGES]
    msgs[2] = {"role": "assistant", "content": "", "tool_calls": [call]}
    return msgs


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    write_tokenizer(str(path), 300)
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))


def render(template: chat.ChatTemplate, body: dict) -> str:
    tools = chat.parse_tools(body)
    return template.for_tools(bool(tools)).render(chat.parse_messages(body), tools=tools or None)


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_rendered_prompt_equals_transformers(hf_tok, tools):
    want = hf_tok.apply_chat_template(hf_messages(), tools=tools, chat_template=TEMPLATE, tokenize=False,
                                      add_generation_prompt=True)
    body = {"messages": OPENAI_MESSAGES, **({"tools": tools} if tools else {})}
    got = render(chat.ChatTemplate(TEMPLATE), body)
    assert got == want
    assert '<call id=call_1>get_weather({"city": "Oslo"})</call>' in got and "<|tool|>[call_1] get_weather:" in got
    assert "(ana) Weather" in got and (('"name": "get_weather"' in got) == bool(tools))


def test_a_named_tool_use_template_is_taken_when_tools_are_given(tmp_path, hf_tok):
    named = [{"name": "default", "template": "D:{{ messages[0].content }}"},
             {"name": "tool_use", "template": "T{{ tools | length }}:{{ messages[0].content }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    t = chat.load_template(str(tmp_path))
    hf_tok.chat_template = {n["name"]: n["template"] for n in named}
    for tools in (TOOLS, None):
        body = {"messages": [{"role": "user", "content": "q"}], **({"tools": tools} if tools else {})}
        want = hf_tok.apply_chat_template(body["messages"], tools=tools, tokenize=False)
        assert render(t, body) == want == ("T1:q" if tools else "D:q")


def test_the_tool_use_template_transformers_saves_in_its_own_file_is_taken(tmp_path, hf_tok):
    """transformers 5 saves named templates as chat_template.jinja (the default) and additional_chat_templates/
    NAME.jinja; pushkv read only the first, so a request with tools rendered through the default template, not the
    tool_use one transformers and vLLM take."""
    named = {"default": "D:{{ messages[0].content }}", "tool_use": "T{{ tools | length }}:{{ messages[0].content }}"}
    hf_tok.chat_template = named
    hf_tok.save_pretrained(str(tmp_path))
    assert (tmp_path / "additional_chat_templates" / "tool_use.jinja").exists()
    t = chat.load_template(str(tmp_path))
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for tools in (TOOLS, None):
        body = {"messages": [{"role": "user", "content": "q"}], **({"tools": tools} if tools else {})}
        want = loaded.apply_chat_template(body["messages"], tools=tools, tokenize=False)
        assert render(t, body) == want == ("T1:q" if tools else "D:q")
    from fnmatch import fnmatch

    from pushkv.model.hub import SERVE_FILES, TOKENIZER_FILES

    for files in (SERVE_FILES, TOKENIZER_FILES):  # and a repo id's snapshot fetches it
        assert any(fnmatch("additional_chat_templates/tool_use.jinja", f) for f in files)


def test_parse_chat_renders_tools_into_the_prompt():
    tok = text.ByteTokenizer()
    limits = api.Limits(vocab_size=320, max_model_len=4096)
    body = {"messages": OPENAI_MESSAGES, "tools": TOOLS, "tool_choice": "none"}
    p = chat.parse_chat(body, tok, limits, chat.ChatTemplate(TEMPLATE))
    assert bytes(p.prompt_token_ids).decode() == render(chat.ChatTemplate(TEMPLATE), body)
    assert p.tool_call_parser == ""
    auto = {**body, "tool_choice": "auto"}
    assert chat.parse_chat(auto, tok, limits, chat.ChatTemplate(TEMPLATE), tool_call_parser="hermes").prompt_token_ids \
        == p.prompt_token_ids
    # auto, given or the default with tools, and a forced choice need the deployment's parser: refused as vLLM 0.32's
    # renderer refuses them (400, its words, no param); none stands
    named = {"type": "function", "function": {"name": TOOLS[0]["function"]["name"]}}
    for ask, words in ((auto, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
                       ({"messages": OPENAI_MESSAGES, "tools": TOOLS},
                        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
                       ({**body, "tool_choice": "required"},
                        'tool_choice="required" requires --tool-call-parser to be set'),
                       ({**body, "tool_choice": named},
                        f'tool_choice=function "{named["function"]["name"]}" requires --tool-call-parser to be set')):
        with pytest.raises(api.ApiError) as e:
            chat.parse_chat(ask, tok, limits, chat.ChatTemplate(TEMPLATE))
        assert (e.value.status, e.value.message, e.value.body()["error"]["param"]) == (400, words, None)
        served = chat.parse_chat(ask, tok, limits, chat.ChatTemplate(TEMPLATE), tool_call_parser="hermes")
        assert served.prompt_token_ids == p.prompt_token_ids


@pytest.mark.parametrize("msg, param", [
    ({"role": "tool", "tool_call_id": 5, "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "user", "name": ["a"], "content": "x"}, "messages[0].name"),
    ({"role": "assistant", "tool_calls": {"id": 1}}, "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "messages[0].tool_calls[0].function"),
])
def test_malformed_tool_fields_are_400_naming_them(msg, param):
    with pytest.raises(api.ApiError) as e:
        chat.parse_messages({"messages": [msg]})
    assert (e.value.status, e.value.param) == (400, param)


def test_arguments_that_are_not_a_json_object_stay_as_sent():
    calls = [{"function": {"name": "f", "arguments": a}} for a in ("not json", "[1, 2]", '"s"')]
    got = chat.parse_messages({"messages": [{"role": "assistant", "tool_calls": calls}]})[0]["tool_calls"]
    assert [c["function"]["arguments"] for c in got] == ["not json", "[1, 2]", '"s"']
