"""vLLM's ``/tokenize`` and ``/detokenize``, pure: a request body to its answer, with the tokenizer and the chat
template the deployment serves with, so that a client counts tokens as the router will.

``/tokenize`` takes a ``prompt`` (text; ``add_special_tokens`` true by default, as a completion's prompt is
encoded) or chat ``messages`` (rendered by the deployment's template with ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs`` and ``tools``, as a chat request is; ``add_special_tokens``
false by default: the template writes them) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``;
``return_token_strs`` gives each token's string in the vocabulary. ``/detokenize`` takes ``tokens`` and answers
``{"prompt"}``. Errors are ``api.ApiError`` (400 naming the field), as every other endpoint's.
"""
from __future__ import annotations

from typing import Callable, Optional

from pushkv.router import api, text
from pushkv.router.chat import ChatTemplate, parse_messages, parse_tools, render_request


def tokenize(body: dict, tok: text.Tokenizer, limits: api.Limits,
             template: Callable[[], ChatTemplate]) -> dict:
    """The answer to a ``/tokenize`` body; ``template`` gives the deployment's chat template (loaded on first
    use)."""
    if ("prompt" in body) == ("messages" in body):
        raise api.bad("prompt", "give either prompt (text) or messages (a chat), not both and not neither")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise api.bad("prompt", "prompt must be a string")
        special = api.get_bool(body, "add_special_tokens", True)
        source, param = prompt, "prompt"
    else:
        source = render_request(template(), body, parse_messages(body), parse_tools(body))
        special, param = api.get_bool(body, "add_special_tokens", False), "messages"
    ids = api.encode_text(tok, source, param) if source else []
    if not special:
        ids = api.strip_added(tok, ids)
    return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids,
            "token_strs": token_strs(tok, ids) if api.get_bool(body, "return_token_strs") else None}


def token_strs(tok: text.Tokenizer, ids: list[int]) -> list[Optional[str]]:
    """Each id's string in the vocabulary (a byte-level BPE's ``Ġhello``), as transformers'
    ``convert_ids_to_tokens`` gives it; the byte tokenizer's: the byte as text where it is one."""
    by_id = getattr(tok, "id_to_token", None)
    if by_id is not None:
        return [by_id(i) for i in ids]
    return [tok.decode([i]) for i in ids]


def detokenize(body: dict, tok: text.Tokenizer, limits: api.Limits) -> dict:
    """The answer to a ``/detokenize`` body: its ``tokens`` as text."""
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise api.bad("tokens", "tokens must be a list of token ids")
    api.check_prompt_ids(ids, limits, "tokens")
    return {"prompt": tok.decode(ids)}
