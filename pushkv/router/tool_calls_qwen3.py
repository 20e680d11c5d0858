"""``--tool-call-parser qwen3_coder`` (Qwen3-Coder, Qwen3.5): the calls a choice writes in Qwen3-Coder's XML-ish
format, inside hermes' ``<tool_call>`` tags (a whole response's read by ``tool_calls.Streamer``; a stream's by
``Qwen3CoderStreamer``, each call in pieces as it is written)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is the text between its tags, less one newline on each side (the template's layout), and is typed as vLLM
0.32 types it by the request's tool's schema for that parameter: ``null`` for a null type, an integer, a finite
number, a boolean (``true``/``1``, ``false``/``0``), an object or array as JSON, a string as written; a value that
fits none of its types is read as JSON where it is (finite) JSON, else kept a string; a parameter the schema does
not name, or a function not among the tools, keeps its strings. A call cut off by ``max_tokens`` keeps the
parameters written, its last one as far as it came. Text between the tags that names no function stays content. A
``<function=...>...</function>`` written without ``<tool_call>`` around it is a call too, as vLLM's grammar takes
it.

Pure: text in, calls (or their pieces) out.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Optional

from pushkv.router.text import tag_start
from pushkv.router.tool_call_pieces import CallPieces, PieceStreamer
from pushkv.router.tool_calls import _tool_call, function_of

# what opens and closes a call, and whether the reader is given them: hermes' tags, or a function's alone
TAGS = (("<tool_call>", "</tool_call>", False), ("<function=", "</function>", True))
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
_CLOSES = ("</parameter>", "<parameter=", "</function>")  # where a value ends (the second and third: unclosed)
# the order vLLM tries a schema's types in; "string" ends the search (any text is one)
_TYPES = ("null", "integer", "number", "boolean", "object", "array", "string")


def reader(tools: list[dict]) -> Callable[[str], list[dict]]:
    """A tagged text's calls (between ``<tool_call>`` and ``</tool_call>``, or a ``<function=...>`` alone) as OpenAI
    tool calls, their arguments typed by ``tools``' parameter schemas; [] where it names no function."""
    schemas = {function_of(t).get("name"): function_of(t).get("parameters") for t in tools}
    return lambda body: calls_of(body, schemas)


def calls_of(body: str, schemas: dict[Any, Any]) -> list[dict]:
    """Each ``<function=...>`` in ``body`` a call, as vLLM's grammar reads them: a function ends at its
    ``</function>`` (or the text's end), and another may follow in the same ``<tool_call>``, or after a
    ``<tool_call>`` opened again without the first closed."""
    calls: list[dict] = []
    at = 0
    while (fn := _FUNCTION.search(body, at)) is not None:
        close = body.find("</function>", fn.end())
        end = len(body) if close < 0 else close
        calls.append(call_of(body[:end], fn, schemas))
        at = end
    return calls


def call_of(body: str, fn: "re.Match[str]", schemas: dict[Any, Any]) -> dict:
    """The call ``fn`` opens, its parameters those in ``body`` after it (``body`` ends where the function does)."""
    name = fn.group(1).strip()
    schema = schemas.get(name)
    props = schema.get("properties") if isinstance(schema, dict) else None
    args: dict[str, Any] = {}
    at = fn.end()
    while (p := _PARAMETER.search(body, at)) is not None:
        ends = [i for i in (body.find(c, p.end()) for c in _CLOSES) if i >= 0]
        end = min(ends) if ends else len(body)
        key = p.group(1).strip()
        prop = props.get(key) if isinstance(props, dict) else None
        value = _unwrap(body[p.end():end])
        args[key] = typed(value, prop) if isinstance(prop, dict) else value
        at = end
    return _tool_call(name, args)


def _unwrap(value: str) -> str:
    """A value less the newline the template writes on each side."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def types_of(schema: dict) -> set[str]:
    """The JSON types a parameter's schema allows: its ``type`` (a name or a list), its ``enum`` values' types, and
    those of its ``anyOf`` / ``oneOf`` / ``allOf`` branches; a string where it says none."""
    out: set[str] = set()
    t = schema.get("type")
    out.update([t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else [])
    for v in schema.get("enum") or () if isinstance(schema.get("enum"), list) else ():
        out.add(_json_type(v))
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key) or () if isinstance(schema.get(key), list) else ():
            if isinstance(branch, dict):
                out |= types_of(branch)
    return out or {"string"}


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(v), "string")


# other names schemas give the types, as vLLM reads them
_ALIASES = {**dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
            **dict.fromkeys(("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"),
                            "integer"),
            **dict.fromkeys(("float", "float32", "float64", "double"), "number"), "bool": "boolean", "dict": "object",
            **dict.fromkeys(("arr", "list", "sequence"), "array")}


def typed(value: str, schema: dict) -> Any:
    """``value`` as the first of the schema's types (in ``_TYPES``' order) it reads as; else JSON, else the text."""
    types = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types_of(schema)}
    for t in _TYPES:
        if t not in types:
            continue
        got = _as(t, value)
        if got is not _NO:
            return got
    got = _json(value)
    return value if got is _NO else got


_NO = object()  # a value that does not read as the type


def _as(t: str, value: str) -> Any:
    if t == "string":
        return value
    if t == "null":
        return None if value.lower() == "null" else _NO
    if t == "integer":
        try:
            return int(value)
        except ValueError:
            return _NO
    if t == "number":
        try:
            f = float(value)
        except ValueError:
            return _NO
        return _NO if not math.isfinite(f) else int(f) if f == int(f) else f
    if t == "boolean":
        word = value.strip().lower()
        return True if word in ("true", "1") else False if word in ("false", "0") else _NO
    got = _json(value)  # object, array
    return got


def _json(value: str) -> Any:
    """``value`` as JSON, where it is JSON with no infinite or NaN number in it."""
    try:
        got = json.loads(value)
    except (ValueError, RecursionError):
        return _NO
    return got if _finite(got) else _NO


def _finite(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, list):
        return all(_finite(x) for x in v)
    if isinstance(v, dict):
        return all(_finite(x) for x in v.values())
    return True


def _string_only(prop: Any) -> bool:
    """Whether a parameter's value is given as its text whatever it is (``typed`` tries no other type first)."""
    if not isinstance(prop, dict):
        return True
    return {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types_of(prop)} == {"string"}


