"""Tool calls parsed out of a chat choice's content, as vLLM's ``--enable-auto-tool-choice --tool-call-parser``
gives them, each becoming an OpenAI ``tool_calls`` entry (``arguments`` a JSON string) and the choice's
``finish_reason`` ``tool_calls``:

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more;
  the text outside them stays ``content``, and a call that is not JSON naming a function stays in it as text.
  Streamed, content goes out as it comes, text that may still begin ``<tool_call>`` is held back, and each call
  goes out whole as its closing tag arrives (a call cut off by ``max_tokens`` with the last delta).
- ``llama3_json`` (Llama 3.1-3.3): an output that is JSON, ``{"name": ..., "parameters": {...}}``, one or more
  separated by ``;`` (Llama 3's ``<|python_tag|>`` is a special token the text leaves out). Output that does not
  begin with ``{``, or does not parse as calls, is content. Streamed, output that begins with ``{`` is held back
  and goes out with the last delta, as calls or as content.

Pure: text in, content and calls out.
"""
from __future__ import annotations

import json
import uuid
from typing import Optional

from pushkv.router.text import tag_start

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("hermes", "llama3_json")


def _call(body: str) -> Optional[dict]:
    """One call's JSON as an OpenAI tool call, or None if it is not a function's name and arguments."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return _call_of(obj)


def _call_of(obj) -> Optional[dict]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str)
                         else json.dumps(args, ensure_ascii=False)}}


def streamer(parser: str) -> "Streamer | Llama3JsonStreamer":
    """A choice's streamer for ``parser`` (one of PARSERS)."""
    if parser not in PARSERS:
        raise ValueError(f"tool call parser {parser!r} is not one of {PARSERS}")
    return Streamer() if parser == "hermes" else Llama3JsonStreamer()


def parse(text: str, parser: str = "hermes") -> tuple[Optional[str], list[dict]]:
    """A whole content's (its text outside the calls, or None where empty; the calls): what a stream of it gives."""
    content, calls = streamer(parser).feed(text, final=True)
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
        except ValueError:
            return None
        call = _call_of(obj)
        if call is None:
            return None
        calls.append(call)


class Streamer:
    """One choice's content, fed as it comes: each piece's (content delta, calls completed). Text outside the calls
    is content (white space right after a call aside); a call that does not parse is content too."""

    def __init__(self):
        self.held = ""
        self.in_call = False
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
            if not self.in_call:
                at = self.held.find(START)
                if at < 0:
                    keep = 0 if final else tag_start(self.held, START)
                    content += self.held[:len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep:]
                    return content, calls
                content += self.held[:at]
                self.held, self.in_call = self.held[at + len(START):], True
            end = self.held.find(END)
            if end < 0 and not final:
                return content, calls  # the call goes out whole
            body, self.held = (self.held, "") if end < 0 else (self.held[:end], self.held[end + len(END):])
            call = _call(body.strip())
            if call is not None:
                calls.append(dict(call, index=self.calls))
                self.calls += 1
                self.after_call = True
            else:  # not a call after all: its text is content
                content += START + body + ("" if end < 0 else END)
            self.in_call = False
            if end < 0:
                return content, calls
