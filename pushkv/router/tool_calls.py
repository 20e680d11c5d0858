"""Tool calls parsed out of a chat choice's content, as vLLM's ``--enable-auto-tool-choice --tool-call-parser``
gives them, each becoming an OpenAI ``tool_calls`` entry (``arguments`` a JSON string) and the choice's
``finish_reason`` ``tool_calls``:

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more;
  the text outside them stays ``content``, and a call that is not JSON naming a function stays in it as text.
  Streamed, content goes out as it comes, text that may still begin ``<tool_call>`` is held back, and each call
  in pieces as it is written (``tool_call_pieces``).
- ``llama3_json`` (Llama 3.1-3.3): an output that is JSON, ``{"name": ..., "parameters": {...}}``, one or more
  separated by ``;`` (Llama 3's ``<|python_tag|>`` is a special token the text leaves out). Output that does not
  begin with ``{``, or does not parse as calls, is content. Streamed, each call in pieces as it is written
  (``tool_call_pieces``); output that opens no call goes out as content where that is known.
- ``mistral`` (Mistral, Mixtral, Ministral, Devstral, Magistral): ``[TOOL_CALLS]`` and then, in the older form,
  a JSON list ``[{"name": ..., "arguments": {...}}, ...]``, or in the newer one (Mistral's v11 tokenizers on)
  ``name[ARGS]{...}`` (``name{...}`` where ``[ARGS]`` is left out), one ``[TOOL_CALLS]`` to a call. The text
  before and after the calls is content (vLLM drops what follows them), and so is a call that does not parse, its
  ``[TOOL_CALLS]`` kept. Each call's id is 9 letters and digits: Mistral's templates refuse any other in the
  conversation that follows. ``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens: a request this parser reads keeps
  special tokens in its text (``KEEPS_SPECIAL_TOKENS``, as vLLM does), and output without ``[TOOL_CALLS]`` is
  content, as vLLM's. Streamed, content goes out as it comes, text that may still begin ``[TOOL_CALLS]`` is held
  back, and each call in pieces as it is written (``tool_call_pieces``).
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): hermes' tags around XML-ish calls, ``<tool_call><function=NAME>
  <parameter=KEY>VALUE</parameter>...</function></tool_call>`` (``tool_calls_qwen3.py``), each call streamed in pieces
  as it is written.
- ``pythonic`` (Llama 3.2, Llama 4, ToolACE): an output that is a Python list of calls, ``[get_weather(city=
  "Paris"), f(x=1)]``, read with :mod:`ast` (never run): each call a plain name with keyword arguments whose
  values are literals JSON can hold (strings, numbers, booleans, None, lists, tuples, dicts with string keys).
  Anything else, a call with a variable, an expression or a positional argument among them, is content, all of
  it. Streamed, output that begins ``[name(`` is held back and goes out with the last delta, as calls or as
  content; output that cannot begin so streams as content.

A forced tool choice (``required``, or a named function) is ``tool_choice``'s: its output is the calls' JSON.

Pure: text in, content and calls out.
"""
from __future__ import annotations

import ast
import json
import math
import random
import re
import string
import uuid
from typing import Any, Callable, Literal, Optional, Protocol

from pushkv.router.text import tag_start, until_tag

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")


class CallStreamer(Protocol):
    """One choice's content, fed as it comes: each piece's (content delta, calls, each with its ``index``: hermes',
    llama3_json's, qwen3_coder's, mistral's and a forced tool choice's in pieces, pythonic's whole as each is
    completed, a call's first with its ``id``);
    ``final``: nothing follows, so nothing is held back."""

    calls: int  # the calls made (opened) so far

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]: ...


def _call(body: str) -> Optional[dict]:
    """One call's JSON as an OpenAI tool call, or None if it is not a function's name and arguments."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: JSON nested past the decoder's depth
        return None
    return _call_of(obj)


def _hermes_calls(body: str) -> list[dict]:
    """hermes' ``<tool_call>`` body: its one call, or none where it is not one."""
    call = _call(body)
    return [] if call is None else [call]


def _call_of(obj, call_id: str = "") -> Optional[dict]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return _tool_call(obj["name"], obj.get("arguments", obj.get("parameters", {})), call_id)


