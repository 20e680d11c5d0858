"""``--tool-call-parser hermes`` (pushkv/router/tool_calls.py): the calls a chat choice writes
(``<tool_call>{...}</tool_call>``) come back as OpenAI ``tool_calls``, ``finish_reason`` ``tool_calls``, the text
around them as content; whole and streamed alike however the text is cut; through the router, with the reasoning
parser too, and only for a request with tools and tool_choice auto."""
from __future__ import annotations

import itertools
import json
import re

import pytest

from pushkv import messages as m
from pushkv.router import tool_calls
from tests.router.test_chat_fields import MESSAGES
from tests.router.test_router import local_script, read_sse, run
from tests.support.router_fakes import Harness, make_cfg

pytestmark = pytest.mark.timeout(30)

CALL_F = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
CALL_G = '<tool_call>{"name": "g", "arguments": "{}"}</tool_call>'
# text -> (content, [(name, arguments)])
CASES = {
    "no call here": ("no call here", []),
    "Let me look.\n" + CALL_F: ("Let me look.\n", [("get_weather", '{"city": "Paris", "unit": "°C"}')]),
    CALL_F + "\n" + CALL_G: (None, [("get_weather", '{"city": "Paris", "unit": "°C"}'), ("g", "{}")]),
    "<tool_call>not json</tool_call> after": ("<tool_call>not json</tool_call> after", []),
    CALL_G + " and more": ("and more", [("g", "{}")]),
    '<tool_call>{"name": "cut", "arguments": {"a": 1}}': (None, [("cut", '{"a": 1}')]),  # cut at max_tokens
    "<tool_ca": ("<tool_ca", []),
    "": (None, []),
}


def _named(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("text", sorted(CASES))
def test_a_whole_content_gives_its_calls(text):
    content, calls = tool_calls.parse(text)
    assert (content, _named(calls)) == CASES[text]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") and "index" not in c
               for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)


def three_pieces(text):
    """Every way of cutting ``text`` into 3 deltas, empty ones too (a stream's last delta often is)."""
    for a, b in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        yield [text[:a], text[a:b], text[b:]]


