"""tool_choice ``auto``'s calls streamed as they are written, as vLLM 0.32's parsers stream them: a call opens, once its
name is read, with its ``id``, ``type``, ``name`` and the arguments written so far (often ""), and each later piece
carries its arguments' next text (``{"index": i, "function": {"arguments": ...}}``).

The arguments go out re-written as ``json.dumps`` writes them (``Rewriter``: ", " and ": " between items, no other white
space, strings' escapes as json.dumps escapes them, numbers as Python reads and writes them), so the pieces join to
the whole response's arguments, which are ``json.dumps`` of the parsed call, whatever layout the model wrote (vLLM's
llama3_json and qwen3_coder streams write them so; its hermes stream sends the text as written, equal where the model
writes json.dumps' layout, as the templates teach it). Where a number, ``true``/``false``/``null`` or an escape is
cut between pieces it goes out once whole.

- ``HermesStreamer``: content up to ``<tool_call>`` (text that may still begin it held back), each call's JSON read
  as it comes until ``</tool_call>`` (or the output's end).
- ``Llama3JsonStreamer``: output that begins with ``{`` is calls, one JSON object each, separated by ``;``.
- ``tool_calls_mistral.MistralStreamer`` builds on these: content up to ``[TOOL_CALLS]``, then ``name[ARGS]{...}`` or
  a JSON list of calls, each call with Mistral's 9-character id.

A call is opened once its name is read; if its JSON then breaks (cut off, or not JSON after all), the stream has
given it, as vLLM's stream has, while a whole response gives the text as content (``tool_calls.parse``). Text that
opens no call is content, as the whole response has it.

Pure: text in, content and call pieces out.
"""
from __future__ import annotations

import json
from typing import Optional

from pushkv.router.text import tag_start, until_tag
from pushkv.router.tool_calls import END, START, _call, _tool_call


def _escaped(ch: str) -> str:
    """One character inside a JSON string as json.dumps (ensure_ascii false) writes it."""
    return json.dumps(ch, ensure_ascii=False)[1:-1]


_ENDS_SCALAR = frozenset(',:{}[]"')


class Rewriter:
    """One JSON value, fed a character at a time, written out (``out``) as ``json.dumps(json.loads(value),
    ensure_ascii=False)`` writes it, as far as it has come. A string value (a call's arguments given as a string,
    a key, a name) is given as its text (``as_text``), as the whole response keeps it."""

    def __init__(self):
        self.out = ""
        self.depth = 0
        self.started = self.done = self.in_string = self.as_text = False
        self.escape = ""  # a string's escape, held until whole (a high surrogate's until its low one may follow)
        self.scalar = ""  # a number, true, false or null, held until it ends

    def feed(self, ch: str) -> bool:
        """Take ``ch``; False where the value had ended before it (``ch`` is what follows the value)."""
        if self.done:
            return False
        if self.in_string:
            self._string(ch)
            return True
        if self.scalar:
            if not (ch.isspace() or ch in _ENDS_SCALAR):
                self.scalar += ch
                return True
            self.finish()
            if self.depth == 0:
                self.done = True
                return False
        if ch.isspace():
            return True
        if not self.started:
            self.started = True
            if ch == '"':  # a string value: its text
                self.in_string = self.as_text = True
                return True
        if ch in "}],":
            if self.depth == 0:  # (the enclosing object's)
                self.done = True
                return False
            if ch == ",":
                self.out += ", "
            else:
                self.depth -= 1
                self.out += ch
                self.done = self.depth == 0
        elif ch in "{[":
            self.depth += 1
            self.out += ch
        elif ch == '"':
            self.in_string = True
            self.out += ch
        elif ch == ":":
            self.out += ": "
        else:
            self.scalar = ch
        return True

    def finish(self) -> None:
        """The held scalar written, as json.dumps writes it (as written where it is not one: no whole reads it)."""
        if self.scalar:
            try:
                self.out += json.dumps(json.loads(self.scalar))
            except (ValueError, RecursionError):
                self.out += self.scalar
            self.scalar = ""

    def _string(self, ch: str) -> None:
        if self.escape:
            self.escape += ch
            self._resolve()
        elif ch == "\\":
            self.escape = ch
        elif ch == '"':
            self.in_string = False
            self.out += "" if self.as_text else ch
            self.done = self.depth == 0
        else:
            self._put(ch)

    def _put(self, text: str) -> None:
        self.out += text if self.as_text else "".join(_escaped(c) for c in text)

    def _resolve(self) -> None:
        """The held escape written once whole: ``\\x`` at once, ``\\uXXXX`` after its 4 digits, and a high surrogate's
        only once the next escape says whether it is its low one (json.loads makes the two one character)."""
        e = self.escape
        if e[1] != "u":
            return self._decode(e)
        if len(e) < 6:
            return None
        if len(e) == 6:
            return None if _surrogate(e[2:6], 0xD800) else self._decode(e)
        if (len(e) == 7 and e[6] != "\\") or (len(e) == 8 and e[7] != "u") or (len(e) == 12 and not _surrogate(
                e[8:12], 0xDC00)):
            self._decode(e[:6])  # a lone high surrogate; what followed it is read again
            for c in e[6:]:
                self._string(c)
        elif len(e) == 12:
            self._decode(e)
        return None

    def _decode(self, e: str) -> None:
        self.escape = ""
        try:
            self._put(json.loads('"' + e + '"'))
        except (ValueError, RecursionError):
            self.out += e  # not an escape: no whole reads it either


