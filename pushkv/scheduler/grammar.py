"""Structured output in a scheduler: each asking request's grammar, and the tokens each of its steps may draw.

Every scheduler that draws a request's tokens holds it to its grammar: P for the first token, D (or a local
instance) for the rest. A request's ``Matcher`` follows its output (P's first token included, which D received
with the KV), and gives each step the mask of the tokens that keep the output valid (``SeqWork.token_mask``,
xgrammar's bitmask: bit t of int32 word t // 32); the worker's sampler sets the others to -inf. The grammar is
compiled once per scheduler and spec (an LRU of ``CACHED``), over the model's tokenizer: the checkpoint's, or the
built-in byte tokenizer of the random-weight presets.

The compile runs on the scheduler's thread when the request arrives: a JSON schema takes milliseconds to tens of
milliseconds, the steps of the requests already running wait that long.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Optional, Sequence

from pushkv.config import ModelConfig
from pushkv.grammars import grammar_of
from pushkv.messages import Structured

CACHED = 64  # compiled grammars a scheduler keeps
BYTE_EOS = 257  # the built-in byte tokenizer's EOS (pushkv.model.tokenizer.ByteTokenizer)


def _byte_level_names() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which xgrammar reads a byte-level vocabulary."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    names = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in names:
            names[b] = chr(256 + extra)
            extra += 1
    return names


def tokenizer_info(cfg: ModelConfig):
    """xgrammar's view of the model's tokenizer: the checkpoint's tokenizer.json, or the byte tokenizer (ids 0-255
    the bytes, the rest special)."""
    import xgrammar as xgr

    where = cfg.tokenizer or cfg.checkpoint
    stops = list(cfg.all_eos_ids)
    if where:
        import transformers

        tok = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(where, "tokenizer.json"))
        return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=cfg.vocab_size, stop_token_ids=stops or None)
    names = _byte_level_names()
    vocab = [names[b] for b in range(256)] + [""] * (cfg.vocab_size - 256)
    return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=cfg.vocab_size,
                             stop_token_ids=stops or [BYTE_EOS], add_prefix_space=False)


class Grammars:
    """A scheduler's compiler over its model's tokenizer (made at the first request that asks) and its compiled
    grammars."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self._compiler: Any = None
        self._compiled: OrderedDict = OrderedDict()

    def matcher(self, spec: Structured, prompt: Sequence[int] = ()) -> "Matcher":
        import xgrammar as xgr

        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(tokenizer_info(self.cfg), max_threads=1)
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = self._compiler.compile_grammar(grammar_of(spec))
            self._compiled[spec] = compiled
            if len(self._compiled) > CACHED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        return Matcher(xgr.GrammarMatcher(compiled), self.cfg.vocab_size, spec.after,
                       not spec.after or bool(_holds(prompt, spec.after)))


def _holds(seq: Sequence[int], part: Sequence[int], start: int = 0) -> int:
    """Where ``part`` ends in ``seq`` at its first occurrence from ``start`` (0: nowhere)."""
    n = len(part)
    for i in range(max(start, 0), len(seq) - n + 1):
        if list(seq[i:i + n]) == list(part):
            return i + n
    return 0


class Matcher:
    """One request's grammar state, following its output; with a reasoning parser, from the tokens that end the
    reasoning on (``after``), or from the start where the prompt had them."""

    def __init__(self, matcher: Any, vocab: int, after: Sequence[int] = (), active: bool = True):
        import xgrammar as xgr

        self.m = matcher
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)
        self.after = tuple(after)
        self.start = 0 if active else -1  # the output index the grammar holds from; -1: still reasoning
        self.accepted = 0  # output tokens the grammar has taken (from start)
        self.broken = False  # a token the grammar did not allow came (it never should: every draw was masked)

    def advance(self, output: Sequence[int]) -> None:
        if self.start < 0:  # reasoning: look for its end among the new tokens (and the few before them)
            end = _holds(output, self.after, self.accepted - len(self.after) + 1)
            self.accepted = len(output)
            if not end:
                return
            self.start = self.accepted = end
        for t in output[self.accepted:]:
            if not self.broken and not self.m.accept_token(t):
                self.broken = True
        self.accepted = len(output)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and took its end (a stop token), or can take nothing more."""
        return self.start >= 0 and (self.broken or self.m.is_terminated())

    def mask(self, output: Sequence[int]) -> bytes:
        """The tokens the next draw may take, after ``output``: xgrammar's bitmask, packed (b"": any, while the
        model still reasons)."""
        self.advance(output)
        if self.start < 0:
            return b""
        self.m.fill_next_token_bitmask(self.bitmask)
        return self.bitmask.numpy().astype("<i4").tobytes()


def allowed_ids(mask: bytes, vocab: int) -> Optional[list[int]]:
    """The ids a packed mask allows (for the scheduler's checks; None for no mask)."""
    if not mask:
        return None
    import numpy as np

    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits).tolist()
