"""OpenAI request parsing for ``/v1/completions`` and ``/v1/chat/completions`` (pure, no I/O).

Everything a client can get wrong is found here and raised as ``ApiError``
with the HTTP status and the field named; the server turns it into
``{"error": {"message", "type", "param", "code"}}``. Unknown fields are ignored, as
OpenAI-compatible servers do; known fields that would change the result and
are not implemented (``suffix``, ``best_of`` > n, beam search, a repetition
penalty other than 1, structured output: ``response_format`` other than text
and vLLM's ``guided_*`` / ``structured_outputs``) are refused.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar, overload

import msgspec

from pushkv import limits as L
from pushkv.config import SamplingDefaults
from pushkv.messages import SamplingParams, Structured
from pushkv.router import text
from pushkv.router.text import Untokenizable

DEFAULT_MAX_TOKENS = 16  # completions, as OpenAI; chat defaults to what fits
CANONICAL_ID = re.compile(r"0|[1-9][0-9]{0,9}")  # a logit_bias key: "7", never "07", " 7", "+7", "7.0"


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str = "",
                 code: str = ""):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code  # OpenAI's error code where it has one (model_not_found); else the status

    def body(self) -> dict:
        return error_body(self.message, self.type, self.status, self.param, self.code)


def error_body(message: str, type_: str, status: int, param: str = "", code: str = "") -> dict:
    """OpenAI's and vLLM's error object: ``param`` is always there, null where no field is to blame (clients read
    ``error.param`` without a default)."""
    return {"error": {"message": message, "type": type_, "param": param or None, "code": code or status}}


def error_type(status: int) -> str:
    if status == 504:
        return "timeout"
    if status == 503:
        return "service_unavailable"
    if status == 429:
        return "rate_limit_error"  # OpenAI's type for 429
    if 400 <= status < 500:
        return "invalid_request_error"
    return "server_error"


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class Limits:
    """What the served model allows and defaults to."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()  # every id that ends a turn (none: never stop on EOS)
    defaults: SamplingDefaults = SamplingDefaults()  # the checkpoint's, for fields a request leaves unset
    # the tokenizer's own EOS (tokenizer_config.json's eos_token; -1: the first of eos_token_ids): a choice it ends
    # has no stop_reason, where one ended by the checkpoint's other EOS ids names it, as vLLM's (check_stop tells
    # the request's eos_token_id apart from the stop_token_ids that generation_config's EOS ids join)
    main_eos_id: int = -1
    # the server's say over a request's fields, as vLLM's flags: --enable-force-include-usage (a stream's usage, each
    # chunk's and the total, whatever stream_options asks) and --return-tokens-as-token-ids (the request's own wins)
    force_usage: bool = False
    token_ids: bool = False

    @property
    def main_eos(self) -> int:
        return self.main_eos_id if self.main_eos_id >= 0 else next(iter(self.eos_token_ids), -1)


