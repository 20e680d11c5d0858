"""Tool calls parsed out of a chat choice's content, as vLLM's ``--enable-auto-tool-choice --tool-call-parser
hermes`` gives them: the Hermes format Qwen2.5, Qwen3 and Hermes models write,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more, each becoming an OpenAI ``tool_calls``
entry (``arguments`` a JSON string) and the choice's ``finish_reason`` ``tool_calls``; the text before the first
call stays ``content``. A call that is not JSON naming a function leaves the whole text as content, as vLLM does.

Streamed, the content before a call goes out as it comes, text that may still begin ``<tool_call>`` is held back,
and each call goes out whole as its closing tag arrives (a call cut off by ``max_tokens`` with the last delta).
Pure: text in, content and calls out.
"""
from __future__ import annotations

import json
import uuid
from typing import Optional

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)


def _call(body: str) -> Optional[dict]:
    """One call's JSON as an OpenAI tool call, or None if it is not a function's name and arguments."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str)
                         else json.dumps(args, ensure_ascii=False)}}


def parse(text: str) -> tuple[Optional[str], list[dict]]:
    """A whole content's (its text outside the calls, or None where empty; the calls): what a stream of it gives."""
    content, calls = Streamer().feed(text, final=True)
    return content or None, [{k: v for k, v in c.items() if k != "index"} for c in calls]


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
                    keep = 0 if final else _tag_prefix(self.held, START)
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


def _tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