def _surrogate(digits: str, low: int) -> bool:
    """Whether 4 hex digits are a surrogate of the half that begins at ``low``."""
    try:
        return low <= int(digits, 16) < low + 0x400
    except ValueError:
        return False


class CallScan:
    """A call's JSON object, ``{"name": ..., "arguments": ...}`` (or ``"parameters"``), fed a character at a time:
    its ``name`` once its string closed, its arguments re-written as they come (``args``; the first of the two keys
    to come), ``closed`` once the object closed, ``bad`` where it is not an object of keys and values."""

    def __init__(self):
        self.expect = "open"  # open, key, colon, value, after (a value's end)
        self.part: Optional[Rewriter] = None  # the key or value being read
        self.key: Optional[str] = None
        self.name: Optional[str] = None
        self.args: Optional[Rewriter] = None
        self.closed = self.bad = False

    def feed(self, ch: str) -> bool:
        """Take ``ch``; False where the object had closed before it, or went bad."""
        if self.closed or self.bad:
            return False
        if self.part is not None:
            took = self.part.feed(ch)
            if self.part.done or not took:
                self._ended(self.part)
            if took:
                return True
        if ch.isspace():
            return True
        expect = self.expect
        if expect == "open" and ch == "{":
            self.expect = "key"
        elif expect == "key" and ch == '"':
            self.key = None
            self._begin(ch)
        elif (expect == "key" and ch == "}" and self.key is None) or (expect == "after" and ch == "}"):
            self.closed = True
        elif expect == "colon" and ch == ":":
            self.expect = "value"
        elif expect == "value" and ch not in "}],:":
            self._begin(ch)
            if self.key in ("arguments", "parameters") and self.args is None:
                self.args = self.part
        elif expect == "after" and ch == ",":
            self.expect = "key"
        else:
            self.bad = True
            return False
        return True

    def _begin(self, ch: str) -> None:
        self.part = Rewriter()
        self.part.feed(ch)

    def _ended(self, part: Rewriter) -> None:
        self.part = None
        if self.expect == "key":
            self.key, self.expect = part.out, "colon"
            return
        part.finish()
        if self.key == "name" and part.as_text and not part.in_string and self.name is None:
            self.name = part.out
        self.expect = "after"


class CallPieces:
    """One call as a stream gives it: opened (``id``, ``type``, ``name``, the arguments so far) once its name is read,
    then each new piece of its arguments (those that extend what was sent)."""

    def __init__(self, index: int, call_id: str = ""):
        self.index = index
        self.call_id = call_id  # "": vLLM's kind
        self.opened = False
        self.sent = ""  # its arguments sent so far

    def open(self, name: str, args: str) -> list[dict]:
        self.opened, self.sent = True, args
        return [dict(_tool_call(name, args, self.call_id), index=self.index)]

    def more(self, args: str) -> list[dict]:
        """The piece that ``args`` (the arguments as far as they are known) adds to those sent."""
        if len(args) <= len(self.sent) or not args.startswith(self.sent):
            return []
        piece, self.sent = args[len(self.sent):], args
        return [{"index": self.index, "function": {"arguments": piece}}]

    def finish(self, whole: Optional[dict]) -> list[dict]:
        """The call's end, ``whole`` as a whole response reads it (None: not a call): what it adds to the pieces sent
        (where nothing opened it, the whole call)."""
        if whole is None:
            return []
        if not self.opened:
            self.opened, self.sent = True, whole["function"]["arguments"]
            return [dict(whole, id=self.call_id or whole["id"], index=self.index)]
        return self.more(whole["function"]["arguments"])


