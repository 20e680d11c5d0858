"""tool_choice auto's calls streamed in pieces (pushkv/router/tool_call_pieces.py, tool_calls_qwen3.py,
tool_calls_mistral.py), as vLLM 0.32's hermes, llama3_json, qwen3_coder and mistral parsers stream them: a call opens
with its id, type and name, then its arguments come as they are written; however the model's text is cut into
deltas, the pieces join to the whole response's calls (arguments as json.dumps writes them, whatever layout the
model wrote) and the content to its content."""
from __future__ import annotations

import itertools
import json

import pytest

from pushkv.router import tool_calls
from pushkv.router.tool_call_pieces import Rewriter
from tests.router.test_tool_calls_qwen3 import DALLAS, TOOLS, TYPED

pytestmark = pytest.mark.timeout(60)

# JSON values in the layouts a model may write them: each re-written as json.dumps writes the parsed value
VALUES = [
    '{"city": "Paris", "unit": "°C"}',
    '{"city":"Paris","n":1.50,"ok":true,"none":null,"big":12345678901234567890}',
    '{ "a" : [ 1 , 2.0e2 , -0 , {"b" :{ } } , [ ] ] ,\n "c":\t"x" }',
    r'{"esc": "a\"b\\c\/d\n\t\u00e9\ud83d\ude00 \ud800x \u0041", "ctl": "\u0001"}',
    '"a string, \\"quoted\\""',  # a call's arguments given as a string: its text
    "42",
    "[]",
]


def rewritten(value: str) -> str:
    """What ``Rewriter`` writes of ``value`` fed a character at a time; each step's output a prefix of the next."""
    w, before = Rewriter(), ""
    for ch in value:
        assert w.feed(ch), (value, ch)
        assert w.out.startswith(before), (value, before, w.out)
        before = w.out
    w.finish()
    return w.out


@pytest.mark.parametrize("value", VALUES)
def test_a_value_is_rewritten_as_json_dumps_writes_it(value):
    parsed = json.loads(value)
    assert rewritten(value) == (parsed if isinstance(parsed, str) else json.dumps(parsed, ensure_ascii=False))


def test_a_value_ends_where_its_enclosing_object_goes_on():
    for value, after in (("42", ","), ("true", "}"), ('"x"', ","), ("[1]", " ")):
        w = Rewriter()
        assert all(w.feed(ch) for ch in value)
        assert not w.feed(after) or after == " "


def hermes(args: str, name: str = "get_weather", layout: str = '{{"name": "{name}", "arguments": {args}}}') -> str:
    return "<tool_call>\n" + layout.format(name=name, args=args) + "\n</tool_call>"


# a model's output, for hermes: each as whole and as streamed in any pieces
HERMES = [
    "Let me look.\n" + hermes(VALUES[0]),
    hermes(VALUES[1]) + "\n" + hermes(VALUES[5], "g"),
    hermes(VALUES[2], layout='{{"arguments": {args}, "name": "{name}"}}'),  # the name after the arguments
    hermes(VALUES[3]),
    hermes(VALUES[4], "s") + " and then some text",
    hermes("", "no_args", layout='{{"name":"{name}"}}'),  # no arguments: {} as whole
    '<tool_call>{"name": "cut", "arguments": {"a": [1, 2]}}',  # cut before its closing tag, its JSON whole
    "<tool_call>not json</tool_call> after",
    "plain text <tool_ca",
    "",
]

# llama3_json's
LLAMA3 = [
    '{"name": "get_weather", "parameters": ' + VALUES[1] + "}",
    ' {"name": "f", "parameters": {}}; {"name": "g", "arguments": ' + VALUES[3] + "}",
    'The weather is {"mild"}.',
    '{"answer": 42}',
    "",
]


# qwen3_coder's, its arguments typed by TOOLS' schemas
QWEN3 = [
    "Let me check.\n" + DALLAS,
    TYPED + "\n" + DALLAS,
    '<tool_call>\n<function=get_current_weather>\n<parameter=city>\nNew\n"York"\n\n</parameter>\n'
    "<parameter=days>\n3\n</parameter>\n</function>\n<function=other>\n<parameter=n>\n7\n</parameter>\n</function>\n"
    "</tool_call>",
    "<function=get_current_weather><parameter=city>Ro",  # cut off: the parameters as far as they came
    "<tool_call>\nnot a call\n</tool_call> after",
]


