"""Tokenizer adapter and incremental detokenization for the router.

The model's tokenizer lives in ``pushkv.model.tokenizer``; it is imported
lazily so the router (and its tests) work without it, falling back to a
byte-level tokenizer: ids 0..255 are bytes, 256 is BOS, 257 is EOS.
"""
from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

log = logging.getLogger(__name__)

BYTE_BOS = 256
BYTE_EOS = 257
REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 tail


class Tokenizer(Protocol):
    def encode(self, text: str) -> Any: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """Bytes are tokens; specials (>= 256) decode to nothing."""

    bos_token_id = BYTE_BOS
    eos_token_id = BYTE_EOS
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class NoTokenizer:
    """``--skip-tokenizer-init``, as vLLM's: the router loads no tokenizer, so prompts come as token ids and the
    output is its token ids, its text empty. Text to encode is refused (``Untokenizable``, a 400 naming the field)."""

    def encode(self, text: str) -> list[int]:
        raise Untokenizable("the router has no tokenizer (--skip-tokenizer-init): send the prompt as token ids")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""


class Untokenizable(ValueError):
    """Text where ``--skip-tokenizer-init`` takes only token ids."""


def load_tokenizer(model_cfg) -> Tokenizer:
    """The model's tokenizer, or the byte fallback when that module is absent."""
    try:
        from pushkv.model.tokenizer import get_tokenizer
    except ImportError as e:
        log.warning("pushkv.model.tokenizer unavailable (%s); using the byte-level tokenizer", e)
        return ByteTokenizer()
    return get_tokenizer(model_cfg)


def encode(tok: Tokenizer, text: str) -> list[int]:
    out = tok.encode(text)
    ids = getattr(out, "ids", out)  # a `tokenizers.Encoding` carries .ids
    return [int(i) for i in ids]


class IncrementalDecoder:
    """Turns a growing id list into text deltas without re-decoding it all.

    Keeps two offsets into the ids: ``prefix`` (start of the window decoded
    for context) and ``read`` (end of what has been emitted). A delta that
    ends in an incomplete character is held back until the next ids arrive.
    ``skip_special``: special tokens left out of the text (vLLM's
    ``skip_special_tokens``, true by default). ``spaces_between_special``
    false (vLLM's ``spaces_between_special_tokens``; with special tokens kept):
    an added token right after another is written as its own text, with no
    space a decoder (WordPiece's) would put between them.
    """

    def __init__(self, tok: Tokenizer, skip_special: bool = True, spaces_between_special: bool = True):
        self.tok = tok
        self.skip_special = skip_special
        added = getattr(tok, "added_ids", None) if not (skip_special or spaces_between_special) else None
        self.back_to_back: dict[int, str] = added or {}
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self.read >= len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        if len(full) <= len(before) or (full.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(before):]

    def _decode(self, ids: list[int]) -> str:
        if self.skip_special:
            return self.tok.decode(ids)  # every tokenizer's default; a test's may take no keyword
        if self.back_to_back:
            return joined_added(self.tok, ids, self.back_to_back)
        return self.tok.decode(ids, skip_special_tokens=False)


def joined_added(tok: Tokenizer, ids: list[int], added: dict[int, str]) -> str:
    """``ids`` decoded with special tokens kept, with nothing between an added token and the added token before it:
    cut between each such pair, each run decoded as the tokenizer decodes it (a run then begins with an added
    token's own text), the runs put back to back."""
    cuts = [0] + [i for i in range(1, len(ids)) if ids[i] in added and ids[i - 1] in added] + [len(ids)]
    return "".join(tok.decode(ids[a:b], skip_special_tokens=False) for a, b in zip(cuts, cuts[1:]))


def until_tag(held: str, tag: str, final: bool) -> tuple[str, str, bool]:
    """A stream's held text against ``tag``: (the text before it, what follows it, True) where it has come; else
    (what can no longer begin it, the end that still may, held back unless ``final``, False)."""
    at = held.find(tag)
    if at >= 0:
        return held[:at], held[at + len(tag):], True
    cut = len(held) - (0 if final else tag_start(held, tag))
    return held[:cut], held[cut:], False


def tag_start(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (and may become it with more text): what a
    stream holds back while it waits to see whether a tag comes."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