def _tool_call(name: str, args: Any, call_id: str = "") -> dict:
    """An OpenAI tool call (``arguments`` a JSON string; one given as a string stays as it is); its id as vLLM's
    (``chatcmpl-tool-`` and a uuid) unless given."""
    return {"id": call_id or f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str)
                         else json.dumps(args, ensure_ascii=False)}}


def function_of(tool: dict) -> dict:
    """A request's tool's ``function`` object ({} where it has none)."""
    return tool.get("function") or {}




def streamer(parser: str, tools: Optional[list[dict]] = None) -> CallStreamer:
    """A choice's streamer for ``parser`` (one of PARSERS, or a forced choice: ``tool_choice.REQUIRED``,
    ``tool_choice.NAMED`` + a name); ``tools``:
    the request's, whose parameter schemas type qwen3_coder's arguments. hermes', llama3_json's, mistral's and
    qwen3_coder's calls come in pieces as they are written (``tool_call_pieces``, ``tool_calls_qwen3``,
    ``tool_calls_mistral``), pythonic's each whole."""
    if parser in ("hermes", "llama3_json"):
        from pushkv.router import tool_call_pieces  # (it builds on this module's readers)

        return (tool_call_pieces.HermesStreamer if parser == "hermes" else tool_call_pieces.Llama3JsonStreamer)()
    if parser == "mistral":
        from pushkv.router import tool_calls_mistral

        return tool_calls_mistral.MistralStreamer()
    if parser == "qwen3_coder":
        from pushkv.router import tool_calls_qwen3

        return tool_calls_qwen3.Qwen3CoderStreamer(tools or [])
    return _whole_streamer(parser, tools)


def _whole_streamer(parser: str, tools: Optional[list[dict]] = None) -> CallStreamer:
    """A streamer that gives each call whole (what ``parse`` reads a whole content with)."""
    from pushkv.router import tool_choice  # (it builds on this module's readers)

    if tool_choice.forced(parser):
        return tool_choice.streamer(parser)
    if parser == "qwen3_coder":
        from pushkv.router import tool_calls_qwen3  # (it builds on this module's Streamer)

        return Streamer(tool_calls_qwen3.reader(tools or []), tool_calls_qwen3.TAGS)
    kinds: dict[str, type[CallStreamer]] = {"hermes": Streamer, "llama3_json": Llama3JsonStreamer,
                                            "mistral": MistralStreamer, "pythonic": PythonicStreamer}
    if parser not in kinds:
        raise ValueError(f"tool call parser {parser!r} is not one of {PARSERS}")
    return kinds[parser]()


def parse(text: str, parser: str = "hermes", tools: Optional[list[dict]] = None) -> tuple[Optional[str], list[dict]]:
    """A whole content's (its text outside the calls, or None where empty; the calls): what a stream of it gives."""
    from pushkv.router import tool_choice

    if tool_choice.forced(parser):  # (its stream's deltas are the call's pieces; a whole response reads it whole)
        return None, tool_choice.forced_calls(text, parser)
    content, calls = _whole_streamer(parser, tools).feed(text, final=True)
    return content or None, [{k: v for k, v in c.items() if k != "index"} for c in calls]


class Llama3JsonStreamer:
    """``llama3_json``: output that begins with ``{`` is held to its end and parsed as calls there."""

    def __init__(self):
        self.held = ""
        self.json: Optional[bool] = None  # whether the output begins with "{"; None: not known yet
        self.calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.held += text
        if self.json is None:
            if not self.held.strip() and not final:
                return "", []
            self.json = self.held.lstrip().startswith("{")
        if not self.json or final:
            calls = _json_calls(self.held) if self.json else None
            held, self.held = self.held, ""
            if calls is None:
                return held, []
            self.calls = len(calls)
            return "", [dict(c, index=i) for i, c in enumerate(calls)]
        return "", []


def _json_calls(text: str) -> Optional[list[dict]]:
    """JSON objects separated by ``;`` and white space, each a call; None where the text is anything else."""
    decoder, at = json.JSONDecoder(), 0
    calls: list[dict] = []
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return calls or None
        try:
            obj, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        call = _call_of(obj)
        if call is None:
            return None
        calls.append(call)


Tags = tuple[str, str, bool]  # a call's opening and closing tags, and whether its reader is given them too


