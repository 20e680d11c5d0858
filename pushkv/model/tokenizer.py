"""Tokenizers: a built-in byte-level one for presets, HF tokenizer.json for checkpoints."""
from __future__ import annotations

import json
import os
from typing import Optional, Protocol

from pushkv.config import ModelConfig


class Tokenizer(Protocol):
    bos_token_id: int
    eos_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids, skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """ids 0..255 are UTF-8 bytes, 256 = BOS, 257 = EOS; the rest of the vocab is padding."""

    bos_token_id = 256
    eos_token_id = 257

    def __init__(self, vocab_size: int = 320):
        if vocab_size < 258:
            raise ValueError(f"byte tokenizer needs vocab_size >= 258, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json loaded with the `tokenizers` library.

    Text is encoded as the checkpoint's tokenizer says: its post-processor adds
    what it adds (a Llama tokenizer's ``<s>``; nothing for Qwen's), as
    transformers' ``tokenizer(text)`` and vLLM's completions do. Token-id prompts
    are taken as given.
    """

    def __init__(self, path: str, eos_token_id: int = -1, bos_token_id: int = -1):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(path)
        self._added: Optional[dict[int, str]] = None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id if bos_token_id >= 0 else self._special(
            ("<|begin_of_text|>", "<s>", "<bos>"))
        eos = self._special(("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>",
                             "<|endoftext|>", "<eos>"))
        self.eos_token_id = eos_token_id if eos_token_id >= 0 else eos
        self.config_eos_id = -1  # tokenizer_config.json's eos_token (transformers' tokenizer.eos_token_id)

    def _special(self, names) -> int:
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return -1

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    @property
    def added_ids(self) -> dict[int, str]:
        """The tokenizer's added tokens (its specials among them), id -> text: what vLLM's
        ``spaces_between_special_tokens`` false writes back to back."""
        if self._added is None:
            self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        return self._added

    def id_to_token(self, i: int) -> Optional[str]:
        """The id's string in the vocabulary (transformers' convert_ids_to_tokens)."""
        return self._tok.id_to_token(i)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def get_tokenizer(cfg: ModelConfig) -> Tokenizer:
    where = cfg.tokenizer or cfg.checkpoint
    if not where:
        return ByteTokenizer(cfg.vocab_size)
    path = os.path.join(where, "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer directory {where} has no tokenizer.json")
    bos = -1
    cfg_path = os.path.join(where, "config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            b = json.load(f).get("bos_token_id")
        bos = b if isinstance(b, int) else -1
    tok = HFTokenizer(path, cfg.eos_token_id, bos)
    tok.config_eos_id = _config_eos_id(tok, where)
    return tok


def special_tokens(where: str) -> dict[str, str]:
    """A tokenizer directory's named special tokens (``bos_token``, ``eos_token``, ...: their text) as transformers
    reads them: tokenizer_config.json's (a string, or an added token's dict), and where that file is of the older
    form, without ``added_tokens_decoder``, special_tokens_map.json's over them (transformers merges it so)."""
    def read(name: str) -> dict:
        path = os.path.join(where, name)
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            got = json.load(f)
        return got if isinstance(got, dict) else {}

    cfg = read("tokenizer_config.json")
    if "added_tokens_decoder" not in cfg:
        cfg = {**cfg, **read("special_tokens_map.json")}
    out = {}
    for key, v in cfg.items():
        v = v.get("content") if isinstance(v, dict) else v
        if key.endswith("_token") and isinstance(v, str):
            out[key] = v
    return out


def _config_eos_id(tok: HFTokenizer, where: str) -> int:
    """The id of the tokenizer's own ``eos_token`` (``special_tokens``), or -1."""
    v = special_tokens(where).get("eos_token")
    i = tok._tok.token_to_id(v) if v is not None else None
    return -1 if i is None else i