def args_so_far(body: str, fn: "re.Match[str]", schemas: dict[Any, Any], closed: bool) -> str:
    """The arguments of the call ``fn`` opens, as far as ``body`` (which ends where the function does, or where the
    text does) tells them for good, written as json.dumps writes the whole call's: each parameter whose value has
    ended, then a value still coming as its text where it stays a string whatever follows (vLLM's stream holds a
    value that typing may still change), less what may yet be its closing tag or the newline the template writes;
    whole (with its ``}``) where the function ``closed``."""
    schema = schemas.get(fn.group(1).strip())
    props = schema.get("properties") if isinstance(schema, dict) else None
    items: list[str] = []
    at = fn.end()
    while (p := _PARAMETER.search(body, at)) is not None:
        ends = [i for i in (body.find(c, p.end()) for c in _CLOSES) if i >= 0]
        key = p.group(1).strip()
        prop = props.get(key) if isinstance(props, dict) else None
        if not ends and not closed:  # its value still comes
            if _string_only(prop):
                value = body[p.end():]
                value = value[1:] if value.startswith("\n") else value
                value = value[:len(value) - max(tag_start(value, c) for c in _CLOSES)]
                value = value[:-1] if value.endswith("\n") else value
                items.append(json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)[:-1])
            break
        end = min(ends) if ends else len(body)
        value = _unwrap(body[p.end():end])
        got = typed(value, prop) if isinstance(prop, dict) else value
        items.append(json.dumps(key, ensure_ascii=False) + ": " + json.dumps(got, ensure_ascii=False))
        at = end
    return "{" + ", ".join(items) + ("}" if closed else "")


class Qwen3CoderStreamer(PieceStreamer):
    """``qwen3_coder`` streamed as vLLM 0.32 streams it: content up to a call's tags (text that may still begin one
    held back); each ``<function=NAME>`` opens a call once its ``>`` is written, and its arguments follow as
    ``args_so_far`` tells them, so the pieces join to the whole response's (json.dumps of the typed parameters). A
    tagged text that names no function is content, as whole; white space right after a call is none."""

    def __init__(self, tools: list[dict]):
        self.schemas = {function_of(t).get("name"): function_of(t).get("parameters") for t in tools}
        self.held = ""
        self.open: Optional[tuple[str, str, bool]] = None  # the tags of the text being read
        self.body = ""  # its text so far, between its tags
        self.pieces: list[CallPieces] = []  # its calls
        self.after = False
        self.calls = 0  # the calls opened so far

    def _feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        from pushkv.router.tool_calls import _until_any

        self.held += text
        content = ""
        pieces: list[dict] = []
        while True:
            if self.after:
                self.held = self.held.lstrip()
                if not self.held:
                    return content, pieces
                self.after = False
            if self.open is None:
                before, self.held, self.open = _until_any(self.held, TAGS, final)
                content += before
                if self.open is None:
                    return content, pieces
                self.body, self.pieces = "", []
            opening, closing, whole = self.open
            end = self.held.find(closing)
            upto = end if end >= 0 else len(self.held) - (0 if final else tag_start(self.held, closing))
            self.body += self.held[:upto]
            self.held = self.held[upto:]
            pieces += self._progress((opening if whole else "") + self.body)
            if end < 0 and not final:
                return content, pieces
            self.held = self.held[len(closing):] if end >= 0 else ""
            tagged = opening + self.body + (closing if end >= 0 else "")
            found = calls_of((tagged if whole else self.body).strip(), self.schemas)
            for i, call in enumerate(found):
                if i == len(self.pieces):
                    self.pieces.append(CallPieces(self.calls))
                    self.calls += 1
                pieces += self.pieces[i].finish(call)
            if not found:  # not a call after all: its text is content
                content += tagged
            self.open, self.after = None, bool(found)
            if end < 0:
                return content, pieces

    def _progress(self, body: str) -> list[dict]:
        """The pieces the text so far adds to each of its functions (as ``calls_of`` finds them)."""
        out: list[dict] = []
        at = i = 0
        while (fn := _FUNCTION.search(body, at)) is not None:
            close = body.find("</function>", fn.end())
            end = len(body) if close < 0 else close
            if i == len(self.pieces):
                self.pieces.append(CallPieces(self.calls))
                self.calls += 1
            call = self.pieces[i]
            args = args_so_far(body[:end], fn, self.schemas, close >= 0)
            out += call.more(args) if call.opened else call.open(fn.group(1).strip(), args)
            at, i = end, i + 1
        return out