class Streamer:
    """One choice's content, fed as it comes: each piece's (content delta, calls completed). Text outside the calls
    is content (white space right after a call aside); a call that does not parse is content too. ``calls_of``
    reads the calls of one tagged text, between the first of ``tags`` to open it and its closing tag (hermes': one
    call's JSON in ``<tool_call>``; qwen3_coder's: ``tool_calls_qwen3``, which may find several), [] where it holds
    none."""

    def __init__(self, calls_of: Callable[[str], list[dict]] = _hermes_calls,
                 tags: tuple[Tags, ...] = ((START, END, False),)):
        self.calls_of = calls_of
        self.tags = tags
        self.held = ""
        self.open: Optional[Tags] = None  # the tags of the call being read
        self.after_call = False  # white space here separates calls
        self.calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.held += text
        content = ""
        calls: list[dict] = []
        while True:
            if self.after_call:
                self.held = self.held.lstrip()
                if not self.held:
                    return content, calls
                self.after_call = False
            if self.open is None:
                before, self.held, self.open = _until_any(self.held, self.tags, final)
                content += before
                if self.open is None:
                    return content, calls
            opening, closing, whole = self.open
            end = self.held.find(closing)
            if end < 0 and not final:
                return content, calls  # the call goes out whole
            body, self.held = (self.held, "") if end < 0 else (self.held[:end], self.held[end + len(closing):])
            tagged = opening + body + ("" if end < 0 else closing)
            found = self.calls_of((tagged if whole else body).strip())
            for call in found:
                calls.append(dict(call, index=self.calls))
                self.calls += 1
            if found:
                self.after_call = True
            else:  # not a call after all: its text is content
                content += tagged
            self.open = None
            if end < 0:
                return content, calls


def _until_any(held: str, tags: tuple[Tags, ...], final: bool) -> tuple[str, str, Optional[Tags]]:
    """``text.until_tag`` for the first of several opening tags to come: (before it, after it, its tags), or (what can
    no longer begin one, what still may, held back unless ``final``, None)."""
    found = [(at, t) for t in tags if (at := held.find(t[0])) >= 0]
    if found:
        at, t = min(found, key=lambda f: f[0])
        return held[:at], held[at + len(t[0]):], t
    cut = len(held) - (0 if final else max(tag_start(held, t[0]) for t in tags))
    return held[:cut], held[cut:], None


MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
# the parsers whose markers are special tokens: a request they read keeps special tokens in its text (vLLM's
# skip_special_tokens false), the ids that end it aside
KEEPS_SPECIAL_TOKENS = ("mistral",)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_ALPHANUMERIC = string.ascii_letters + string.digits


def _mistral_id() -> str:
    """Mistral's tool call id: 9 letters and digits (mistral_common refuses any other)."""
    return "".join(random.choices(_ALPHANUMERIC, k=9))


class MistralStreamer:
    """``mistral``: content up to ``[TOOL_CALLS]``, then each call whole as its JSON ends (what a whole response reads
    the content with; a stream's calls come in pieces: ``tool_calls_mistral.MistralStreamer``)."""

    def __init__(self):
        self.held = ""
        # slot: right after a call, where white space is no content; text: content, up to a marker; call: a call's
        # text, after its marker
        self.mode: Literal["slot", "text", "call"] = "text"
        self.scan = _JsonScan()  # the call's JSON, scanned as it comes
        self.calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.held += text
        content = ""
        calls: list[dict] = []
        while True:
            if self.mode == "slot":
                self.held = self.held.lstrip()
                if not self.held and not final:
                    return content, calls
                self.mode = "text"
            if self.mode == "text":
                before, self.held, marked = until_tag(self.held, MARKER, final)
                content += before
                if not marked:
                    return content, calls
                self.scan, self.mode = _JsonScan(), "call"
            made, end = _mistral_calls(self.held, final, self.scan)
            if made == []:  # more text may still make it a call
                return content, calls
            if made is None:  # not a call after all: its text is content
                content += MARKER
                self.mode = "text"
                continue
            calls += [dict(c, index=self.calls + i) for i, c in enumerate(made)]
            self.calls += len(made)
            self.held, self.mode = self.held[end:], "slot"


