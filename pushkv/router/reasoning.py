"""A reasoning model's thinking apart from its answer, as vLLM's ``--reasoning-parser`` gives it: a chat choice's
``reasoning_content`` (what the model wrote inside ``<think> ... </think>``) and ``content`` (what follows), in a
whole response and in a stream alike. Pure: text in, (reasoning, content) out.

- ``deepseek_r1`` (DeepSeek-R1, QwQ, Qwen3's Thinking-2507 models, whose templates open the ``<think>`` in the
  prompt): the output is reasoning up to ``</think>``, with or without its own ``<think>`` first;
- ``qwen3`` (Qwen3's hybrid models, which open it themselves when thinking): reasoning only where the output
  begins with ``<think>``; otherwise (``enable_thinking`` false) all of it is content.

Output cut before ``</think>`` (``max_tokens``) is all reasoning. A stream holds back only text that may still
become a tag, so the pieces streamed join to what a whole response gives.
"""
from __future__ import annotations

from typing import Optional

from pushkv.router.text import until_tag

START, END = "<think>", "</think>"
PARSERS = {"deepseek_r1": True, "qwen3": False}  # name -> whether the reasoning needs no opening tag


class Splitter:
    """One choice's text, fed as it comes: each piece's (reasoning, content) deltas."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser {parser!r} is not one of {sorted(PARSERS)}")
        self.implicit = PARSERS[parser]
        self.phase = "open"  # open: not yet known whether the output opens with <think>; reasoning; content
        self.held = ""

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
                self.phase = "reasoning" if self.implicit else "content"
        if self.phase == "reasoning":
            reasoning, self.held, ended = until_tag(self.held, END, final)
            if not ended:
                return reasoning, ""
            self.phase = "content"
        content, self.held = self.held, ""
        return reasoning, content


def split(text: str, parser: str) -> tuple[Optional[str], Optional[str]]:
    """A whole output's (reasoning_content, content), each None where empty."""
    reasoning, content = Splitter(parser).feed(text, final=True)
    return reasoning or None, content or None
