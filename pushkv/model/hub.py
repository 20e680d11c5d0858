"""Where ``--model`` (and ``--tokenizer``) point: a local checkpoint directory, or a Hugging Face
repo id resolved to its snapshot directory through ``huggingface_hub`` (from the local cache
when ``HF_HUB_OFFLINE=1``, downloading where the network allows), as vLLM resolves them."""
from __future__ import annotations

import os
import re
from typing import Optional

from pushkv import envs

# what serving reads out of a repo: not its other weight formats (.bin, .pth, .gguf), which can
# weigh as much again
SERVE_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "additional_chat_templates/*.jinja"]
# --load-format dummy: the shape, tokenizer and sampling defaults, and no weights (vLLM's dummy loader fetches none)
SHAPE_FILES = [f for f in SERVE_FILES if f not in ("*.safetensors", "model.safetensors.index.json")]
# a repo without safetensors: its PyTorch state dicts, as vLLM's --load-format auto falls back to them
BIN_FILES = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
TOKENIZER_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "additional_chat_templates/*.jinja"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_repo_id(name: str) -> bool:
    """``org/name`` as the Hub spells ids, and not a path that exists here."""
    return bool(_REPO_ID.fullmatch(name)) and not os.path.exists(name) and ".." not in name


def resolve(name: str, revision: Optional[str] = None, files: Optional[list[str]] = None,
            cache_dir: Optional[str] = None, flags: tuple[str, str] = ("--model", "--revision")) -> str:
    """The local directory of ``name``: the directory itself, or the Hub repo's snapshot (in ``cache_dir``, vLLM's
    --download-dir, else huggingface_hub's cache). ValueError naming what was looked for when it is neither, and
    the flags (``flags``: the name's and the revision's) that asked."""
    what, rev_flag = flags
    if os.path.isdir(name):
        if revision:
            raise ValueError(f"{rev_flag} {revision!r} applies to a Hugging Face repo id, not the local "
                             f"directory {name!r}")
        return os.path.abspath(name)
    if not is_repo_id(name):
        raise ValueError(f"{what} {name!r}: no such directory, and not a Hugging Face repo id (org/name)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:  # transformers and tokenizers bring it; a bare install may not
        raise ValueError(f"{what} {name!r} is a Hugging Face repo id: install huggingface_hub") from None
    offline = envs.HF_HUB_OFFLINE.lower() in ("1", "true", "yes", "on")  # as huggingface_hub reads it
    try:
        path = snapshot_download(repo_id=name, revision=revision, allow_patterns=files or SERVE_FILES,
                                 cache_dir=cache_dir)
        if files is None and not any(f.endswith(".safetensors") for f in os.listdir(path)):
            path = snapshot_download(repo_id=name, revision=revision, allow_patterns=BIN_FILES, cache_dir=cache_dir)
        return path
    except LocalEntryNotFoundError as e:
        where = "not in the local Hugging Face cache (HF_HUB_OFFLINE=1)" if offline else "not reachable"
        raise ValueError(f"{what} {name!r}{f' revision {revision!r}' if revision else ''}: {where}: {e}") from None
    except (HfHubHTTPError, OSError) as e:
        raise ValueError(f"{what} {name!r}{f' revision {revision!r}' if revision else ''}: {e}") from None