def _mistral_calls(text: str, final: bool, scan: _JsonScan) -> tuple[Optional[list[dict]], int]:
    """The calls that begin ``text`` (one call's text, after its marker) and where they end: ([], 0)
    while more text may still make them, (None, 0) where they are not calls. ``scan``: the call's JSON as scanned
    so far (``text`` is what it was, and more)."""
    wait: tuple[Optional[list[dict]], int] = (None, 0) if final else ([], 0)
    body = text.lstrip()
    at = len(text) - len(body)
    if not body:
        return wait
    if body[0] == "[":  # the older form: a JSON list of calls
        value, end = _json_at(text, at, final, scan)
        if value is _MORE:
            return wait
        listed = [_call_of(v, _mistral_id()) for v in value] if isinstance(value, list) else []
        made = [c for c in listed if c is not None]
        return (made, end) if made and len(made) == len(listed) else (None, 0)
    name = _NAME.match(text, at)  # the newer form: name[ARGS]{...}
    if name is None:
        return None, 0
    at = name.end()
    if text.startswith(ARGS, at):
        at += len(ARGS)
    elif ARGS.startswith(text[at:]):
        return wait
    if at == len(text):
        return wait
    if text[at] != "{":
        return None, 0
    value, end = _json_at(text, at, final, scan)
    return wait if value is _MORE else ([_tool_call(name.group(), value, _mistral_id())], end)


_MORE = object()  # a JSON value not yet whole


def _json_at(text: str, at: int, final: bool, scan: _JsonScan) -> tuple[Any, int]:
    """The JSON value at ``text[at]`` and where it ends, or (_MORE, 0) where it is not whole (nor ever will be,
    where ``final``). Before the end, decoded only once ``scan`` finds its brackets closed."""
    if not final and not scan.closed(text, at):
        return _MORE, 0
    try:
        return json.JSONDecoder().raw_decode(text, at)
    except (ValueError, RecursionError):
        scan.bad = True  # closed and still not JSON: it never will be
        return _MORE, 0


class _JsonScan:
    """Whether a JSON value's brackets have closed, found as its text comes (brackets counted outside strings), so
    that a long call is read once rather than decoded again at each piece."""

    def __init__(self):
        self.at = -1  # how far the text was scanned; -1: not begun
        self.depth = 0
        self.in_string = self.escaped = self.bad = False
        self.ended = False

    def closed(self, text: str, start: int) -> bool:
        """Whether the value at ``text[start]`` (``text`` being what it was at the last call, and more) closed."""
        if self.bad:
            return False
        if self.at < 0:
            self.at = start
        while not self.ended and self.at < len(text):
            ch = text[self.at]
            self.at += 1
            if self.in_string:
                self.in_string = self.escaped or ch != '"'
                self.escaped = not self.escaped and ch == "\\"
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                self.ended = self.depth <= 0
        return self.ended


_PY_CALLS = re.compile(r"\s*\[\s*[A-Za-z_]\w*\s*\(")  # how a pythonic output of calls begins
_PY_MAYBE = re.compile(r"\s*(?:\[\s*(?:[A-Za-z_]\w*\s*)?)?")  # what may still begin so


class PythonicStreamer:
    """``pythonic``: output that begins ``[name(`` is held to its end and read as a Python list of calls there."""

    def __init__(self):
        self.held = ""
        self.listed: Optional[bool] = None  # whether the output begins as a list of calls; None: not known yet
        self.calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.held += text
        if self.listed is None:
            if _PY_MAYBE.fullmatch(self.held) and not final:
                return "", []
            self.listed = _PY_CALLS.match(self.held) is not None
        if self.listed and not final:
            return "", []
        calls = _pythonic_calls(self.held) if self.listed else None
        held, self.held = self.held, ""
        if calls is None:
            return held, []
        self.calls = len(calls)
        return "", [dict(c, index=i) for i, c in enumerate(calls)]


def _pythonic_calls(text: str) -> Optional[list[dict]]:
    """A Python list of calls with literal keyword arguments, as OpenAI tool calls; None where the text is anything
    else. Parsed, never run."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(kw.arg is not None for kw in node.keywords)):  # kw.arg None: **spread
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            if not _json_literal(args):
                return None
            calls.append(_tool_call(node.func.id, args))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None  # not a literal (a name, a call, an expression), or nested past the recursion limit
    return calls


def _json_literal(value: Any) -> bool:
    """Whether a Python literal is one JSON holds as it is: no sets, bytes, complex numbers, inf or NaN, and only
    string keys."""
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_json_literal(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_literal(v) for k, v in value.items())
    return False
