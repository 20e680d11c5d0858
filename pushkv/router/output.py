"""What a client sees of one choice: text held back until it is whole, stop strings,
token ids and logprobs as they come (pure, no I/O); the OpenAI shapes they go out in are
``render.py``'s, one renderer per endpoint.

Text is released only when it can no longer change: a character split across
tokens waits for its last byte (``text.IncrementalDecoder``), and text that
could be the start of a stop string waits until it is not. Streaming and
non-streaming go through the same ``ChoiceOutput``, so they return the same text.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from pushkv.messages import PromptLogprobs, TokenLogprob
from pushkv.router import text

StopReason = Union[int, str, None]  # vLLM's stop_reason: a stop token id, a stop string, or None


def transfer_id_of(request_id: str) -> str:
    for prefix in ("chatcmpl-", "cmpl-"):
        if request_id.startswith(prefix):
            return request_id[len(prefix):]
    return request_id


def now_s() -> int:
    return int(time.time())


def sse(obj: Any) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")


def sse_event(kind: str, obj: Any) -> bytes:
    """A typed server-sent event (the Responses API's)."""
    return f"event: {kind}\n".encode() + sse(obj)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int] = None,
          completion_details: Optional[dict] = None) -> dict:
    """OpenAI's usage; ``cached_tokens``: the prompt tokens the prefilling instance took from its
    prefix cache (``prompt_tokens_details``, as OpenAI and vLLM report it), when known; ``completion_details``:
    ``completion_tokens_details`` (chat's ``reasoning_tokens``, with a reasoning parser)."""
    out: dict[str, object] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if completion_details is not None:
        out["completion_tokens_details"] = completion_details
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


class StopStrings:
    """Finds the first stop string in the text as it grows; holds back a possible start of one. The text ends
    before it, or with it where ``include`` (vLLM's ``include_stop_str_in_output``)."""

    def __init__(self, stops: Sequence[str], include: bool = False):
        self.stops = tuple(stops)
        self.include = include
        self.pending = ""

    def feed(self, new: str, final: bool, armed: bool = True) -> tuple[str, Optional[str]]:
        """(text safe to release, the stop string that matched, if one did: nothing after it is released).

        Not ``armed`` (before ``min_tokens``): everything is released unchecked."""
        buf = self.pending + new
        if not armed:
            self.pending = ""
            return buf, None
        hits = [(i, -len(s), s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:  # the first to begin (the longest of those beginning there)
            self.pending = ""
            at, minus_len, hit = min(hits)
            return buf[:at - minus_len if self.include else at], hit
        if final or not self.stops:
            self.pending = ""
            return buf, None
        hold = 0
        for s in self.stops:  # longest tail of buf that begins some stop string
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], None


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: Optional[str] = None
    stop_reason: StopReason = None  # vLLM's, with the finish_reason (ChoiceOutput.stop_reason)


def joined(first: Delta, then: Delta) -> Delta:
    """Two deltas of a choice as one: ``then``'s end (its finish_reason, stop_reason) after both's output."""
    return Delta(first.text + then.text, first.token_ids + then.token_ids, first.logprobs + then.logprobs,
                 then.finish_reason, then.stop_reason)


@dataclass
class ChoiceOutput:
    index: int
    tok: text.Tokenizer
    stops: tuple[str, ...] = ()
    min_tokens: int = 0  # stop strings are not looked for before this many tokens
    hide: bool = False  # echo with max_tokens 0: the tokens drawn are counted (``hidden``), never shown
    # the ids that end the choice (EOS, stop_token_ids): in token_ids, and in the text only with include_stop, as
    # vLLM's
    stop_ids: tuple[int, ...] = ()
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the stop string (or id's text) ends the text
    # the stop ids whose stop names itself, as vLLM's (``CompletionParams.stop_reason_ids``: not the tokenizer's EOS)
    reason_ids: tuple[int, ...] = ()
    skip_special: bool = True  # vLLM's skip_special_tokens: special tokens left out of the text
    spaces_between_special: bool = True  # vLLM's spaces_between_special_tokens (text.IncrementalDecoder)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: Optional[str] = None
    # vLLM's stop_reason: the stop string that matched, or the ``reason_ids`` entry that ended the choice; None
    # where it ended on the tokenizer's EOS, length or otherwise
    stop_reason: StopReason = None
    prompt_logprobs: Optional[PromptLogprobs] = None  # the prompt's, when the request asked (with the first tokens)
    hidden: int = 0

    def __post_init__(self):
        self._detok = text.IncrementalDecoder(self.tok, self.skip_special, self.spaces_between_special)
        self._stops = StopStrings(self.stops, self.include_stop)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def completion_tokens(self) -> int:
        """The tokens drawn for the choice, shown or not (usage counts both, as vLLM's does)."""
        return len(self.token_ids) + self.hidden

    def add(self, ids: Sequence[int], lps: Sequence[TokenLogprob] = (),
            prompt: Optional[PromptLogprobs] = None) -> Delta:
        if prompt is not None:
            self.prompt_logprobs = prompt
        if self.done:
            return Delta("", [], [])
        if self.hide:
            self.hidden += len(ids)
            return Delta("", [], [])
        armed = len(self.token_ids) + len(ids) >= self.min_tokens
        # a stop id comes only last (the sampler bans them before min_tokens), and its text is not the answer's
        shown = [i for i in ids if i not in self.stop_ids] if self.stop_ids and not self.include_stop else ids
        out, hit = self._stops.feed(self._detok.push(shown), final=False, armed=armed)
        return self._delta(out, ids, lps, "stop" if hit is not None else None, hit)

    def finish(self, reason: str) -> Delta:
        if self.done:
            return Delta("", [], [], None)
        out, hit = self._stops.feed(self._detok.flush(), final=True)
        if hit is not None:
            return self._delta(out, (), (), "stop", hit)
        last = self.token_ids[-1] if self.token_ids else None
        return self._delta(out, (), (), reason, last if reason == "stop" and last in self.reason_ids else None)

    def _delta(self, out: str, ids, lps, reason: Optional[str], stop_reason: StopReason = None) -> Delta:
        self.text += out
        self.token_ids.extend(ids)
        self.logprobs.extend(lps)
        self.finish_reason = reason
        self.stop_reason = stop_reason
        return Delta(out, list(ids), list(lps), reason, stop_reason)
