"""``--tool-call-parser mistral`` (pushkv/router/tool_calls.py): the calls a Mistral model writes after
``[TOOL_CALLS]``, in the older form (a JSON list of calls) and the newer one (``name[ARGS]{...}``), come back as
OpenAI ``tool_calls`` with Mistral's 9-character ids, the text before them as content; whole and streamed alike
however the text is cut into 3 deltas; output without ``[TOOL_CALLS]`` is content, as vLLM's (the router keeps
special tokens in the text for this parser); anything that is not a call stays content; through the router with
the reasoning parser."""
from __future__ import annotations

import json

import pytest

from pushkv.router import tool_calls
from tests.router.test_tool_calls import _named, assert_calls_through_router, streamed, three_pieces, through_router

pytestmark = pytest.mark.timeout(30)

WEATHER = ("get_weather", '{"city": "Paris", "unit": "°C"}')
NESTED = ("plan", '{"trip": {"stops": [{"city": "Lyon", "days": 2}, {"city": "Nice", "days": null}]}}')
# text -> (content, [(name, arguments)])
CASES = {
    "no call here": ("no call here", []),
    # the older form (v3 tokenizers: Mistral 7B v0.3, Mixtral 8x22B, Nemo, Small 24B 2501)
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}]': (None, [WEATHER]),
    '[TOOL_CALLS][{"name": "plan", "arguments": {"trip": {"stops": [{"city": "Lyon", "days": 2}, '
    '{"city": "Nice", "days": null}]}}}, {"name": "g", "arguments": {}}]': (None, [NESTED, ("g", "{}")]),
    'Let me look.\n[TOOL_CALLS][{"arguments": {"a": 1}, "name": "f"}]': ("Let me look.\n", [("f", '{"a": 1}')]),
    '[TOOL_CALLS][{"name": "f"}]': (None, [("f", "{}")]),
    # an id the model wrote into an object (as the v3 templates write the conversation's calls) is not the call's
    '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "id": "abcdefghi"}]': (None, [("f", '{"a": 1}')]),
    # the newer form (v11 on: Small 3.1+, Devstral, Magistral), with [ARGS] and without
    'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "°C"}': ("Checking.", [WEATHER]),
    '[TOOL_CALLS]plan[ARGS]{"trip": {"stops": [{"city": "Lyon", "days": 2}, {"city": "Nice", "days": null}]}}'
    '[TOOL_CALLS]g[ARGS]{}': (None, [NESTED, ("g", "{}")]),
    '[TOOL_CALLS]add{"a": 3.5, "b": 4}': (None, [("add", '{"a": 3.5, "b": 4}')]),
    '[TOOL_CALLS]f[ARGS]{"x": "}]"} and then some': ("and then some", [("f", '{"x": "}]"}')]),
    # white space between calls is no content
    '[TOOL_CALLS]f[ARGS]{}\n [TOOL_CALLS]g[ARGS]{"x": 1}': (None, [("f", "{}"), ("g", '{"x": 1}')]),
    # not calls: content, all of it (without the marker, as vLLM's)
    'get_weather{"city": "Paris", "unit": "°C"}': ('get_weather{"city": "Paris", "unit": "°C"}', []),
    ' [{"name": "f", "arguments": {"x": [1, 2]}}]': (' [{"name": "f", "arguments": {"x": [1, 2]}}]', []),
    '[{"name": "Ann", "age": 3}]': ('[{"name": "Ann", "age": 3}]', []),
    "[TOOL_CALLS]I am not sure": ("[TOOL_CALLS]I am not sure", []),
    '[TOOL_CALLS][{"name": 5}]': ('[TOOL_CALLS][{"name": 5}]', []),
    '[TOOL_CALLS]f[ARGS]{"a": 1': ('[TOOL_CALLS]f[ARGS]{"a": 1', []),  # cut at max_tokens
    'Sure. [TOOL_CALLS]f[ARGS]{bad}[TOOL_CALLS]g[ARGS]{"x": 1}':
        ("Sure. [TOOL_CALLS]f[ARGS]{bad}", [("g", '{"x": 1}')]),
    "Paris{ is not JSON }": ("Paris{ is not JSON }", []),
    "[link](https://example.com) and [TOOL": ("[link](https://example.com) and [TOOL", []),
    "   ": ("   ", []),
    "": (None, []),
}


