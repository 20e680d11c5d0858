"""A reasoning model's thinking apart from its answer, as vLLM's ``--reasoning-parser`` gives it: a chat choice's
``reasoning_content`` (what the model wrote inside ``<think> ... </think>``) and ``content`` (what follows), in a
whole response and in a stream alike. Pure: text in, (reasoning, content) out.

- ``deepseek_r1`` (DeepSeek-R1, QwQ, Qwen3's Thinking-2507 models, whose templates open the ``<think>`` in the
  prompt): the output is reasoning up to ``</think>``, with or without its own ``<think>`` first;
- ``qwen3`` (Qwen3's hybrid and Thinking-2507 models), as vLLM 0.32's: where the request thinks (its
  ``chat_template_kwargs``' ``enable_thinking``, true unless it says false, or ``reasoning_effort`` none), as
  ``deepseek_r1``; where it does not, all of the output is content, ``<think>`` or not. Its reasoning also ends
  where a ``<tool_call>`` opens before ``</think>`` (the call's tag is content's first text), as vLLM 0.32's
  Qwen3Parser ends it there: a model that calls a tool without closing its thinking.

Either way, a prompt whose last turn already closed the reasoning (``</think>`` its last tag, as Qwen3's template
writes ``<think>\n\n</think>`` with thinking off) leaves the output all content, as vLLM's streaming parser finds
from the prompt (``reasons``).

Output cut before ``</think>`` (``max_tokens``) is all reasoning. A stream holds back only text that may still
become a tag, so the pieces streamed join to what a whole response gives.
"""
from __future__ import annotations

from typing import Optional

from pushkv.router.text import tag_start

START, END = "<think>", "</think>"
PARSERS = {"deepseek_r1": False, "qwen3": True}  # name -> whether a request that does not think has no reasoning
# where a turn begins or ends in a prompt (ChatML's, DeepSeek's): a tag before it is an earlier turn's
TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")
TOOL_CALL = "<tool_call>"
# name -> the tags that end the reasoning, each with whether it stays in the content (qwen3's tool call: vLLM's
# Qwen3Parser takes it as the reasoning's implicit end)
ENDS: dict[str, tuple[tuple[str, bool], ...]] = {"deepseek_r1": ((END, False),),
                                                "qwen3": ((END, False), (TOOL_CALL, True))}


def reasons(parser: str, thinking: bool, prompt: str) -> bool:
    """Whether a chat's output may hold reasoning: not for qwen3 where the request does not think, nor where the
    prompt's last turn closed the reasoning (``</think>`` after its last ``<think>`` and turn boundary), as vLLM's
    ``is_reasoning_end`` reads the prompt."""
    if PARSERS[parser] and not thinking:
        return False
    end = prompt.rfind(END)
    return end < 0 or end < max(prompt.rfind(t) for t in (START, *TURN_BOUNDARIES))


class Splitter:
    """One choice's text, fed as it comes: each piece's (reasoning, content) deltas; ``reasons``: whether the output
    may hold reasoning at all (``reasons()``)."""

    def __init__(self, parser: str, reasons: bool = True):
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser {parser!r} is not one of {sorted(PARSERS)}")
        # open: not yet known whether the output opens with <think>; reasoning; content
        self.phase = "open" if reasons else "content"
        self.held = ""
        self.ends = ENDS[parser]

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that ``text`` adds; ``final``: nothing follows, so nothing is held back."""
        self.held += text
        reasoning = content = ""
        if self.phase == "open":
            if self.held.startswith(START):
                self.held, self.phase = self.held[len(START):], "reasoning"
            elif START.startswith(self.held) and not final:
                return "", ""  # may still become the opening tag
            else:
                self.phase = "reasoning"  # opened in the prompt
        if self.phase == "reasoning":
            at, tag, kept = _end_of(self.held, self.ends)
            if at < 0:
                cut = len(self.held) - (0 if final else max(tag_start(self.held, t) for t, _ in self.ends))
                reasoning, self.held = self.held[:cut], self.held[cut:]
                return reasoning, ""
            reasoning, self.held = self.held[:at], self.held[at if kept else at + len(tag):]
            self.phase = "content"
        content, self.held = self.held, ""
        return reasoning, content


def _end_of(text: str, ends: tuple[tuple[str, bool], ...], start: int = 0) -> tuple[int, str, bool]:
    """The first of ``ends``' tags in ``text`` from ``start``: (where, the tag, whether it stays in the content);
    (-1, "", False) where none is."""
    found = [(at, tag, kept) for tag, kept in ends if (at := text.find(tag, start)) >= 0]
    return min(found) if found else (-1, "", False)


def span(text: str, parser: str, reasons: bool = True) -> tuple[int, int]:
    """Where a whole output's reasoning lies in its text, [start, end) (its tags outside), as ``Splitter`` finds it;
    (0, 0) where there is none."""
    if not reasons:
        return 0, 0
    start = len(START) if text.startswith(START) else 0
    end = _end_of(text, ENDS[parser], start)[0]
    return start, len(text) if end < 0 else end


def split(text: str, parser: str, reasons: bool = True) -> tuple[Optional[str], Optional[str]]:
    """A whole output's (reasoning_content, content), each None where empty."""
    reasoning, content = Splitter(parser, reasons).feed(text, final=True)
    return reasoning or None, content or None