def streamed(parser, pieces):
    """What a stream of ``pieces`` gives: its (content or None, [(name, arguments)], each call's pieces joined), and
    the pieces."""
    s = tool_calls.streamer(parser)
    got = [s.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    calls = [c for _, cs in got for c in cs]
    assert s.calls == len(joined_calls(calls)), pieces
    return ("".join(c for c, _ in got) or None, joined_calls(calls)), calls


@pytest.mark.parametrize("text", sorted(CASES))
def test_streamed_in_any_pieces_the_deltas_give_the_whole(text):
    for pieces in three_pieces(text):
        assert streamed("hermes", pieces)[0] == CASES[text], pieces


# llama3_json: text -> (content, [(name, arguments)]), whole and streamed (a third: the stream's, where it differs)
LLAMA3 = {
    '{"name": "get_weather", "parameters": {"city": "Paris"}}': (None, [("get_weather", '{"city": "Paris"}')]),
    ' {"name": "f", "parameters": {}}; {"name": "g", "arguments": {"x": [1, 2]}}':
        (None, [("f", "{}"), ("g", '{"x": [1, 2]}')]),
    'The weather is {"mild"}.': ('The weather is {"mild"}.', []),
    '{"answer": 42}': ('{"answer": 42}', []),  # JSON, but no function's name: content
    # cut off: whole, content; the stream has opened the call and given its arguments as far as they came (vLLM's)
    '{"name": "cut", "parameters": {"city": "Par': ('{"name": "cut", "parameters": {"city": "Par', [],
                                                   (None, [("cut", '{"city": "Par')])),
    "": (None, []),
}


@pytest.mark.parametrize("text", sorted(LLAMA3))
def test_llama3_json_whole_and_streamed(text):
    want = LLAMA3[text][:2]
    content, calls = tool_calls.parse(text, "llama3_json")
    assert (content, _named(calls)) == want
    for cut in range(0, len(text) + 1, max(1, len(text) // 9)):
        s = tool_calls.streamer("llama3_json")
        got = [s.feed(text[:cut]), s.feed(text[cut:], final=True)]
        assert ("".join(c for c, _ in got) or None, joined_calls([c for _, cs in got for c in cs])) == (
            LLAMA3[text][2] if len(LLAMA3[text]) > 2 else want), cut
        if not text.lstrip().startswith("{"):  # plain content streams as it comes
            assert got[0][0] == text[:cut]


def test_an_unknown_tool_parser_is_refused():
    with pytest.raises(ValueError, match="'xlam' is not one of"):
        tool_calls.streamer("xlam")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def through_router(tmp_path, parser: str, output: str, cut: int) -> dict:
    """A chat with TOOLS whose model writes ``<think>sunny?</think>`` + ``output`` (in byte pieces of ``cut``, through
    every tag), served by a local fake through the router with ``--reasoning-parser deepseek_r1`` and this tool
    parser: ``whole`` (the choice), ``deltas`` and ``last`` (the streamed choice's deltas and its last chunk's
    choice), ``none`` (tool_choice none), ``no_tools`` (the same messages without tools) and ``required`` (the
    status of tool_choice required, and the grammar its Generate carried)."""
    out = list(("<think>sunny?</think>" + output).encode())
    chunks = [out[i:i + cut] for i in range(0, len(out), cut)]
    got: dict = {}

    async def body():
        cfg = make_cfg(tmp_path, "local", reasoning_parser="deepseek_r1", tool_call_parser=parser)
        async with Harness(cfg, {"local": local_script(chunks, "stop")}) as h:
            req = {"messages": MESSAGES, "max_tokens": 200, "tools": TOOLS}
            r = await h.http.post("/v1/chat/completions", json=req)
            assert r.status == 200, await r.text()
            got["whole"] = (await r.json())["choices"][0]
            r = await h.http.post("/v1/chat/completions", json=dict(req, stream=True))
            events = [e for e in await read_sse(r) if e != "[DONE]" and e["choices"]]
            got["deltas"] = [e["choices"][0]["delta"] for e in events]
            got["last"] = events[-1]["choices"][0]
            for name, other in (("none", dict(req, tool_choice="none")),
                                ("no_tools", {"messages": MESSAGES, "max_tokens": 200})):
                r = await h.http.post("/v1/chat/completions", json=other)
                got[name] = (await r.json())["choices"][0]
            r = await h.http.post("/v1/chat/completions", json=dict(req, tool_choice="required"))
            spec = h.log.received("local", m.Generate)[-1].structured
            got["required"] = (r.status, spec.kind, spec.after)
    run(body())
    return got


def streamed_parts(deltas: list[dict]) -> tuple[str, str, list[dict]]:
    """A stream's reasoning, content and tool calls, joined."""
    return ("".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content", "") for d in deltas),
            [c for d in deltas for c in d.get("tool_calls", [])])


def assert_calls_through_router(got: dict, output: str, content, calls: list) -> None:
    """What every parser gives through the router: the calls apart from the content and the reasoning, whole and
    streamed alike, finish_reason tool_calls; without tools or with tool_choice none, the output as text;
    tool_choice required held to the calls' schema after the reasoning (the fake instance ignores the mask)."""
    msg = got["whole"]["message"]
    assert got["whole"]["finish_reason"] == "tool_calls"
    assert (msg["reasoning_content"], msg["content"]) == ("sunny?", content)
    assert _named(msg["tool_calls"]) == calls
    reasoning, text, streamed_calls = streamed_parts(got["deltas"])
    assert (reasoning, text) == ("sunny?", content or "")
    assert joined_calls(streamed_calls) == calls
    assert got["last"]["finish_reason"] == "tool_calls"
    for name in ("none", "no_tools"):
        assert "tool_calls" not in got[name]["message"] and output in got[name]["message"]["content"]
        assert got[name]["finish_reason"] == "stop"
    assert got["required"] == (200, "json", tuple(b"</think>"))


def test_through_the_router_with_the_reasoning_parser(tmp_path):
    got = through_router(tmp_path, "hermes", "Checking.\n" + CALL_F, 7)
    assert_calls_through_router(got, CALL_F, "Checking.\n", [("get_weather", '{"city": "Paris", "unit": "°C"}')])
    assert json.loads(got["whole"]["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris",
                                                                                             "unit": "°C"}


def test_enable_auto_tool_choice_needs_a_parser():
    from processes import cli
    from pushkv.config_flags import user_config

    def cfg(*argv):
        return user_config(vars(cli.build_parser().parse_args(["up", "tiny", "--load-format", "dummy", *argv])),
                           lambda: (0, ""))

    assert cfg("--enable-auto-tool-choice", "--tool-call-parser", "hermes").tool_call_parser == "hermes"
    assert cfg("--tool-call-parser", "hermes").tool_call_parser == "hermes"
    for parser in ("llama3_json", "mistral", "pythonic", "qwen3_coder"):
        assert cfg("--enable-auto-tool-choice", "--tool-call-parser", parser).tool_call_parser == parser
    with pytest.raises(ValueError, match=r"needs --tool-call-parser \(hermes, llama3_json, mistral, pythonic, "
                                         r"qwen3_coder\)"):
        cfg("--enable-auto-tool-choice")
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        cfg("--enable-auto-tool-choice", "--tool-call-parser", "xlam")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object


def test_a_forced_tool_choice_holds_the_output_to_the_calls_and_makes_them_calls():
    """tool_choice required or a named function (vLLM's, OpenAI's): the output held to the calls' JSON schema
    (structured output), then made calls: a named function's arguments as written, required's list of names and
    parameters; required's output that is not that (cut off) is neither calls nor content, as vLLM's."""
    pytest.importorskip("xgrammar")
    from pushkv.router import api, chat, text

    limits = api.Limits(vocab_size=320, max_model_len=4096)
    msgs = [{"role": "user", "content": "weather?"}]
    p = chat.parse_chat({"messages": msgs, "tools": [WEATHER, CLOCK], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, text.ByteTokenizer(), limits, chat.load_template(""),
        tool_call_parser="hermes")
    assert p.tool_call_parser == "function:get_weather" and p.structured.kind == "json"
    assert json.loads(p.structured.spec) == WEATHER["function"]["parameters"] and not p.structured.any_whitespace
    content, calls = tool_calls.parse('{"city": "Rome"}', p.tool_call_parser)
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Rome"}')]
    r = chat.parse_chat({"messages": msgs, "tools": [WEATHER, CLOCK], "tool_choice": "required"},
                        text.ByteTokenizer(), limits, chat.load_template(""), tool_call_parser="hermes")
    assert r.tool_call_parser == "required"
    out = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Paris"}}]'
    content, calls = tool_calls.parse(out, "required")
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {}), ("get_weather", {"city": "Paris"})]
    assert tool_calls.parse('[{"name": "get_ti', "required") == (None, [])  # cut off: no call, no content (vLLM's)
    for body, needle in [({"tool_choice": "required"}, "`tools` must be set"),
                         ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                          "The tool specified in `tool_choice` does not match any of the specified `tools`"),
                         ({"tools": [WEATHER], "tool_choice": "sometimes"},
                          r'Invalid value for `tool_choice`: sometimes! Only named tools, "none", "auto" or "required" '
                          "are supported.")]:
        with pytest.raises(api.ApiError, match=needle) as e:
            chat.parse_chat({"messages": msgs, **body}, text.ByteTokenizer(), limits, chat.load_template(""))
        assert e.value.param == "tool_choice"
    # a named choice's object, checked as vLLM 0.32's check_tool_usage checks it (its words and params); its "type"
    # is not looked at, as there
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    for choice, param, message in [
            ({"type": "function"}, "tool_choice.function", f"Invalid value for `function`: `None` in `tool_choice`! {usage}"),
            ({"function": {}}, "tool_choice.function.name", f"Expected field `name` in `function` in `tool_choice`! {usage}"),
            ({"function": {"name": ""}}, "tool_choice.function.name",
             f"Invalid `name` in `function`: `` in `tool_choice`! {usage}")]:
        with pytest.raises(api.ApiError) as e:
            chat.parse_chat({"messages": msgs, "tools": [WEATHER], "tool_choice": choice}, text.ByteTokenizer(), limits,
                            chat.load_template(""))
        assert (e.value.param, e.value.message) == (param, message)
    r = chat.parse_chat({"messages": msgs, "tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather"}}},
                        text.ByteTokenizer(), limits, chat.load_template(""), tool_call_parser="hermes")
    assert r.tool_call_parser == "function:get_weather"