# mistral's, both forms
MISTRAL = [
    'Checking.[TOOL_CALLS]get_weather[ARGS]' + VALUES[1] + '[TOOL_CALLS]g{"x": [1, {"y": null}]}',
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + VALUES[3] + '}, {"arguments": {}, "name": "g"}] after',
    '[TOOL_CALLS][{"name": "Ann", "age": 3}]',  # no call: content, the marker kept
]


def cuts(text: str):
    """Ways of cutting ``text`` into deltas: a character each, every cut in two, and a spread of cuts in three (empty
    pieces too: a stream's last delta often is)."""
    yield list(text) + [""]
    for a in range(len(text) + 1):
        yield [text[:a], text[a:]]
    step = max(1, len(text) // 12)
    for a, b in itertools.combinations_with_replacement(range(0, len(text) + 1, step), 2):
        yield [text[:a], text[a:b], text[b:]]


def stream(parser: str, pieces: list[str]) -> tuple[str, list[dict], list[list[dict]]]:
    """A stream of ``pieces``: its content, its calls joined as an OpenAI client joins them, and each delta's
    call pieces; each call piece's shape checked as vLLM's (the opening: id, type, name; then arguments alone)."""
    s = tool_calls.streamer(parser, TOOLS)
    content, joined, deltas = "", {}, []
    for i, piece in enumerate(pieces):
        text, calls = s.feed(piece, final=i == len(pieces) - 1)
        content += text
        deltas.append(calls)
        assert len({c["index"] for c in calls}) == len(calls), calls  # one entry a call in a delta
        for c in calls:
            if "id" in c:
                assert c["index"] == len(joined) and c["type"] == "function"
                assert (len(c["id"]) == 9 and c["id"].isalnum()) if parser == "mistral" else c["id"].startswith(
                    "chatcmpl-tool-")  # Mistral's templates want 9 letters and digits
                assert set(c["function"]) == {"name", "arguments"}
                joined[c["index"]] = dict(name=c["function"]["name"], arguments="")
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}, c
                assert c["function"]["arguments"], c  # a piece says something
            joined[c["index"]]["arguments"] += c["function"]["arguments"]
    assert s.calls == len(joined)
    return content, [joined[i] for i in sorted(joined)], deltas


def whole(parser: str, text: str) -> tuple[str, list[dict]]:
    content, calls = tool_calls.parse(text, parser, TOOLS)
    return content or "", [dict(name=c["function"]["name"], arguments=c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("parser,text", [("hermes", t) for t in HERMES] + [("llama3_json", t) for t in LLAMA3]
                         + [("qwen3_coder", t) for t in QWEN3] + [("mistral", t) for t in MISTRAL])
def test_any_pieces_join_to_the_whole_response(parser, text):
    want = whole(parser, text)
    for pieces in cuts(text):
        content, calls, _ = stream(parser, pieces)
        assert (content, calls) == want, pieces


@pytest.mark.parametrize("parser,text,opened_by", [("hermes", HERMES[0], '"'), ("llama3_json", LLAMA3[0], '"'),
                                                   ("qwen3_coder", QWEN3[0], ">"), ("mistral", MISTRAL[1], '"')])
def test_a_call_opens_with_its_name_before_its_arguments_are_written(parser, text, opened_by):
    """A token at a time, the call opens as soon as its name is read, and its arguments follow in many pieces
    (pushkv gave each call whole once its JSON, or its closing tag, ended)."""
    _, calls, deltas = stream(parser, list(text) + [""])
    name = calls[0]["name"]
    opened = next(i for i, d in enumerate(deltas) if d and d[0].get("id"))
    assert text[opened] == opened_by and text[opened - len(name):opened] == name  # what closed the name
    assert deltas[opened][0]["function"]["arguments"] in ("", "{")
    assert len([d for d in deltas if d]) > 10


@pytest.mark.parametrize("parser,text,content,opened", [
    # a call opened, then cut off: the stream has given it as far as it came (vLLM's); whole, it is content
    ("hermes", '<tool_call>{"name": "cut", "arguments": {"city": "Par', "", ('cut', '{"city": "Par')),
    ("llama3_json", '{"name": "cut", "parameters": {"city": "Par', "", ('cut', '{"city": "Par')),
    # a call, then an object that is none: what follows the call is content
    ("llama3_json", '{"name": "f", "parameters": {}}; {"x": 1}', '{"x": 1}', ("f", "{}")),
])
def test_a_call_opened_stays_a_call_where_its_text_breaks_later(parser, text, content, opened):
    for pieces in cuts(text):
        got_content, calls, _ = stream(parser, pieces)
        assert (got_content, [(c["name"], c["arguments"]) for c in calls]) == (content, [opened]), pieces
    assert whole(parser, text) == (text, [])
