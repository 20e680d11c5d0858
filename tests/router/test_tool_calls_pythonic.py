"""``--tool-call-parser pythonic`` (pushkv/router/tool_calls.py): an output that is a Python list of calls with
literal keyword arguments (Llama 3.2, Llama 4) comes back as OpenAI ``tool_calls``; anything else, a variable, an
expression, a positional argument, text around the list, stays content, all of it, and nothing is ever run; whole
and streamed alike however the text is cut into 3 deltas; through the router with the reasoning parser."""
from __future__ import annotations

import json

import pytest

from pushkv.router import tool_calls
from tests.router.test_tool_calls import _named, assert_calls_through_router, streamed, three_pieces, through_router

pytestmark = pytest.mark.timeout(30)

WEATHER = ("get_weather", '{"city": "Paris", "unit": "°C"}')
# text -> (content, [(name, arguments)])
CASES = {
    '[get_weather(city="Paris", unit="°C")]': (None, [WEATHER]),
    "[get_weather(city='Paris', unit='°C'), plan(trip={'stops': [{'city': 'Lyon', 'days': 2}], 'ok': True}, "
    "at=(1, -2.5), note=None)]\n":
        (None, [WEATHER, ("plan", '{"trip": {"stops": [{"city": "Lyon", "days": 2}], "ok": true}, '
                                  '"at": [1, -2.5], "note": null}')]),
    " [f()]": (None, [("f", "{}")]),
    # not calls: content, all of it
    "[f(x=y)]": ("[f(x=y)]", []),  # a variable
    "[f(x=g())]": ("[f(x=g())]", []),  # a call
    "[f(x=1 + 2)]": ("[f(x=1 + 2)]", []),  # an expression
    '[f(x=__import__("os").system("touch ran"))]': ('[f(x=__import__("os").system("touch ran"))]', []),
    "[f(1)]": ("[f(1)]", []),  # positional
    "[f(**kw)]": ("[f(**kw)]", []),
    '[os.system(cmd="ls")]': ('[os.system(cmd="ls")]', []),  # not a plain name
    "[f(x={1, 2})]": ("[f(x={1, 2})]", []),  # a set: not JSON
    "[f(x=1e999)]": ("[f(x=1e999)]", []),  # inf: not JSON
    "[f(x={1: 2})]": ("[f(x={1: 2})]", []),  # a number as a key
    "[f(x=1), 2]": ("[f(x=1), 2]", []),
    "[f(x=1)] and that is all": ("[f(x=1)] and that is all", []),
    "Calling [f(x=1)]": ("Calling [f(x=1)]", []),
    '[f(x="cut': ('[f(x="cut', []),  # cut at max_tokens
    "[link](https://example.com)": ("[link](https://example.com)", []),
    "[1, 2, 3]": ("[1, 2, 3]", []),
    "[]": ("[]", []),
    "The weather is mild.": ("The weather is mild.", []),
    "": (None, []),
}


@pytest.mark.parametrize("text", sorted(CASES))
def test_a_whole_content_gives_its_calls(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    content, calls = tool_calls.parse(text, "pythonic")
    assert (content, _named(calls)) == CASES[text]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    for c in calls:
        json.loads(c["function"]["arguments"])
    assert not (tmp_path / "ran").exists()  # read, never run


@pytest.mark.parametrize("text", sorted(CASES))
def test_streamed_in_any_3_deltas_the_deltas_give_the_whole(text):
    for pieces in three_pieces(text):
        assert streamed("pythonic", pieces)[0] == CASES[text], pieces
        if pieces[0].strip() and not text.lstrip().startswith("["):  # plain content streams as it comes
            s = tool_calls.streamer("pythonic")
            assert s.feed(pieces[0]) == (pieces[0], [])


def test_text_that_may_still_begin_a_list_of_calls_is_held_only_that_long():
    s = tool_calls.streamer("pythonic")
    assert [s.feed(p) for p in (" ", "[", "get_weather")] == [("", [])] * 3
    assert s.feed("(city=") == ("", [])  # a list of calls: held to the end
    content, calls = s.feed('"Paris")]', final=True)
    assert content == "" and _named(calls) == [("get_weather", '{"city": "Paris"}')]
    s = tool_calls.streamer("pythonic")
    assert s.feed("[link") == ("", []) and s.feed("](x) more") == ("[link](x) more", [])


def test_through_the_router_with_the_reasoning_parser(tmp_path):
    output = '\n\n[get_weather(city="Paris", unit="°C")]'
    assert_calls_through_router(through_router(tmp_path, "pythonic", output, 5), output, None, [WEATHER])