@dataclass
class CompletionParams:
    """One request, parsed: what the legs carry and what the router does with the output."""

    prompt_token_ids: list[int]
    max_tokens: int
    stream: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # the stop ids but the tokenizer's own EOS (``Limits.main_eos``; all of them with ignore_eos, which leaves the
    # checkpoint's EOS ids out): the one that ends a choice is its stop_reason, as vLLM's
    stop_reason_ids: tuple[int, ...] = ()
    model: str = ""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # stop strings: output ends before the first one, which is not returned
    n: int = 1
    echo: bool = False
    prompt_text: str = ""  # for echo
    # echo with max_tokens 0 (OpenAI's and vLLM's): the prompt alone is the answer; one token is drawn to end
    # the prefill, counted in usage as vLLM counts it, and not shown
    echo_only: bool = False
    include_usage: bool = False  # stream_options.include_usage
    # vLLM's stream_options.continuous_usage_stats (with include_usage): each chunk's usage, its choice's so far
    continuous_usage: bool = False
    chat: bool = False
    echo_text: str = ""  # chat's echo (vLLM's): the final assistant message's text, opening each choice's content
    reasoning_parser: str = ""  # chat: its choices' reasoning apart (router/reasoning.py; the deployment's)
    # chat with a reasoning parser: whether the output may hold reasoning (reasoning.reasons: the request thinks, and
    # its prompt did not close the reasoning)
    reasons: bool = True
    tool_call_parser: str = ""  # chat with tools, tool_choice auto: calls out of the content (router/tool_calls.py)
    tools: list[dict] = field(default_factory=list)  # chat's tools (qwen3_coder types a call's arguments by them)
    parallel_tool_calls: bool = True  # false (OpenAI's, vLLM's): a choice's first call alone is given
    # vLLM's include_reasoning false: with a reasoning parser, the reasoning is not returned, nor what would show it
    # (logprobs, token ids)
    include_reasoning: bool = True
    skip_special_tokens: bool = True  # vLLM's: special tokens left out of the output's text
    # vLLM's: false (with special tokens kept) writes an added token right after another with nothing between
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: the text ends with the stop string (or stop id's text)
    cache_salt: str = ""  # vLLM's: cached prefixes shared only among requests of the same salt
    structured: Optional[Structured] = None  # the output held to a grammar (router/structured.py)
    return_tokens_as_token_ids: bool = False  # vLLM's: a logprob's token written "token_id:N" (render.TokenIds)
    # vLLM's return_token_ids: the prompt's ids (and chat's output ids, which completions always carry) returned
    return_token_ids: bool = False
    seeded: bool = False  # the request gave its own seed (else the router drew one for it)
    # the client's own id for the request (vLLM's X-Request-Id header, else its request_id field): the response's id
    # is the endpoint's prefix and it (cmpl-ID, chatcmpl-ID), and /v1/abort takes it; "": pushkv's own
    client_id: str = ""
    # /v1/responses (router/responses.py): the request's settings its response object repeats; None: another route
    responses: Optional[dict] = None
    # /v1/responses with store: called with the finished response object, to keep it (responses.Store)
    keep_response: Optional[Callable[[dict], None]] = None
    # completions' prompt as a batch of several: each prompt (ids, text) with its own n choices, choice
    # p * n + c being prompt p's c-th; empty: the one prompt above
    batch: list[tuple[list[int], str]] = field(default_factory=list)

    def prompts(self) -> list[tuple[list[int], str]]:
        """Every prompt (ids, text for echo), in the order of their choices."""
        return self.batch or [(self.prompt_token_ids, self.prompt_text)]

    @property
    def choices(self) -> int:
        return len(self.prompts()) * self.n


# ---------------------------------------------------------------------------
# Field readers: each names its field when it refuses
# ---------------------------------------------------------------------------
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


def _token_list(x: Any) -> bool:
    return isinstance(x, list) and all(_is_int(i) for i in x)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be a boolean")
    return v


@overload
def get_int(body: dict, name: str, default: int, lo: Optional[int] = None, hi: Optional[int] = None) -> int: ...


@overload
def get_int(body: dict, name: str, default: None, lo: Optional[int] = None,
            hi: Optional[int] = None) -> Optional[int]: ...


def get_int(body: dict, name: str, default: Optional[int], lo: Optional[int] = None,
            hi: Optional[int] = None) -> Optional[int]:
    """``body[name]`` as an integer within [lo, hi], else ``default`` when absent (an int default:
    an int back). A float with nothing after the point is taken as its integer, as vLLM's pydantic takes it
    (a client's ``max_tokens = budget / 2`` sends 2048.0)."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise bad(name, f"{name} must be an integer")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(name, f"{name} must be in [{'' if lo is None else lo}, {'' if hi is None else hi}], got {v}")
    return v


def get_num(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise bad(name, f"{name} must be a number")
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(name, f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}")
    return float(v)


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


def encode_text(tok: text.Tokenizer, s: str, param: str) -> list[int]:
    try:
        return text.encode(tok, s)
    except UnicodeError as e:  # e.g. a lone surrogate: valid JSON, not encodable text
        raise bad(param, f"{param} is not valid text: {e}") from None


def strip_added(tok: text.Tokenizer, ids: list[int]) -> list[int]:
    """A text's ids without what the tokenizer's post-processor put in front (a Llama tokenizer's ``<s>``): vLLM's
    ``add_special_tokens`` false."""
    added = text.encode(tok, "")
    return ids[len(added):] if added and ids[:len(added)] == added else ids


def encode_bare(tok: text.Tokenizer, s: str, param: str) -> list[int]:
    """``s`` as the tokenizer writes it with ``add_special_tokens`` false."""
    return strip_added(tok, encode_text(tok, s, param))


def _prompts(prompt: Any, tok: text.Tokenizer) -> list[tuple[list[int], str]]:
    """A completion's prompt: text or token ids, or a batch (a list) of those: each prompt's (ids, text)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > L.MAX_PROMPTS:
            raise bad("prompt", f"at most {L.MAX_PROMPTS} prompts in a batch, got {len(prompt)}")
        return [_prompt_ids(p, tok, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_prompt_ids(prompt, tok, "prompt")]


def _prompt_ids(prompt: Any, tok: text.Tokenizer, param: str) -> tuple[list[int], str]:
    text_ = ""
    if isinstance(prompt, str):
        ids, text_ = (encode_text(tok, prompt, param) if prompt else []), prompt
    elif _token_list(prompt):
        ids = list(prompt)
    else:
        raise bad(param, f"{param} must be a string, a list of token ids, or a list of those")
    if not ids:
        raise bad(param, f"{param} is empty")
    return ids, text_


def check_model(body: dict, served: tuple[str, ...]) -> None:
    """A request's ``model`` must be a name this deployment serves (404 ``model_not_found``, as
    OpenAI answers); a request without one, or with an empty one, is served by the base model (vLLM's
    ``_is_model_supported`` takes "" so)."""
    model = body.get("model")
    if model is None or model == "":
        return
    if not isinstance(model, str):
        raise bad("model", "model must be a string")
    if model not in served:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves {list(served)}",
                       param="model", code="model_not_found")


def parse_request(raw: bytes, served: tuple[str, ...],
                  parse: Callable[[dict], CompletionParams]) -> CompletionParams:
    """A request body, whole: JSON, then its fields (``parse``: completions or chat), then its model."""
    body = parse_json(raw)
    try:
        params = parse(body)
    except Untokenizable as e:  # --skip-tokenizer-init: text where only token ids are taken
        raise bad("prompt" if "prompt" in body else "messages" if "messages" in body else "input", str(e)) from None
    check_model(body, served)
    return params


def check_untokenized(params: CompletionParams) -> None:
    """``--skip-tokenizer-init``, as vLLM's: what needs the output's text is refused, by name (its text is empty)."""
    if params.stop:
        raise bad("stop", "stop strings need the output's text, which --skip-tokenizer-init does not make: use "
                          "stop_token_ids")
    if params.structured is not None:
        raise bad("response_format", "structured output needs the tokenizer, which --skip-tokenizer-init skips")


def truncate_prompt(ids: list[int], body: dict, limits: Limits) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: k >= 1 keeps a prompt's last k tokens, -1 its last ``max_model_len``;
    absent, the prompt as it is (one too long is refused). vLLM's ``truncation_side`` ``right`` keeps the first
    ones instead (``left``, the default, the last)."""
    side = body.get("truncation_side")
    if side not in (None, "left", "right"):
        raise bad("truncation_side", f"truncation_side must be 'left' or 'right', got {side!r}")
    k = get_int(body, "truncate_prompt_tokens", None, -1, limits.max_model_len)
    if k is None:
        return ids
    if k == 0:
        raise bad("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (max_model_len) or at least 1, got 0")
    keep = limits.max_model_len if k == -1 else k
    return ids[:keep] if side == "right" else ids[-keep:]


def client_id(v: Any, param: str) -> str:
    """A client's request id (vLLM's ``X-Request-Id`` header or ``request_id`` field): printable ASCII without spaces,
    at most ``L.MAX_CLIENT_ID_CHARS``; absent, ""."""
    if v is None:
        return ""
    if not (isinstance(v, str) and 0 < len(v) <= L.MAX_CLIENT_ID_CHARS and v.isascii() and v.isprintable()
            and " " not in v):
        raise bad(param, f"{param} must be 1 to {L.MAX_CLIENT_ID_CHARS} printable ASCII characters without spaces")
    return v


def check_prompt_ids(ids: list[int], limits: Limits, param: str = "prompt") -> None:
    bad_ids = [i for i in ids if not 0 <= i < limits.vocab_size]
    if bad_ids:
        raise bad(param, f"token id {bad_ids[0]} outside the vocabulary [0, {limits.vocab_size})")


def parse_completion(body: dict, tok: text.Tokenizer, limits: Limits) -> CompletionParams:
    if "prompt" not in body:
        raise bad("prompt", "missing field 'prompt'")
    prompts = _prompts(body["prompt"], tok)
    if not get_bool(body, "add_special_tokens", True):  # vLLM's: the text's prompts without the tokenizer's BOS
        prompts = [(strip_added(tok, ids) if text_ else ids, text_) for ids, text_ in prompts]
        if any(not ids for ids, _ in prompts):
            raise bad("prompt", "prompt is empty without its special tokens")
    # vLLM's truncate_prompt_tokens: each prompt's last k tokens (echo shows what was kept)
    prompts = [(kept, text_ if len(kept) == len(ids) else "") for ids, text_ in prompts
               for kept in (truncate_prompt(ids, body, limits),)]
    for i, (ids, _) in enumerate(prompts):
        check_prompt_ids(ids, limits, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
    if body.get("suffix") not in (None, ""):
        raise bad("suffix", "suffix is not supported")
    echo = get_bool(body, "echo")
    logprobs = get_int(body, "logprobs", None, 0, L.MAX_LOGPROBS)
    echo_only = echo and _is_int(body.get("max_tokens")) and body["max_tokens"] == 0
    if echo_only:  # vLLM's: one token ends the prefill; the answer is the prompt alone
        body = {**body, "max_tokens": 1}
    longest = max((ids for ids, _ in prompts), key=len)  # every prompt must leave room for a token
    shortest = min((ids for ids, _ in prompts), key=len)  # max_tokens is cut per prompt (the router's runs)
    params = parse_generation(body, longest, tok, limits, DEFAULT_MAX_TOKENS, -1 if logprobs is None else logprobs,
                              room_of=shortest)
    # echo with logprobs scores the prompt with as many alternatives, unless prompt_logprobs says (vLLM's)
    asked = parse_prompt_logprobs(body, params.stream)
    if asked is None and echo and logprobs is not None:
        asked = logprobs
    params.sampling = msgspec.structs.replace(params.sampling, prompt_logprobs=-1 if asked is None else asked)
    if len(prompts) * params.n > L.MAX_CHOICES:
        raise bad("n", f"{len(prompts)} prompts x n {params.n} is more than {L.MAX_CHOICES} choices")
    if echo:  # the prompt's text: as given, or its ids decoded
        prompts = [(ids, text_ if text_ else tok.decode(ids)) for ids, text_ in prompts]
    params.prompt_token_ids, params.prompt_text = prompts[0]
    params.batch = prompts if len(prompts) > 1 else []
    params.echo = echo
    params.echo_only = echo_only
    return params


def parse_prompt_logprobs(body: dict, stream: bool) -> Optional[int]:
    """vLLM's ``prompt_logprobs``: how many alternatives each prompt position gives (0: the prompt
    token's alone), or None. As vLLM, refused with ``stream`` (a stream has nowhere to put them),
    unless 0."""
    n = get_int(body, "prompt_logprobs", None, 0, L.MAX_LOGPROBS)
    if n is not None and n > 0 and stream:
        raise bad("prompt_logprobs", "prompt_logprobs are not available with stream=true (vLLM's rule); "
                                     "echo with logprobs streams the prompt's")
    return n


def refuse_unbuilt(body: dict) -> None:
    """vLLM's fields that would change the answer and are not built: a 400 naming the field, never output that
    ignores them."""
    for name, (fine, why) in VLLM_UNBUILT.items():
        if name in body and body[name] not in fine:
            raise bad(name, f"{name} {body[name]!r} is not supported: {why}")


# vLLM's own request fields that would change the answer and are not built: each with the values that change
# nothing (what vLLM does without it), and why not
VLLM_UNBUILT: dict[str, tuple[tuple, str]] = {
    "watermarking": ((None, False), "watermarking is not built"),
    "repetition_detection": ((None,), "repetition detection is not built (stop, stop_token_ids and max_tokens end "
                                      "the output)"),
    "prompt_embeds": ((None,), "prompt embeddings are not built: send the prompt as text or token ids"),
    "length_penalty": ((None, 1, 1.0), "beam search is not built"),
    "priority": ((None, 0), "priority scheduling is not built: requests are served first come, first served (vLLM "
                            "refuses a priority too unless --scheduling-policy priority)"),
    "logprob_token_ids": ((None, []), "logprobs of chosen token ids are not built (logprobs / top_logprobs give the "
                                      "sampled token's and the most likely ones')"),
    "thinking_token_budget": ((None,), "a thinking budget is not built (max_tokens bounds the whole output)"),
}


def parse_generation(body: dict, ids: list[int], tok: text.Tokenizer, limits: Limits, default_max: Optional[int],
                     logprobs: int, max_tokens_field: str = "max_tokens", prompt_field: str = "prompt",
                     room_of: Optional[list[int]] = None) -> CompletionParams:
    """The fields completions and chat share, for a prompt already tokenized (``tok`` writes ``bad_words``). A
    prompt that leaves no room for an output token is refused in vLLM's words, which clients match ("maximum context
    length is N tokens") to shorten the conversation; a max_tokens past the room left is cut to it, as vLLM 0.32's
    ``get_max_tokens`` cuts it."""
    room = limits.max_model_len - len(ids)
    if room < 1:
        why = ("which exceeds this limit even without any output tokens" if room < 0
               else "which leaves no room for an output token")
        raise bad(prompt_field, f"This model's maximum context length is {limits.max_model_len} tokens. However, "
                                f"your prompt contains {len(ids)} input tokens, {why}. "
                                f"Please reduce the length of the input "
                                f"{'messages' if prompt_field == 'messages' else 'prompt'}.")
    if body.get(max_tokens_field) is None:
        max_tokens_field = "max_tokens"  # chat: the older name
    max_tokens = get_int(body, max_tokens_field, None)
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else room
        if limits.defaults.max_tokens is not None:  # the checkpoint's max_new_tokens
            max_tokens = min(max_tokens, limits.defaults.max_tokens)
    if limits.defaults.max_tokens_cap is not None:  # a bound on every request's, as vLLM's override_max_tokens
        max_tokens = min(max_tokens, limits.defaults.max_tokens_cap)
    if max_tokens < 1:
        raise bad(max_tokens_field, f"{max_tokens_field} must be at least 1, got {max_tokens}")
    # (a batch: cut to its shortest prompt's room here, and to each prompt's own where the router opens its runs)
    max_tokens = min(max_tokens, limits.max_model_len - len(ids if room_of is None else room_of))

    stream = get_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options", "stream_options must be an object")
    if opts and not stream:  # vLLM's and OpenAI's rule: usage options of a stream that is not one say nothing
        raise bad("stream_options", "stream_options can only be given with stream true")
    include_usage = limits.force_usage or (get_bool(opts or {}, "include_usage") if opts else False)
    continuous_usage = limits.force_usage or (include_usage and get_bool(opts or {}, "continuous_usage_stats"))

    refuse_unbuilt(body)
    from pushkv.router import structured  # (it raises this module's errors: imported here, not at the top)

    grammar = structured.parse(body)
    n = get_int(body, "n", 1, 1, L.MAX_N)
    best_of = get_int(body, "best_of", None, 1, L.MAX_BEST_OF)
    if best_of is not None and best_of != n:
        raise bad("best_of", "best_of other than n is not supported")
    if get_bool(body, "use_beam_search"):
        raise bad("use_beam_search", "beam search is not supported")

    stop_ids = body.get("stop_token_ids") or []
    if not _token_list(stop_ids):
        raise bad("stop_token_ids", "stop_token_ids must be a list of token ids")
    if len(stop_ids) > L.MAX_STOP_TOKEN_IDS:
        raise bad("stop_token_ids", f"at most {L.MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(stop_ids)}")
    outside = [i for i in stop_ids if not 0 <= i < limits.vocab_size]
    if outside:
        raise bad("stop_token_ids", f"stop token id {outside[0]} outside the vocabulary [0, {limits.vocab_size})")
    ignore_eos = get_bool(body, "ignore_eos")
    stops = list(dict.fromkeys(stop_ids))
    if not ignore_eos:  # every EOS id the checkpoint names (a Llama-3 instruct model has three)
        stops += [i for i in limits.eos_token_ids if i not in stops]

    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stop) > L.MAX_STOPS:
        raise bad("stop", f"at most {L.MAX_STOPS} stop strings, got {len(stop)}")
    long = next((s for s in stop if len(s) > L.MAX_STOP_CHARS), None)
    if long is not None:
        raise bad("stop", f"a stop string may have at most {L.MAX_STOP_CHARS} characters, got {len(long)}")

    sampling = parse_sampling(body, tok, limits, logprobs, max_tokens)
    refuse_nothing_to_draw(sampling, stops)
    model = body.get("model")
    return CompletionParams(
        prompt_token_ids=ids, max_tokens=max_tokens, stream=stream, stop_token_ids=tuple(stops),
        stop_reason_ids=tuple(i for i in stops if ignore_eos or i != limits.main_eos),
        model=model if isinstance(model, str) else "", sampling=sampling,
        stop=tuple(dict.fromkeys(stop)), n=n, include_usage=include_usage, continuous_usage=continuous_usage,
        skip_special_tokens=get_bool(body, "skip_special_tokens", True),
        spaces_between_special_tokens=get_bool(body, "spaces_between_special_tokens", True),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output"),
        cache_salt=parse_cache_salt(body), structured=grammar,
        return_tokens_as_token_ids=get_bool(body, "return_tokens_as_token_ids", limits.token_ids),
        return_token_ids=get_bool(body, "return_token_ids"),
        seeded=body.get("seed") is not None,
        client_id=client_id(body.get("request_id"), "request_id"),
    )


def parse_sampling(body: dict, tok: text.Tokenizer, limits: Limits, logprobs: int, max_tokens: int) -> SamplingParams:
    d = limits.defaults  # the checkpoint's, where it has them; pushkv's absent temperature is greedy
    temperature = get_num(body, "temperature", _or(d.temperature, 0.0), 0.0, L.MAX_TEMPERATURE)
    if temperature < L.MIN_TEMPERATURE:
        temperature = 0.0
    top_p = get_num(body, "top_p", _or(d.top_p, 1.0), 0.0, 1.0, lo_open=True)
    top_k = get_int(body, "top_k", _or(d.top_k, 0), -1)
    top_k = 0 if top_k == -1 else top_k
    min_p = get_num(body, "min_p", _or(d.min_p, 0.0), 0.0, 1.0)
    presence = get_num(body, "presence_penalty", _or(d.presence_penalty, 0.0), -L.MAX_PENALTY, L.MAX_PENALTY)
    frequency = get_num(body, "frequency_penalty", _or(d.frequency_penalty, 0.0), -L.MAX_PENALTY, L.MAX_PENALTY)
    repetition = get_num(body, "repetition_penalty", _or(d.repetition_penalty, 1.0), 0.0, L.MAX_REPETITION_PENALTY,
                         lo_open=True)
    min_tokens = get_int(body, "min_tokens", 0, 0, max_tokens)
    seed = get_int(body, "seed", None)
    if seed is None:  # the request's own stream; P and D both see it (greedy needs none)
        seed = random.getrandbits(64) if temperature > 0 else 0
    pairs = parse_logit_bias(body.get("logit_bias"), limits)
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed & ((1 << 64) - 1),
        presence_penalty=presence, frequency_penalty=frequency, logit_bias=tuple(sorted(pairs)),
        logprobs=logprobs, min_tokens=min_tokens, allowed_token_ids=parse_allowed_token_ids(body, limits),
        bad_words=parse_bad_words(body, tok, limits), repetition_penalty=repetition,
    )


def parse_cache_salt(body: dict) -> str:
    """vLLM's ``cache_salt``: a non-empty string; a request's prompt blocks are cached and found only among requests
    that give the same one."""
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str) or not salt:
        raise bad("cache_salt", "cache_salt must be a non-empty string")
    if len(salt) > L.MAX_CACHE_SALT_CHARS:
        raise bad("cache_salt", f"cache_salt may have at most {L.MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")
    return salt


def parse_allowed_token_ids(body: dict, limits: Limits) -> tuple[int, ...]:
    """vLLM's ``allowed_token_ids``: the only ids the request may draw (none given: every id)."""
    ids = body.get("allowed_token_ids")
    if ids is None:
        return ()
    if not _token_list(ids) or not ids:
        raise bad("allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids")
    if len(ids) > L.MAX_ALLOWED_TOKEN_IDS:
        raise bad("allowed_token_ids", f"at most {L.MAX_ALLOWED_TOKEN_IDS} allowed_token_ids, got {len(ids)}")
    check_prompt_ids(ids, limits, "allowed_token_ids")
    return tuple(sorted(set(ids)))


def parse_bad_words(body: dict, tok: text.Tokenizer, limits: Limits) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words``, each written as the tokenizer writes it at the start of a text and after a space (the
    second only where it is another first token and as many tokens, as vLLM takes it); a word's last token is
    then never drawn where the output so far ends with the tokens before it."""
    words = body.get("bad_words")
    if words is None or words == []:
        return ()
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise bad("bad_words", "bad_words must be a list of non-blank strings")
    if len(words) > L.MAX_BAD_WORDS:
        raise bad("bad_words", f"at most {L.MAX_BAD_WORDS} bad_words, got {len(words)}")
    out: list[tuple[int, ...]] = []
    for w in words:
        bare = tuple(encode_bare(tok, w.lstrip(), "bad_words"))
        spaced = tuple(encode_bare(tok, " " + w.lstrip(), "bad_words"))
        for ids in (bare, spaced) if spaced[:1] != bare[:1] and len(spaced) == len(bare) else (bare,):
            if len(ids) > L.MAX_BAD_WORD_TOKENS:
                raise bad("bad_words", f"a bad word may have at most {L.MAX_BAD_WORD_TOKENS} tokens, {w!r} has "
                                       f"{len(ids)}")
            check_prompt_ids(list(ids), limits, "bad_words")
            out.append(ids)
    return tuple(dict.fromkeys(out))


def refuse_nothing_to_draw(p: SamplingParams, stops: list[int]) -> None:
    """A request whose allowed_token_ids leave no token to draw from its first step is a 400, naming the field
    that takes the last of them."""
    if not p.allowed_token_ids:
        return
    allowed = set(p.allowed_token_ids)
    if allowed <= {w[0] for w in p.bad_words if len(w) == 1}:
        raise bad("bad_words", "bad_words ban every one of allowed_token_ids: no token could be drawn")
    if p.min_tokens and allowed <= set(stops):
        raise bad("min_tokens", "every one of allowed_token_ids is a stop token (an EOS id or stop_token_ids), "
                                "which min_tokens holds off: no token could be drawn")


_T = TypeVar("_T")


def _or(v: Optional[_T], default: _T) -> _T:
    return default if v is None else v


def parse_logit_bias(bias: Any, limits: Limits) -> list[tuple[int, float]]:
    """(token id, bias) pairs. Keys are token ids written as canonical integers, so no two keys
    name the same id and no id's biases add up past the bound."""
    if bias is None:
        return []
    if not isinstance(bias, dict):
        raise bad("logit_bias", "logit_bias must be an object mapping token ids to numbers")
    if len(bias) > L.MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"at most {L.MAX_LOGIT_BIAS} logit_bias entries, got {len(bias)}")
    pairs = []
    for k, v in bias.items():
        if not CANONICAL_ID.fullmatch(k):
            raise bad("logit_bias", f"logit_bias key {k!r} is not a token id written as a canonical integer "
                                    "(e.g. \"7\")")
        tid = int(k)
        if tid >= limits.vocab_size:
            raise bad("logit_bias", f"logit_bias token id {tid} outside the vocabulary [0, {limits.vocab_size})")
        if not _is_num(v) or not -L.LOGIT_BIAS_ABS <= v <= L.LOGIT_BIAS_ABS:
            raise bad("logit_bias", f"logit_bias value for {k!r} must be a number in "
                                    f"[-{L.LOGIT_BIAS_ABS:g}, {L.LOGIT_BIAS_ABS:g}]")
        pairs.append((tid, float(v)))
    return pairs
