"""``--tool-call-parser qwen3_coder`` (pushkv/router/tool_calls_qwen3.py): Qwen3-Coder's XML-ish calls in hermes'
tags come back as OpenAI ``tool_calls``, their arguments typed by the request's tool schemas as vLLM 0.32 types them;
whole and streamed alike however the text is cut; through the router with the reasoning parser."""
from __future__ import annotations

import json

import pytest

from pushkv.router import tool_calls, tool_calls_qwen3
from tests.router.test_tool_calls import assert_calls_through_router, streamed, through_router

pytestmark = pytest.mark.timeout(30)

WEATHER = {"type": "function", "function": {"name": "get_current_weather", "parameters": {"type": "object",
                                                                                      "properties": {
    "city": {"type": "string"}, "state": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
    "days": {"type": "integer"}, "ratio": {"type": "number"}, "hourly": {"type": "boolean"},
    "where": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
    "note": {"type": ["string", "null"]}, "level": {"enum": [1, 2, 3]}, "limit": {"type": "int"}}}}}
TOOLS = [WEATHER]

DALLAS = ("<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n"
          "<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nf\n</parameter>\n</function>\n</tool_call>")
TYPED = ("<tool_call>\n<function=get_current_weather>\n<parameter=days>\n3\n</parameter>\n"
         "<parameter=ratio>\n0.5\n</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n"
         '<parameter=where>\n{"lat": 1.5, "lon": -2}\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
         "<parameter=note>\nnull\n</parameter>\n<parameter=level>\n2\n</parameter>\n"
         "<parameter=limit>\n10\n</parameter>\n</function>\n</tool_call>")
# text -> (content, [(name, arguments as an object)])
CASES = {
    "no call here": ("no call here", []),
    "Let me check.\n" + DALLAS: ("Let me check.\n", [("get_current_weather", {"city": "Dallas", "state": "TX",
                                                                             "unit": "f"})]),
    TYPED: (None, [("get_current_weather", {"days": 3, "ratio": 0.5, "hourly": True, "where": {"lat": 1.5, "lon": -2},
                                            "tags": ["a", "b"], "note": None, "level": 2, "limit": 10})]),
    # two calls; a value over several lines keeps its inner newlines; a value that is not its type stays text
    DALLAS + "\n<tool_call>\n<function=get_current_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n"
    "<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>":
        (None, [("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "f"}),
                ("get_current_weather", {"city": "New\nYork", "days": "three"})]),
    # a function not among the tools, and a parameter its schema does not name: strings, as written
    "<tool_call>\n<function=other>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>":
        (None, [("other", {"n": "7"})]),
    # a string parameter keeps a number's text
    "<tool_call><function=get_current_weather><parameter=city>42</parameter></function></tool_call>":
        (None, [("get_current_weather", {"city": "42"})]),
    # cut off by max_tokens: the parameters written, the last as far as it came
    "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n<parameter=state>\nT":
        (None, [("get_current_weather", {"city": "Dallas", "state": "T"})]),
    # a function without <tool_call> around it (vLLM's grammar takes it), after text and before a tagged one
    "Sure. <function=get_current_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n" + DALLAS:
        ("Sure. ", [("get_current_weather", {"days": 2}),
                    ("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "f"})]),
    "<function=get_current_weather><parameter=city>Ro": (None, [("get_current_weather", {"city": "Ro"})]),
    "a <function=>b</function>": ("a <function=>b</function>", []),  # no name: text
    # several functions in one <tool_call>, or a <tool_call> opened again before the first closed: a call each, as
    # vLLM's grammar reads them (pushkv gave one call, the first's name with the last's parameters)
    "<tool_call>\n<function=get_current_weather>\n<parameter=days>\n1\n</parameter>\n</function>\n"
    "<function=other>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>":
        (None, [("get_current_weather", {"days": 1}), ("other", {"n": "2"})]),
    "<tool_call>\n<function=get_current_weather>\n<parameter=days>\n1\n</parameter>\n</function>\n"
    "<tool_call>\n<function=get_current_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>":
        (None, [("get_current_weather", {"days": 1}), ("get_current_weather", {"days": 2})]),
    # between the tags but no function: content, as hermes' text that is no call
    "<tool_call>\nnot a call\n</tool_call> after": ("<tool_call>\nnot a call\n</tool_call> after", []),
    "": (None, []),
}


def _objects(calls):
    return [(name, json.loads(args)) for name, args in calls]


@pytest.mark.parametrize("text", sorted(CASES))
def test_a_whole_content_gives_its_typed_calls(text):
    content, calls = tool_calls.parse(text, "qwen3_coder", TOOLS)
    assert content == CASES[text][0]
    assert _objects([(c["function"]["name"], c["function"]["arguments"]) for c in calls]) == CASES[text][1]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)


@pytest.mark.parametrize("text", sorted(CASES))
def test_streamed_in_pieces_the_deltas_give_the_whole(text, monkeypatch):
    monkeypatch.setattr(tool_calls, "streamer", lambda parser, tools=None, real=tool_calls.streamer: real(parser,
                                                                                                       TOOLS))
    step = max(1, len(text) // 23)
    for a in range(0, len(text) + 1, step):
        for b in range(a, len(text) + 1, step):
            (content, calls), _ = streamed("qwen3_coder", [text[:a], text[a:b], text[b:]])
            assert (content, _objects(calls)) == CASES[text], (a, b)


@pytest.mark.parametrize("value, schema, want", [
    ("5", {"type": "number"}, 5), ("5.25", {"type": "number"}, 5.25), ("inf", {"type": "number"}, "inf"),
    ("0", {"type": "boolean"}, False), ("yes", {"type": "boolean"}, "yes"),
    ("7", {"anyOf": [{"type": "null"}, {"type": "integer"}]}, 7), ("null", {"type": ["integer", "null"]}, None),
    ("[1, 2]", {"type": "integer"}, [1, 2]),  # no type fits: JSON where it is JSON
    ("1e999", {"type": "array"}, "1e999"),  # JSON with an infinite number: kept text
    ("x", {}, "x"),
])
def test_a_value_is_typed_by_its_schema_as_vllm_types_it(value, schema, want):
    assert tool_calls_qwen3.typed(value, schema) == want


def test_through_the_router_with_the_reasoning_parser(tmp_path):
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    got = through_router(tmp_path, "qwen3_coder", "Checking.\n" + call, 7)
    assert_calls_through_router(got, call, "Checking.\n", [("get_weather", '{"city": "Paris"}')])
