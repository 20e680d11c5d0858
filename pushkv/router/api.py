"""``/v1/completions`` request parsing and response shapes (pure, no I/O).

Everything a client can get wrong is found here and raised as ``ApiError``
with the HTTP status and OpenAI error type; the server turns it into
``{"error": {"message", "type"}}``.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pushkv.router import text

DEFAULT_MAX_TOKENS = 16
OBJECT = "text_completion"


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_

    def body(self) -> dict:
        return error_body(self.message, self.type, self.status)


def error_body(message: str, type_: str, status: int) -> dict:
    return {"error": {"message": message, "type": type_, "code": status}}


def error_type(status: int) -> str:
    if status == 504:
        return "timeout"
    if status == 503:
        return "service_unavailable"
    if 400 <= status < 500:
        return "invalid_request_error"
    return "server_error"


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    eos_token_id: int = -1  # -1: the model has no EOS to stop on


@dataclass
class CompletionParams:
    prompt_token_ids: list[int]
    max_tokens: int
    stream: bool = False
    stop_token_ids: tuple[int, ...] = ()
    model: str = ""
    extra: dict = field(default_factory=dict)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_list(x: Any) -> bool:
    return isinstance(x, list) and all(_is_int(i) for i in x)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _prompt_ids(prompt: Any, tok: text.Tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt is empty")
        try:
            ids = text.encode(tok, prompt)
        except UnicodeError as e:  # e.g. a lone surrogate: valid JSON, not encodable text
            raise ApiError(400, f"prompt is not valid text: {e}") from None
    elif _token_list(prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "batched prompts are not supported; send one prompt per request")
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list holding one of those")
    if not ids:
        raise ApiError(400, "prompt is empty")
    return ids


def parse_completion(body: dict, tok: text.Tokenizer, limits: Limits) -> CompletionParams:
    if "prompt" not in body:
        raise ApiError(400, "missing field 'prompt'")
    ids = _prompt_ids(body["prompt"], tok)
    bad = [i for i in ids if not 0 <= i < limits.vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} outside the vocabulary [0, {limits.vocab_size})")

    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens):
        raise ApiError(400, "max_tokens must be an integer")
    room = limits.max_model_len - len(ids)
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}")
    if room < 1 or max_tokens > room:
        raise ApiError(
            400,
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the maximum "
            f"model length {limits.max_model_len}",
        )

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean")

    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise ApiError(400, "temperature must be a number")
        if temperature != 0:
            raise ApiError(400, "only greedy decoding is supported (temperature 0 or absent)")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise ApiError(400, "only n=1 is supported")

    stop = body.get("stop_token_ids") or []
    if not _token_list(stop):
        raise ApiError(400, "stop_token_ids must be a list of token ids")
    bad = [i for i in stop if not 0 <= i < limits.vocab_size]
    if bad:
        raise ApiError(400, f"stop token id {bad[0]} outside the vocabulary [0, {limits.vocab_size})")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "ignore_eos must be a boolean")
    stops = list(dict.fromkeys(stop))
    if limits.eos_token_id >= 0 and not ignore_eos and limits.eos_token_id not in stops:
        stops.append(limits.eos_token_id)

    model = body.get("model") or ""
    return CompletionParams(
        prompt_token_ids=ids, max_tokens=max_tokens, stream=stream,
        stop_token_ids=tuple(stops), model=model if isinstance(model, str) else "",
    )


# ---------------------------------------------------------------------------
# Response shapes
# ---------------------------------------------------------------------------
def completion_id(transfer_id: str) -> str:
    return f"cmpl-{transfer_id}"


def transfer_id_of(request_id: str) -> str:
    return request_id[len("cmpl-"):] if request_id.startswith("cmpl-") else request_id


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def choice(text_: str, token_ids: list[int], finish_reason: Optional[str]) -> dict:
    return {"index": 0, "text": text_, "token_ids": token_ids, "finish_reason": finish_reason}


def completion_body(
    transfer_id: str, created: int, model: str, choice_: dict,
    usage_: Optional[dict] = None, extension: Optional[dict] = None,
) -> dict:
    body = {
        "id": completion_id(transfer_id),
        "object": OBJECT,
        "created": created,
        "model": model,
        "choices": [choice_],
    }
    if usage_ is not None:
        body["usage"] = usage_
    if extension is not None:
        body["pushkv"] = extension
    return body


def sse(obj: Any) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")


def now_s() -> int:
    return int(time.time())
