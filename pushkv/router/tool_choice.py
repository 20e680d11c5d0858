"""A forced tool choice, as vLLM 0.32 serves it on its JSON path: tool_choice ``required`` or a named function holds the
output, by structured output, to the calls' JSON (``forced_schema``); the output is then read as calls, streamed as it
is written (``ForcedStreamer``) or whole (``forced_calls``), and is never content. ``tool_calls.streamer`` and
``tool_calls.parse`` hand a forced choice's parser name (``REQUIRED``, or ``NAMED`` + the function's) here.

Pure: text in, calls out.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from pushkv.router.tool_calls import _tool_call, function_of

REQUIRED, NAMED = "required", "function:"  # tool_choice required, or a named function (NAMED + its name)


def forced_schema(tools: list[dict], name: str = "", parallel: bool = True) -> dict:
    """The JSON schema a forced tool choice holds the output to, as vLLM 0.32 builds it: a named function's parameters,
    or for ``required`` a non-empty list of ``{"name", "parameters"}``, each one of the tools', at most one where
    ``parallel`` is false (vLLM's ``maxItems`` 1 for parallel_tool_calls false), and every tool's ``$defs`` lifted to
    the list's own (where its ``$ref``s, ``#/$defs/...``, point: a pydantic model's parameters). ValueError where
    two tools define one name differently, as vLLM refuses it."""
    def params(t: dict) -> Any:
        return function_of(t).get("parameters") or {"type": "object", "properties": {}}

    if name:
        return next(params(t) for t in tools if function_of(t).get("name") == name)
    defs: dict[str, Any] = {}
    items = []
    for t in tools:
        p = params(t)
        if isinstance(p, dict) and "$defs" in p:
            p = dict(p)
            own = p.pop("$defs")
            if not isinstance(own, dict):
                raise ValueError(f"the $defs of tool {function_of(t).get('name')!r} must be an object")
            for key, value in own.items():
                if defs.setdefault(key, value) != value:
                    raise ValueError(f"tool definition {key!r} has several schemas among the tools' $defs")
        items.append({"properties": {"name": {"type": "string", "enum": [function_of(t).get("name")]},
                                     "parameters": p}, "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class ForcedStreamer:
    """tool_choice ``required`` or a named function, streamed as vLLM 0.32 streams them: the output is the calls' JSON
    (the grammar holds it to ``forced_schema``) and its calls go out as it is written, never whole at the end.

    - A named function: the choice's first delta opens the call (its ``id``, ``type``, ``name`` and the arguments
      written so far), and every later delta carries the arguments' next piece (``{"index": 0, "function":
      {"arguments": ...}}``, an empty piece too), so the pieces join to the output as written, cut off at
      max_tokens or not (the choice's finish_reason ``length`` says which).
    - ``required``: the output is a JSON list of ``{"name", "parameters"}``, read as it comes (``_CallsScan``); a call
      opens once its name is closed and its parameters have begun (``id``, ``type``, ``name`` and the parameters'
      text so far), and each later delta carries its parameters' new text (``name`` null, as vLLM's), as written (a
      whole response re-writes them with ``json.dumps``, as vLLM's does). A list cut off at max_tokens has given the
      calls it had opened, as vLLM's stream has (a whole response gives none: ``forced_calls``).

    The output is never content."""

    def __init__(self, name: str = ""):
        self.name = name
        self.text = ""
        self.calls = 0  # the calls opened so far
        self.scan = _CallsScan()
        self.sent: list[int] = []  # required: how far each opened call's parameters went out

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += text
        if self.name:
            if self.calls:
                return "", [{"index": 0, "function": {"arguments": text}}]
            if final and not self.text.strip():  # nothing written: no call, as a whole response
                return "", []
            self.calls = 1
            return "", [dict(_tool_call(self.name, self.text), index=0)]
        out: list[dict] = []
        for i, span in enumerate(self.scan.feed(self.text)):
            if span.name is None or span.args_start < 0:
                break  # the calls come in order: none after this one has begun
            end = len(self.text) if span.args_end < 0 else span.args_end
            if i < len(self.sent):
                if end > self.sent[i]:
                    out.append({"index": i, "function": {"name": None, "arguments": self.text[self.sent[i]:end]}})
                    self.sent[i] = end
                continue
            out.append(dict(_tool_call(span.name, self.text[span.args_start:end]), index=i))
            self.sent.append(end)
            self.calls += 1
        return "", out


class _Span:
    """One call of ``required``'s list, as far as it is written: its name once its string closed, where its
    parameters' value begins and ends (-1: not yet)."""

    def __init__(self):
        self.name: Optional[str] = None
        self.args_start = self.args_end = -1


class _CallsScan:
    """``required``'s output, a JSON list of ``{"name": ..., "parameters": ...}``, scanned as it comes (each character
    once, strings and nesting minded): where each call's name and parameters lie. Only the list's own objects are
    read, so what a value holds cannot confuse it; text after the list, or a list that is not one, ends the scan."""

    def __init__(self):
        self.spans: list[_Span] = []
        self.at = 0
        self.depth = 0  # the list is depth 1, its objects' keys and values depth 2
        self.in_string = self.escaped = self.ended = False
        self.string_start = 0
        self.key: Optional[str] = None
        # what the object at depth 2 expects next: key, colon, value, or which value it is in (string, nested,
        # scalar), or what follows a value
        self.expect = "key"
        self.value_start = 0

    def feed(self, text: str) -> list[_Span]:
        """The calls of ``text`` (the output so far: what was fed before, and more)."""
        while not self.ended and self.at < len(text):
            self._char(text, self.at)
            self.at += 1
        return self.spans

    def _end_value(self, text: str, end: int) -> None:
        span = self.spans[-1]
        if self.key == "parameters":
            span.args_end = end
        elif self.key == "name" and self.expect == "string":
            try:
                span.name = json.loads(text[self.value_start:end])
            except ValueError:
                span.name = None  # never a call, as a whole response refuses the list
        self.expect = "after"

    def _start_value(self, at: int, kind: str) -> None:
        self.value_start = at
        if self.key == "parameters":
            self.spans[-1].args_start = at
        self.expect = kind

    def _char(self, text: str, at: int) -> None:
        ch = text[at]
        inside = self.depth == 2  # in one of the list's objects, outside any nested value
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if inside and self.expect == "key":
                    self.key, self.expect = text[self.string_start + 1:at], "colon"
                elif inside and self.expect == "string":
                    self._end_value(text, at + 1)
            return
        if ch == '"':
            self.in_string, self.string_start = True, at
            if inside and self.expect == "value":
                self._start_value(at, "string")
        elif ch in "[{":
            if (self.depth == 0 and ch != "[") or (self.depth == 1 and ch != "{"):
                self.ended = True  # not a list of objects
                return
            if self.depth == 1:
                self.spans.append(_Span())
                self.key, self.expect = None, "key"
            elif inside and self.expect == "value":
                self._start_value(at, "nested")
            self.depth += 1
        elif ch in "]}":
            if inside and self.expect == "scalar":
                self._end_value(text, at)
            self.depth -= 1
            if self.depth == 2 and self.expect == "nested":
                self._end_value(text, at + 1)
            elif self.depth <= 0:
                self.ended = True  # the list closed
        elif inside:
            if ch == ":" and self.expect == "colon":
                self.expect = "value"
            elif ch == ",":
                if self.expect == "scalar":
                    self._end_value(text, at)
                self.key, self.expect = None, "key"
            elif ch.isspace():
                if self.expect == "scalar":
                    self._end_value(text, at)
            elif self.expect == "value":
                self._start_value(at, "scalar")


def forced_calls(text: str, parser: str) -> list[dict]:
    """A forced tool choice's whole output as its calls, as vLLM 0.32's whole response makes them: a named function's
    call has the output as its arguments, as written (none where nothing was written); ``required``'s is its list
    of names and parameters, every parameters re-written as JSON, and none where the output is not that list (cut
    off)."""
    if parser.startswith(NAMED):
        return [_tool_call(parser[len(NAMED):], text)] if text.strip() else []
    return _required_calls(text)


def _required_calls(text: str) -> list[dict]:
    """tool_choice ``required``'s output as calls: a JSON list of ``{"name", "parameters"}``; none where it is not
    one, every item a call (vLLM reads it whole or not at all)."""
    try:
        got = json.loads(text)
    except (ValueError, RecursionError):
        return []
    if not isinstance(got, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in got):
        return []
    return [_tool_call(c["name"], c.get("parameters") or {}) for c in got]


def ends_with_calls(parser: str) -> bool:
    """Whether a choice that made calls and stopped by itself ends with ``tool_calls``: auto and ``required`` do,
    a named function's ends with ``stop``, as OpenAI's and vLLM's."""
    return not parser.startswith(NAMED)


def forced(parser: str) -> bool:
    """Whether ``parser`` is a forced tool choice's (required, or a named function)."""
    return parser == REQUIRED or parser.startswith(NAMED)


def streamer(parser: str) -> ForcedStreamer:
    """A forced choice's streamer for ``parser`` (REQUIRED, or NAMED + the function's name)."""
    return ForcedStreamer(parser[len(NAMED):] if parser.startswith(NAMED) else "")
