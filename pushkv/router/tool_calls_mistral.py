"""``--tool-call-parser mistral``'s calls streamed in pieces as they are written, as vLLM 0.32 streams them (the
whole response's reading, and the forms, are ``tool_calls.MistralStreamer``'s): a call opens with Mistral's
9-character id, its name and the arguments so far, and its arguments follow re-written as ``json.dumps`` writes them
(``tool_call_pieces``), so they join to the whole response's.

Pure: text in, content and call pieces out.
"""
from __future__ import annotations

import json
from typing import Optional

from pushkv.router.text import until_tag
from pushkv.router.tool_call_pieces import CallPieces, JsonCall, PieceStreamer, Rewriter
from pushkv.router.tool_calls import _NAME, ARGS, MARKER, _call_of, _mistral_id, _tool_call


class MistralStreamer(PieceStreamer):
    """``mistral``: content up to ``[TOOL_CALLS]``, then the calls in pieces as they are written, each with Mistral's
    9-character id: the newer form's ``name[ARGS]{...}`` (``name{...}``) opens once its name is followed by
    ``[ARGS]{`` or ``{``; the older form's JSON list opens each of its objects once its name is read. Text after a
    marker that opens no call is content, the marker kept, as whole; white space right after a call is none."""

    def __init__(self):
        self.held = ""
        self.mode = "text"  # text, head (right after the marker), args (the newer form's JSON), list, after
        self.body = ""  # the text taken since the marker (given back as content where it opened no call)
        self.before = 0  # the calls opened before this marker
        self.name = ""
        self.value = Rewriter()
        self.value_text = ""
        self.call = CallPieces(0)
        self.item: Optional[JsonCall] = None  # the older form's object being read
        self.calls = 0

    def _feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        self.held += text
        content = ""
        pieces: list[dict] = []
        while True:
            if self.mode == "after":
                self.held = self.held.lstrip()
                if not self.held:
                    return content, pieces
                self.mode = "text"
            if self.mode == "text":
                before, self.held, marked = until_tag(self.held, MARKER, final)
                content += before
                if not marked:
                    return content, pieces
                self.mode, self.body, self.before = "head", "", self.calls
            if self.mode == "head":
                head = self._head(final)
                if head == "wait":
                    return content, pieces
                if head == "none":
                    content += MARKER
                    self.mode = "text"
                    continue
            if not (self._args(pieces, final) if self.mode == "args" else self._list(pieces, final)):
                return content, pieces
            if self.calls == self.before:  # opened no call: its text is content
                content += MARKER
                self.held, self.mode = self.body + self.held, "text"
            else:
                self.mode = "after"

    def _head(self, final: bool) -> str:
        """Right after the marker: which form follows ("go", mode args or list), none ("none") or not yet known."""
        body = self.held.lstrip()
        wait = "none" if final else "wait"
        if not body:
            return wait
        skipped = len(self.held) - len(body)
        if body[0] == "[":
            self.body, self.held = self.held[:skipped + 1], body[1:]
            self.mode, self.item = "list", None
            return "go"
        name = _NAME.match(body)
        if name is None:
            return "none"
        rest = body[name.end():]
        if not rest.startswith(ARGS) and ARGS.startswith(rest):  # (the name, or [ARGS], may go on)
            return wait
        after = rest[len(ARGS):] if rest.startswith(ARGS) else rest
        if not after:
            return wait
        if after[0] != "{":
            return "none"
        cut = skipped + len(body) - len(after)
        self.body, self.held = self.held[:cut], self.held[cut:]
        self.name, self.value, self.value_text = name.group(), Rewriter(), ""
        self.mode, self.call = "args", CallPieces(self.calls, _mistral_id())
        return "go"

    def _args(self, pieces: list[dict], final: bool) -> bool:
        """The newer form's JSON, as far as it came: whether the call ended."""
        taken = 0
        while taken < len(self.held) and not self.value.done and self.value.feed(self.held[taken]):
            taken += 1
        self.value_text += self.held[:taken]
        self.body += self.held[:taken]
        self.held = self.held[taken:]
        if self.value.done or final:
            self.value.finish()
        pieces += self.call.more(self.value.out) if self.call.opened else self.call.open(self.name, self.value.out)
        self.calls = self.call.index + 1
        if not (self.value.done or final):
            return False
        try:
            whole: Optional[dict] = _tool_call(self.name, json.loads(self.value_text), self.call.call_id)
        except (ValueError, RecursionError):
            whole = None
        pieces += self.call.finish(whole)
        self.calls = self.call.index + self.call.opened
        return True

    def _list(self, pieces: list[dict], final: bool) -> bool:
        """The older form's list, as far as it came: whether it ended (closed, cut off, or not a list of calls)."""
        while self.held:
            if self.item is None:
                ch = self.held[0]
                if ch.isspace() or (ch in ",]" and self.calls > self.before):
                    self.body, self.held = self.body + ch, self.held[1:]
                    if ch == "]":
                        return True
                    continue
                self.item = JsonCall(self.calls, _mistral_id())
            item = self.item
            taken = len(item.text)
            pieces += item.feed(self.held)
            self.body += item.text[taken:]
            self.held = self.held[len(item.text) - taken:]
            self.calls = item.index + item.opened
            if item.scan.bad or (item.scan.closed and item.scan.name is None):
                return True  # not a list of calls: what it opened stays, the rest is the text's
            if not item.scan.closed:
                break
            try:
                whole = _call_of(json.loads(item.text), item.call_id)
            except (ValueError, RecursionError):
                whole = None
            pieces += item.finish(whole)
            self.item = None
        return final