class JsonCall(CallPieces):
    """A call written as JSON, read with ``CallScan``."""

    def __init__(self, index: int, call_id: str = ""):
        super().__init__(index, call_id)
        self.scan = CallScan()
        self.text = ""  # the call's JSON as written, as far as the scan took it

    def feed(self, text: str) -> list[dict]:
        """The pieces ``text`` adds; the scan takes it up to where the object closed (or went bad)."""
        for i, ch in enumerate(text):
            if not self.scan.feed(ch):
                text = text[:i]
                break
        self.text += text
        args = self.scan.args.out if self.scan.args is not None else ""
        if not self.opened:
            return [] if self.scan.name is None or self.scan.bad else self.open(self.scan.name, args)
        return self.more(args)


def merged(pieces: list[dict]) -> list[dict]:
    """One entry a call in a delta: a call's pieces that came in one feed joined (its opening's arguments too)."""
    out: list[dict] = []
    for p in pieces:
        if out and out[-1]["index"] == p["index"] and "id" not in p:
            last = out[-1]
            out[-1] = dict(last, function=dict(last["function"], arguments=last["function"]["arguments"]
                                                + p["function"]["arguments"]))
        else:
            out.append(p)
    return out


class PieceStreamer:
    """A parser's stream: ``feed`` gives the content and the calls' pieces of a delta, each call's pieces of one
    delta joined into one entry (``merged``); a streamer reads its text in ``_feed``."""

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        content, pieces = self._feed(text, final)
        return content, merged(pieces)

    def _feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        raise NotImplementedError


class HermesStreamer(PieceStreamer):
    """``hermes``: content up to ``<tool_call>``, then the call's pieces as its JSON is written, up to ``</tool_call>``
    (or the output's end); a tagged text that opens no call and is none is content, as whole; white space right
    after a call is none."""

    def __init__(self):
        self.held = ""
        self.mode = "text"  # text, call (inside the tags), after (right after a call)
        self.call = JsonCall(0)
        self.body = ""  # the open call's text between its tags so far
        self.calls = 0  # the calls opened so far

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
                before, self.held, tagged = until_tag(self.held, START, final)
                content += before
                if not tagged:
                    return content, pieces
                self.mode, self.call, self.body = "call", JsonCall(self.calls), ""
            end = self.held.find(END)
            upto = end if end >= 0 else len(self.held) - (0 if final else tag_start(self.held, END))
            self.body += self.held[:upto]
            pieces += self.call.feed(self.held[:upto])
            self.held = self.held[upto:]
            if end < 0 and not final:
                self.calls = self.call.index + self.call.opened
                return content, pieces
            self.held = self.held[len(END):] if end >= 0 else ""
            pieces += self.call.finish(_call(self.body.strip()))
            self.calls = self.call.index + self.call.opened
            if not self.call.opened:  # not a call after all: its text is content
                content += START + self.body + (END if end >= 0 else "")
            self.mode = "after" if self.call.opened else "text"
            if end < 0:
                return content, pieces


class Llama3JsonStreamer(PieceStreamer):
    """``llama3_json``: output that begins with ``{`` is calls, each JSON object's pieces as it is written, the
    objects separated by ``;`` and white space. Where the output ends, or an object closes, without a call opened,
    it is content from there on (all of it where no call opened, as whole)."""

    def __init__(self):
        self.text = ""
        self.at = 0  # how far the text was read
        self.json: Optional[bool] = None  # whether the output is calls; None: not known yet
        self.call: Optional[JsonCall] = None
        self.start = 0  # where the open call's object began
        self.calls = 0

    def _feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        self.text += text
        if self.json is None:
            if not self.text.strip() and not final:
                return "", []
            self.json = self.text.lstrip().startswith("{")
            if not self.json:
                return self.text, []
        elif not self.json:
            return text, []
        pieces: list[dict] = []
        while self.at < len(self.text):
            if self.call is None:
                if self.text[self.at].isspace() or self.text[self.at] == ";":
                    self.at += 1
                    continue
                self.call, self.start = JsonCall(self.calls), self.at
            call = self.call
            taken = len(call.text)
            pieces += call.feed(self.text[self.at:])
            self.at += len(call.text) - taken
            self.calls = call.index + call.opened
            if not (call.scan.closed or call.scan.bad):
                break  # it took all there is
            if not self._ended(pieces):
                return self._content(pieces)
        if final and self.call is not None and not self._ended(pieces):
            return self._content(pieces)
        if final and not self.calls:
            return self._content(pieces)
        return "", pieces

    def _ended(self, pieces: list[dict]) -> bool:
        """The open object's end: whether it was a call."""
        call, self.call = self.call, None
        assert call is not None
        pieces += call.finish(_call(call.text))
        self.calls = call.index + call.opened
        return call.opened

    def _content(self, pieces: list[dict]) -> tuple[str, list[dict]]:
        """What follows the calls (all the output, where none opened) is content."""
        self.json = False
        return (self.text if not self.calls else self.text[self.start:]), pieces