@pytest.mark.parametrize("text", sorted(CASES))
def test_a_whole_content_gives_its_calls(text):
    content, calls = tool_calls.parse(text, "mistral")
    assert (content, _named(calls)) == CASES[text]
    assert all(c["type"] == "function" and len(c["id"]) == 9 and c["id"].isalnum() and "index" not in c
               for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    assert all(c["id"] != "abcdefghi" for c in calls)  # each a new id, as vLLM 0.32's (MistralToolCall)


# where a stream differs from the whole: a call it opened whose JSON then breaks stays a call, as vLLM's stream has it
STREAMED = {
    'Sure. [TOOL_CALLS]f[ARGS]{bad}[TOOL_CALLS]g[ARGS]{"x": 1}': ("Sure. ", [("f", "{bad}"), ("g", '{"x": 1}')]),
    '[TOOL_CALLS]f[ARGS]{"a": 1': (None, [("f", '{"a": 1')]),
}


@pytest.mark.parametrize("text", sorted(CASES))
def test_streamed_in_any_3_deltas_the_deltas_give_the_whole(text):
    for pieces in three_pieces(text):
        (content, calls), sent = streamed("mistral", pieces)
        assert (content, calls) == STREAMED.get(text, CASES[text]), pieces
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in sent if "id" in c)


def test_content_streams_as_it_comes_and_each_call_in_pieces_as_it_is_written():
    """vLLM 0.32's stream: a call opens once its name is followed by [ARGS]{ (id, type, name, the arguments so far),
    then its arguments come as written (pushkv sent each call whole as its JSON ended)."""
    s = tool_calls.streamer("mistral")
    assert s.feed("Checking the ") == ("Checking the ", [])
    assert s.feed("weather.[TOOL_") == ("weather.", [])  # may begin [TOOL_CALLS]: held
    assert s.feed("CALLS]get_weather[AR") == ("", [])  # the name may go on, or [ARGS] come
    content, calls = s.feed('GS]{"city": "Pa')
    assert content == "" and [(c["index"], c["function"]) for c in calls] == [
        (0, {"name": "get_weather", "arguments": '{"city": "Pa'})] and len(calls[0]["id"]) == 9
    content, calls = s.feed('ris"}[TOOL_CALLS]g[ARGS]{"x"')
    assert content == "" and calls[0] == {"index": 0, "function": {"arguments": 'ris"}'}}
    assert [(c["index"], c["function"]) for c in calls[1:]] == [(1, {"name": "g", "arguments": '{"x"'})]
    content, calls = s.feed(": 1}", final=True)
    assert content == "" and calls == [{"index": 1, "function": {"arguments": ": 1}"}}]
    # without a marker nothing is held: a word, or a JSON list, goes out as it comes
    s = tool_calls.streamer("mistral")
    assert s.feed("Hello") == ("Hello", []) and s.feed(' [{"name": "f"') == (' [{"name": "f"', [])


@pytest.mark.parametrize("output, content", [
    ('Checking.\n[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "°C"}', "Checking.\n"),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}]', None),
])
def test_through_the_router_with_the_reasoning_parser(tmp_path, output, content):
    got = through_router(tmp_path, "mistral", output, 5)
    assert_calls_through_router(got, output, content, [WEATHER])
    call = got["whole"]["message"]["tool_calls"][0]
    assert len(call["id"]) == 9 and call["id"].isalnum()  # Mistral's ids
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "°C"}