def test_a_forced_tool_choice_sets_the_requests_own_structured_output_aside():
    """vLLM's tool parser (adjust_request, _apply_structural_tag): a forced tool_choice replaces the request's
    structured output with the calls' schema and drops its response_format, so the calls win (a structural_tag in
    structured_outputs excepted: left as it is); what vLLM's request
    model refuses still is: a malformed field's shape, and structured_outputs' json, regex or choice beside a named
    function (check_structured_outputs_count), `required` taking them."""
    pytest.importorskip("xgrammar")
    from pushkv.router import api, chat, text

    limits = api.Limits(vocab_size=320, max_model_len=4096)
    named = {"type": "function", "function": {"name": "get_weather"}}

    def parse(**body):
        return chat.parse_chat({"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER, CLOCK],
                                **body}, text.ByteTokenizer(), limits, chat.load_template(""),
                               tool_call_parser="hermes")

    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}}}
    for choice, parser in ((named, "function:get_weather"), ("required", "required")):
        for own in ({"response_format": schema}, {"response_format": {"type": "json_object"}},
                    {"structured_outputs": {"grammar": "root ::= \"a\""}},
                    {"response_format": schema, "structured_outputs": {"json_object": True}}):
            p = parse(tool_choice=choice, **own)
            assert p.tool_call_parser == parser and p.structured.kind == "json", own
            calls = json.loads(p.structured.spec)
            assert calls == WEATHER["function"]["parameters"] if choice is named else calls["type"] == "array"
    # required takes structured_outputs' json too, and an ignored regex that would not compile is no 400
    assert parse(tool_choice="required", structured_outputs={"json": {"type": "object"}}).tool_call_parser == "required"
    assert parse(tool_choice="required", guided_regex="(").tool_call_parser == "required"
    assert parse(tool_choice="none", response_format=schema).structured.spec == '{"type": "array"}'  # its own stands
    # structured_outputs' structural_tag stands beside a forced choice (vLLM's adjust_request leaves such a request
    # as it is): the tag holds the output, read as the calls all the same
    tag = json.dumps({"type": "structural_tag", "structures": [
        {"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}], "triggers": ["<f"]})
    for choice, parser in ((named, "function:get_weather"), ("required", "required")):
        p = parse(tool_choice=choice, structured_outputs={"structural_tag": tag})
        assert (p.tool_call_parser, p.structured.kind) == (parser, "structural_tag")
    for body, param, needle in [
            ({"tool_choice": named, "structured_outputs": {"json": {"type": "object"}}}, "structured_outputs.json",
             "You can only either use constraints for structured outputs or tools, not both."),
            ({"tool_choice": named, "guided_choice": ["a"]}, "guided_choice", "not both"),
            ({"tool_choice": "required", "response_format": {"type": "yaml"}}, "response_format", "'yaml' is not"),
            # more than one of json, regex, choice: vLLM's count check, before its tools one
            ({"tool_choice": named, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
             "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice')."),
            ({"tool_choice": "required", "structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs",
             "You can only use one kind of constraints for structured outputs")]:
        with pytest.raises(api.ApiError, match=re.escape(needle)) as e:
            parse(**body)
        assert e.value.param == param and e.value.status == 400, body


def test_tool_choice_without_tools_and_an_empty_tools_list_are_refused_as_vllm_refuses_them():
    """vLLM 0.32's check_tool_usage: any tool_choice but none (or null) without tools is a 400 naming tool_choice,
    auto too (pushkv served auto as no tools); tools [] is a 400 naming tools whatever the choice (pushkv took it for
    no tools); /tokenize's chat still takes [], as vLLM's does."""
    from pushkv.router import api, chat, text, tokenize

    def parse(**body):
        return chat.parse_chat({"messages": MESSAGES, **body}, text.ByteTokenizer(),
                               api.Limits(vocab_size=320, max_model_len=4096), chat.load_template(""),
                               tool_call_parser="hermes")

    named = {"type": "function", "function": {"name": "get_weather"}}
    for body in ({"tool_choice": "auto"}, {"tool_choice": "required"}, {"tool_choice": named},
                 {"tool_choice": "sometimes"}, {"tool_choice": "auto", "tools": None}):
        with pytest.raises(api.ApiError) as e:
            parse(**body)
        assert (e.value.status, e.value.param, e.value.message) == (
            400, "tool_choice", "When using `tool_choice`, `tools` must be set."), body
    for choice in (None, "none", "auto", named):
        with pytest.raises(api.ApiError) as e:
            parse(tools=[], tool_choice=choice)
        assert (e.value.status, e.value.param, e.value.message) == (400, "tools", (
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely."))
    assert parse(tool_choice="none").tools == [] and parse(tool_choice=None).tool_call_parser == ""
    assert tokenize.tokenize({"messages": MESSAGES, "tools": []}, text.ByteTokenizer(),
                             api.Limits(vocab_size=320, max_model_len=4096), lambda: chat.load_template(""))["count"]


PLACE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
BOOK = {"type": "function", "function": {"name": "book", "parameters": {  # a pydantic model's parameters: $defs
    "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
    "$defs": {"Place": PLACE}}}}


def test_required_builds_vllms_schema_with_the_tools_defs_and_parallel_tool_calls():
    """tool_choice required's schema as vLLM 0.32 builds it: each tool's $defs lifted to the list's own, where its
    $refs point (pushkv left them inside the parameters, where "#/$defs/..." finds nothing: the request was a 400
    saying the JSON does not compile), two tools defining one name differently a 400 naming tools; and
    parallel_tool_calls false holds it to one call (maxItems 1), rather than cutting the others off after."""
    pytest.importorskip("xgrammar")
    from pushkv.router import api, chat, text

    limits = api.Limits(vocab_size=320, max_model_len=4096)
    msgs = [{"role": "user", "content": "book?"}]

    def schema(**body):
        return json.loads(chat.parse_chat({"messages": msgs, "tool_choice": "required", **body}, text.ByteTokenizer(),
                                          limits, chat.load_template(""), tool_call_parser="hermes").structured.spec)

    got = schema(tools=[BOOK, CLOCK])
    assert got["$defs"] == {"Place": PLACE} and "maxItems" not in got and got["minItems"] == 1
    assert got["items"]["anyOf"][0]["properties"]["parameters"] == {
        "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"]}
    assert BOOK["function"]["parameters"]["$defs"] == {"Place": PLACE}  # the request's own tool left as it was
    assert schema(tools=[BOOK, CLOCK], parallel_tool_calls=False)["maxItems"] == 1
    other = {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "$defs": {
        "Place": {"type": "string"}}}}}
    with pytest.raises(api.ApiError, match="'Place' has several schemas") as e:
        schema(tools=[BOOK, other])
    assert e.value.param == "tools"


def forced_through_router(tmp_path, tool_choice, output: str, reason: str, **cfg) -> tuple[dict, list[dict]]:
    """A chat with a forced ``tool_choice`` whose model writes ``output`` (7 bytes a piece), ending ``reason``,
    through the router (its flags ``cfg``): the whole choice, and the streamed choices (each chunk's)."""
    pytest.importorskip("xgrammar")
    out = list(output.encode())
    chunks = [out[i:i + 7] for i in range(0, len(out), 7)]

    async def body():
        flags = {"tool_call_parser": "hermes", **cfg}  # a forced choice needs one, as vLLM's (its own parser reads)
        async with Harness(make_cfg(tmp_path, "local", **flags), {"local": local_script(chunks, reason)}) as h:
            req = {"messages": MESSAGES, "max_tokens": len(out), "tools": [WEATHER, CLOCK], "tool_choice": tool_choice}
            r = await h.http.post("/v1/chat/completions", json=req)
            assert r.status == 200, await r.text()
            whole = (await r.json())["choices"][0]
            r = await h.http.post("/v1/chat/completions", json=dict(req, stream=True))
            return whole, [e["choices"][0] for e in await read_sse(r) if e != "[DONE]" and e["choices"]]
    return run(body())


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def joined_calls(pieces: list[dict]) -> list[tuple[str, str]]:
    """A stream's tool call pieces joined per call, as an OpenAI client joins them: the first piece of a call (its
    ``id``) gives its name, every piece adds to its arguments."""
    calls: dict[int, list[str]] = {}
    for c in pieces:
        if "id" in c:
            assert c["index"] not in calls and c["type"] == "function", c
            calls[c["index"]] = [c["function"]["name"], ""]
        calls[c["index"]][1] += c["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


@pytest.mark.parametrize("tool_choice,output,reason,finish,calls,streamed_calls", [
    # a named function's call ends with stop, as OpenAI's and vLLM's (auto's and required's with tool_calls)
    (NAMED_WEATHER, '{"city": "Rome"}', "stop", "stop", [("get_weather", '{"city": "Rome"}')], None),
    # cut off by max_tokens: vLLM 0.32 still makes the call, its arguments as far as they came; length says so
    (NAMED_WEATHER, '{"city": "Ro', "length", "length", [("get_weather", '{"city": "Ro')], None),
    ("required", '[{"name": "get_time", "parameters": {}}]', "stop", "tool_calls", [("get_time", "{}")], None),
    # required's parameters streamed as written; a whole response re-writes them (json.dumps), as vLLM's
    ("required", '[{"name":"get_weather","parameters":{"city":"Rome"}},{"name":"get_time","parameters":{}}]', "stop",
     "tool_calls", [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")],
     [("get_weather", '{"city":"Rome"}'), ("get_time", "{}")]),
    # required's list cut off is no call, and no content (vLLM's parser reads it whole or not at all); its stream has
    # given the call it had opened, as vLLM's stream has
    ("required", '[{"name": "get_weather", "parameters": {"ci', "length", "length", [],
     [("get_weather", '{"ci')]),
])
def test_a_forced_tool_choice_answers_as_vllm_whole_and_streamed(tmp_path, tool_choice, output, reason, finish,
                                                                 calls, streamed_calls):
    """vLLM 0.32's forced tool choice: the message's content "" and its calls (no ``tool_calls`` key where there are
    none: pushkv gave ``[]`` and the cut JSON as content), finish_reason as vLLM's. Streamed, as vLLM streams it: the
    call opens with its id, type and name and its arguments come in pieces as they are written (pushkv gave each call
    whole at the end), no content."""
    whole, streamed = forced_through_router(tmp_path, tool_choice, output, reason)
    assert whole["finish_reason"] == finish and whole["message"]["content"] == ""
    assert _named(whole["message"].get("tool_calls", [])) == calls and (calls or "tool_calls" not in whole["message"])
    deltas = [c["delta"] for c in streamed]
    assert deltas[0] == {"role": "assistant", "content": ""} and all("content" not in d for d in deltas[1:])
    pieces = [c for d in deltas for c in d.get("tool_calls", [])]
    assert joined_calls(pieces) == (calls if streamed_calls is None else streamed_calls)
    assert streamed[-1]["finish_reason"] == finish and all(c["finish_reason"] is None for c in streamed[:-1])
    # in pieces (the model writes 7 bytes a piece), each after the call's first with its arguments' next text alone
    # (required's: vLLM's "name" null)
    longest = max((len(a) for _, a in joined_calls(pieces)), default=0)
    assert len([c for c in pieces if c["function"]["arguments"]]) > len(joined_calls(pieces)) or longest <= 7
    for c in pieces:
        if "id" not in c:
            assert c == {"index": c["index"], "function": dict({"name": None} if tool_choice == "required" else {},
                                                               arguments=c["function"]["arguments"])}, c


def test_a_forced_call_opens_with_the_answer_after_the_reasoning(tmp_path):
    """With a reasoning parser, a forced named call opens with the answer, after the reasoning, as vLLM's reads the
    calls only once the reasoning ended (pushkv opened it, arguments "", in the reasoning's first chunk)."""
    whole, streamed = forced_through_router(tmp_path, NAMED_WEATHER, '<think>where to?</think>{"city": "Rome"}',
                                            "stop", reasoning_parser="deepseek_r1")
    assert whole["message"]["reasoning"] == "where to?" and _named(whole["message"]["tool_calls"]) == [
        ("get_weather", '{"city": "Rome"}')]
    deltas = [c["delta"] for c in streamed]
    called = [i for i, d in enumerate(deltas) if d.get("tool_calls")]
    thought = [i for i, d in enumerate(deltas) if d.get("reasoning")]
    assert thought and called and thought[-1] <= called[0], deltas
    assert "".join(d.get("reasoning", "") for d in deltas) == "where to?"
    assert joined_calls([c for d in deltas for c in d.get("tool_calls", [])]) == [("get_weather", '{"city": "Rome"}')]


def test_a_choice_without_calls_has_no_tool_calls_key(tmp_path):
    """tool_choice auto with a parser, and no call written: the message has no ``tool_calls`` (vLLM's serializer
    drops an empty list; pushkv answered ``[]``)."""
    async def body():
        cfg = make_cfg(tmp_path, "local", tool_call_parser="hermes")
        async with Harness(cfg, {"local": local_script([list(b"just text")], "stop")}) as h:
            r = await h.http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS})
            return (await r.json())["choices"][0]
    choice = run(body())
    assert choice["message"]["content"] == "just text" and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


def test_parallel_tool_calls_false_gives_the_first_call_alone(tmp_path):
    """OpenAI's and vLLM's parallel_tool_calls false: a choice's first call alone, whole and streamed (pushkv
    ignored the field and gave every call)."""
    out = list((CALL_F + "\n" + CALL_G).encode())
    chunks = [out[i:i + 9] for i in range(0, len(out), 9)]

    async def body():
        cfg = make_cfg(tmp_path, "local", tool_call_parser="hermes")
        async with Harness(cfg, {"local": local_script(chunks, "stop")}) as h:
            got = {}
            for parallel in (None, False):
                req = {"messages": MESSAGES, "tools": TOOLS, **({} if parallel is None else
                                                               {"parallel_tool_calls": parallel})}
                r = await h.http.post("/v1/chat/completions", json=req)
                whole = (await r.json())["choices"][0]
                r = await h.http.post("/v1/chat/completions", json=dict(req, stream=True))
                events = [e["choices"][0] for e in await read_sse(r) if e != "[DONE]" and e["choices"]]
                got[parallel] = (whole, streamed_parts([e["delta"] for e in events])[2], events[-1])
            return got
    got = run(body())
    both = [("get_weather", '{"city": "Paris", "unit": "°C"}'), ("g", "{}")]
    for parallel, calls in ((None, both), (False, both[:1])):
        whole, streamed_calls, last = got[parallel]
        assert _named(whole["message"]["tool_calls"]) == calls and joined_calls(streamed_calls) == calls, parallel
        assert whole["finish_reason"] == last["finish_reason"] == "tool_calls"
