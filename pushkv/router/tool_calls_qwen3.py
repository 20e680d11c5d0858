"""``--tool-call-parser qwen3_coder`` (Qwen3-Coder, Qwen3.5): the calls a choice writes in Qwen3-Coder's XML-ish
format, inside hermes' ``<tool_call>`` tags (``tool_calls.Streamer`` finds those and streams each call whole as its
closing tag arrives)::

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

Pure: text in, calls out.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

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
