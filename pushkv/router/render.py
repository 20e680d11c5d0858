"""One renderer per endpoint: the OpenAI shapes of ``/v1/completions`` and ``/v1/chat/completions``
(pure, no I/O). ``generate.Generation`` drives a choice's text through ``output.ChoiceOutput`` and hands
each piece to its endpoint's renderer; what differs between the two endpoints (the response's object
and id, the logprob shape, echo, the opening chunk, where usage goes, where vLLM's prompt logprobs go)
lives here and nowhere else.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import ClassVar, Optional, Protocol, Sequence

from pushkv.messages import PromptLogprobs, TokenLogprob
from pushkv.prompt_logprobs import Position, positions
from pushkv.router import reasoning, tool_calls, tool_choice
from pushkv.router.api import CompletionParams
from pushkv.router.output import ChoiceOutput, Delta, StopReason
from pushkv.router.text import IncrementalDecoder, Tokenizer

FLOOR_LOGPROB = -9999.0  # JSON has no -inf


class Decoder(Protocol):
    """What writes a logprob's token: a tokenizer, or ``TokenIds``."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class TokenIds:
    """vLLM's ``return_tokens_as_token_ids``: a logprob's token is written ``token_id:N`` (what a client maps back
    to an id whatever the bytes decode to), offsets and bytes following that text; the logprobs' shapes take it
    where they take a tokenizer."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"token_id:{i}" for i in ids)


class Renderer:
    """What both endpoints share: the body around the choices, and the logprobs the request asked for."""

    id_prefix: ClassVar[str]
    object: ClassVar[str]  # a whole response's
    chunk_object: ClassVar[str]  # a streamed chunk's

    def __init__(self, tok: Tokenizer, params: CompletionParams):
        self.tok = tok
        self.params = params
        self.want_logprobs = params.sampling.logprobs >= 0
        # what writes a logprob's token (the prompt logprobs of vLLM's own shape keep the decoded text, as vLLM's)
        self.token_text: Decoder = TokenIds() if params.return_tokens_as_token_ids else tok

    def request_id(self, transfer_id: str) -> str:
        return f"{self.id_prefix}-{transfer_id}"

    def body(self, request_id: str, created: int, model: str, choices: list[dict], chunk: bool,
             usage_: Optional[dict] = None, extension: Optional[dict] = None) -> dict:
        return body(request_id, created, model, self.chunk_object if chunk else self.object, choices, usage_,
                    extension)

    def logprobs(self, i: int, delta: Delta) -> Optional[dict]:
        return self._logprobs(i, delta) if self.want_logprobs else None

    def _logprobs(self, i: int, delta: Delta) -> dict:
        raise NotImplementedError

    def choice(self, out: ChoiceOutput) -> dict:
        """A whole choice of a unary response."""
        raise NotImplementedError

    def response_fields(self, outs: Sequence[ChoiceOutput]) -> dict:
        """What a unary response adds beside its choices (chat: vLLM's ``prompt_logprobs``)."""
        return {}

    def usage_details(self, outs: Sequence[ChoiceOutput]) -> Optional[dict]:
        """The usage's ``completion_tokens_details``, where the endpoint has them (chat with a reasoning parser)."""
        return None

    def opening_fields(self) -> dict:
        """What a stream's opening chunk adds beside its choice (chat: vLLM's ``prompt_token_ids``)."""
        return {}

    def openings(self, out: ChoiceOutput) -> list[dict]:
        """The choices of the chunks that open a choice's stream, before its first output's (called with that output:
        the prompt's logprobs have come by then)."""
        raise NotImplementedError

    def chunk_choice(self, i: int, delta: Delta) -> Optional[dict]:
        """A delta's choice; None where it shows nothing (chat's reasoning that include_reasoning hides)."""
        raise NotImplementedError

    def extension_in_last_chunk(self) -> bool:
        """Whether the chunk that ends the choice carries pushkv's extension (usage goes where vLLM's goes:
        ``generate.Generation._stream_delta``)."""
        return False


class CompletionRenderer(Renderer):
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, tok: Tokenizer, params: CompletionParams):
        super().__init__(tok, params)
        # echo: each choice's prompt text (a batch's prompt p for choices p * n ... p * n + n - 1)
        echoed = [text_ if params.echo else "" for _, text_ in params.prompts() for _ in range(params.n)]
        self.offsets = [len(p) for p in echoed]  # text_offset runs on across a choice's deltas, after the prompt's
        # vLLM's echo with return_token_ids: the prompt comes back as its ids (prompt_token_ids), its text not at all
        # (the logprobs still score its tokens first)
        self.prefixes = ["" for _ in echoed] if params.return_token_ids else echoed
        self.opened: set[int] = set()  # choices whose first chunk went (vLLM's prompt_token_ids ride on it)
        # echo: a choice's prompt (its text, its logprobs where asked), waiting for the choice's first output's chunk
        self.echoes: dict[int, tuple[str, Optional[dict]]] = {}

    def _logprobs(self, i: int, delta: Delta) -> dict:
        lp = completion_logprobs(self.token_text, delta.token_ids, delta.logprobs, self.offsets[i])
        self.offsets[i] += sum(len(s) for s in lp["tokens"])
        return lp

    def _prompt(self, out: ChoiceOutput) -> list[int]:
        return self.params.prompts()[out.index // self.params.n][0]

    def _echoed(self, out: ChoiceOutput) -> Optional[dict]:
        """The prompt's part of an echoed choice's logprobs (its first token's null, as OpenAI's)."""
        if not (self.params.echo and self.want_logprobs):
            return None
        return completion_prompt_logprobs(self.token_text, self._prompt(out), out.prompt_logprobs)

    def choice(self, out: ChoiceOutput) -> dict:
        lp = self.logprobs(out.index, Delta(out.text, out.token_ids, out.logprobs))
        echoed = self._echoed(out)
        if echoed is not None and lp is not None:  # the prompt's tokens, then the output's
            lp = {k: echoed[k] + lp[k] for k in lp}
        body = completion_choice(out.index, self.prefixes[out.index] + out.text, out.token_ids, out.finish_reason,
                                 lp, out.stop_reason)
        if self.params.return_token_ids:
            body["prompt_token_ids"] = self._prompt(out)
        if self.params.sampling.prompt_logprobs >= 0:  # vLLM's, whenever they were computed
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.tok, self._prompt(out), out.prompt_logprobs)
        return body

    def openings(self, out: ChoiceOutput) -> list[dict]:
        """None: an echoed prompt goes out in the chunk of the choice's first output, its text before the output's
        and its tokens' logprobs before the output's, as vLLM's stream sends it (never a chunk of its own)."""
        if self.params.echo:
            self.echoes[out.index] = (self.prefixes[out.index], self._echoed(out))
        return []

    def chunk_choice(self, i: int, delta: Delta) -> dict:
        lp = self.logprobs(i, delta)
        prompt, echoed = self.echoes.pop(i, ("", None))
        if echoed is not None and lp is not None:  # the prompt's tokens, then the output's
            lp = {k: echoed[k] + lp[k] for k in lp}
        return self._first(i, completion_choice(i, prompt + delta.text, delta.token_ids, delta.finish_reason, lp,
                                                delta.stop_reason))

    def _first(self, i: int, choice: dict) -> dict:
        """vLLM's return_token_ids: a choice's first chunk carries its prompt's ids."""
        if self.params.return_token_ids and i not in self.opened:
            choice["prompt_token_ids"] = self.params.prompts()[i // self.params.n][0]
        self.opened.add(i)
        return choice

    def extension_in_last_chunk(self) -> bool:
        return self.params.choices == 1  # pushkv's habit: one choice's last chunk carries the extension


class ChatRenderer(Renderer):
    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, tok: Tokenizer, params: CompletionParams):
        super().__init__(tok, params)
        parser = params.reasoning_parser  # each choice's thinking apart (router/reasoning.py)
        self.splitters = [reasoning.Splitter(parser, params.reasons) for _ in range(params.choices)] if parser else []
        # vLLM's include_reasoning false: the reasoning left out, and the logprobs and ids that would spell it
        self.hide_reasoning = bool(parser) and not params.include_reasoning
        self.want_logprobs = self.want_logprobs and not self.hide_reasoning
        # the tool calls each choice's content writes (router/tool_calls.py)
        self.tools = ([tool_calls.streamer(params.tool_call_parser, params.tools) for _ in range(params.choices)]
                      if params.tool_call_parser else [])
        # each choice's tokens so far, where each begins in its text (``_reasoning_tokens``: counted in every chunk
        # with continuous usage, so each token is read once)
        self.token_starts: list[list[int]] = [[] for _ in range(params.choices)]
        self.written = [0] * params.choices
        self.decoders: list[Optional[IncrementalDecoder]] = [None] * params.choices

    def _logprobs(self, i: int, delta: Delta) -> dict:
        return chat_logprobs(self.token_text, delta.token_ids, delta.logprobs)

    def choice(self, out: ChoiceOutput) -> dict:
        lp = self.logprobs(out.index, Delta(out.text, out.token_ids, out.logprobs))
        p = self.params
        thought, content = (reasoning.split(out.text, p.reasoning_parser, p.reasons) if self.splitters
                            else (None, out.text))
        calls: list[dict] = []
        parser = self.params.tool_call_parser
        if self.tools:
            content, calls = tool_calls.parse(content or "", parser, self.params.tools)
            calls = calls if self.params.parallel_tool_calls else calls[:1]  # vLLM's: false keeps the first
            if tool_choice.forced(parser):  # vLLM's forced choice: its output is calls, its content ""
                content = content or ""
        if self.params.echo_text:  # vLLM's echo: the continued message first
            content = self.params.echo_text + (content or "")
        body = chat_choice(out.index, content, _finish(out.finish_reason, bool(calls) and tool_choice.ends_with_calls(
            parser)), lp, out.stop_reason)
        if self.params.return_token_ids and not self.hide_reasoning:  # vLLM's: the choice's output ids
            body["token_ids"] = out.token_ids
        if self.splitters:  # vLLM 0.32's name, and the older one clients written before it read
            body["message"]["reasoning"] = body["message"]["reasoning_content"] = (None if self.hide_reasoning
                                                                                    else thought)
        if calls:  # vLLM's message leaves tool_calls out where there are none
            body["message"]["tool_calls"] = calls
        return body

    def usage_details(self, outs: Sequence[ChoiceOutput]) -> Optional[dict]:
        """vLLM's, with a reasoning parser: the output tokens that wrote the choices' reasoning (its tags not), whether
        it is returned or not (a stream's continuous usage: one choice's so far; its opening chunk: none, 0)."""
        return {"reasoning_tokens": sum(self._reasoning_tokens(o) for o in outs)} if self.splitters else None

    def _reasoning_tokens(self, out: ChoiceOutput) -> int:
        """The tokens of ``out`` that begin inside its reasoning's text (a token whose bytes end a character later
        begins where it stands)."""
        i = out.index
        detok = self.decoders[i]
        if detok is None:
            detok = self.decoders[i] = IncrementalDecoder(self.tok, self.params.skip_special_tokens,
                                                          self.params.spaces_between_special_tokens)
        starts = self.token_starts[i]
        for t in out.token_ids[len(starts):]:  # (the tokens come since the last count)
            starts.append(self.written[i])
            self.written[i] += len(detok.push([t]))
        start, end = reasoning.span(out.text, self.params.reasoning_parser, self.params.reasons)
        return bisect_left(starts, end) - bisect_left(starts, start)  # (starts ascend)

    def response_fields(self, outs: Sequence[ChoiceOutput]) -> dict:
        out = self.opening_fields()
        if self.params.sampling.prompt_logprobs >= 0:
            ids, prompt = self.params.prompt_token_ids, outs[0].prompt_logprobs  # every choice's prompt: one list
            out["prompt_logprobs"] = vllm_prompt_logprobs(self.tok, ids, prompt)
        return out

    def opening_fields(self) -> dict:
        return {"prompt_token_ids": self.params.prompt_token_ids} if self.params.return_token_ids else {}

    def openings(self, out: ChoiceOutput) -> list[dict]:
        """vLLM's: the role (content ""), then with echo the continued message's text in a chunk of its own."""
        role = chat_chunk_choice(out.index, {"role": "assistant", "content": ""}, None)
        echo = self.params.echo_text
        return [role, chat_chunk_choice(out.index, {"content": echo}, None)] if echo else [role]

    def chunk_choice(self, i: int, delta: Delta) -> Optional[dict]:
        # text held back as a possible tag goes out with the choice's last delta
        final = bool(delta.finish_reason)
        thought, text = self.splitters[i].feed(delta.text, final) if self.splitters else ("", delta.text)
        calls: list[dict] = []
        # the calls are read from the content, once the reasoning ended (vLLM's: a forced call opens with the answer)
        if self.tools and (text or final or not self.splitters or self.splitters[i].phase == "content"):
            text, calls = self.tools[i].feed(text, final)
            calls = calls if self.params.parallel_tool_calls else [c for c in calls if c["index"] == 0]
        if self.hide_reasoning:
            if not (text or calls or final):  # reasoning alone: no chunk, as vLLM's
                return None
            thought = ""
        # a tool call parser that holds the text back (a call not yet whole, a forced call's JSON not yet named) says
        # nothing: no chunk, as vLLM's, unless its tokens' logprobs or ids must go out (then an empty delta)
        held = bool(self.tools) and not (text or calls or thought or final)
        if held and not (self.want_logprobs or (self.params.return_token_ids and not self.hide_reasoning)):
            return None
        d: dict = {"reasoning": thought, "reasoning_content": thought} if thought else {}
        if text or not (thought or calls or final or held):
            d["content"] = text
        if calls:
            d["tool_calls"] = calls
        called = bool(self.tools) and self.tools[i].calls > 0 and tool_choice.ends_with_calls(
            self.params.tool_call_parser)
        choice = chat_chunk_choice(i, d, _finish(delta.finish_reason, called), self.logprobs(i, delta),
                                   delta.stop_reason)
        if self.params.return_token_ids and not self.hide_reasoning:  # vLLM's: the delta's output ids
            choice["token_ids"] = list(delta.token_ids)
        return choice


def _finish(reason: Optional[str], called: bool) -> Optional[str]:
    """A choice that called tools and stopped by itself ends with ``tool_calls``, as vLLM's and OpenAI's do (``called``
    false for a named function's call, which ends with ``stop``)."""
    return "tool_calls" if called and reason == "stop" else reason


def for_endpoint(tok: Tokenizer, params: CompletionParams) -> Renderer:
    if params.responses is not None:
        from pushkv.router.responses import ResponsesRenderer  # (it builds on the chat renderer here)

        return ResponsesRenderer(tok, params)
    return (ChatRenderer if params.chat else CompletionRenderer)(tok, params)


# ---------------------------------------------------------------------------
# Logprobs in the two OpenAI shapes
# ---------------------------------------------------------------------------
def _lp(x: float) -> float:
    return x if x > FLOOR_LOGPROB else FLOOR_LOGPROB


def completion_logprobs(tok: Decoder, ids: Sequence[int], lps: Sequence[TokenLogprob],
                        offset: int = 0) -> dict:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` of /v1/completions."""
    tokens = [tok.decode([i]) for i in ids]
    tops = [_top_entry(tok, i, lp.logprob, lp.top_ids, lp.top_logprobs) for i, lp in zip(ids, lps)]
    return {"tokens": tokens, "token_logprobs": [_lp(lp.logprob) for lp in lps],
            "top_logprobs": tops, "text_offset": _offsets(tokens, offset)}


def _top_entry(tok: Decoder, tid: int, logprob: float, top_ids: Sequence[int], top_logprobs: Sequence[float]
               ) -> dict:
    """A completions top_logprobs entry: the token's own first, then the N most likely (N + 1 at most, as OpenAI's
    and vLLM's; token strings that collide keep one)."""
    return {tok.decode([t]): _lp(v) for t, v in [(tid, logprob), *zip(top_ids, top_logprobs)]}


def _offsets(tokens: Sequence[str], start: int) -> list[int]:
    """Each token's text offset, the first at ``start``."""
    out = []
    for s in tokens:
        out.append(start)
        start += len(s)
    return out


def _scored(ids: Sequence[int], plp: Optional[PromptLogprobs]) -> list[Optional[tuple[int, Position]]]:
    """Per prompt token: (its id, its scored position), or None where nothing scored it (the first)."""
    if plp is None:  # the router refuses a choice without them before it renders (request.py)
        raise ValueError("prompt logprobs asked for and missing")
    got = positions(plp)
    if plp.start + len(got) != len(ids):
        raise ValueError(f"prompt logprobs cover {plp.start} + {len(got)} positions of a {len(ids)}-token prompt")
    return [None] * plp.start + list(zip(ids[plp.start:], got))


def completion_prompt_logprobs(tok: Decoder, ids: Sequence[int], plp: Optional[PromptLogprobs]) -> dict:
    """An echoed prompt's part of /v1/completions' logprobs, as OpenAI's legacy completions and vLLM give
    it: each prompt token, its logprob (the first's null) and a top entry of the token and the N most
    likely (the first's null); text offsets from the prompt's start."""
    tokens = [tok.decode([i]) for i in ids]
    lps: list[Optional[float]] = []
    tops: list[Optional[dict]] = []
    for entry in _scored(ids, plp):
        if entry is None:
            lps.append(None)
            tops.append(None)
            continue
        tid, p = entry
        lps.append(_lp(p.logprob))
        tops.append(_top_entry(tok, tid, p.logprob, p.top_ids, p.top_logprobs))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": _offsets(tokens, 0)}


def vllm_prompt_logprobs(tok: Tokenizer, ids: Sequence[int], plp: Optional[PromptLogprobs]) -> list[Optional[dict]]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first: null) a map of token id (as a string)
    to ``{logprob, rank, decoded_token}``: the prompt's token with its rank, then the N most likely
    with ranks 1..N (the prompt's token among them keeps its place and takes theirs, as vLLM's dict does)."""
    out: list[Optional[dict]] = []
    for entry in _scored(ids, plp):
        if entry is None:
            out.append(None)
            continue
        tid, p = entry
        d = {str(tid): {"logprob": _lp(p.logprob), "rank": p.rank, "decoded_token": tok.decode([tid])}}
        for rank, (t, v) in enumerate(zip(p.top_ids, p.top_logprobs), 1):
            d[str(t)] = {"logprob": _lp(v), "rank": rank, "decoded_token": tok.decode([t])}
        out.append(d)
    return out


def chat_logprobs(tok: Decoder, ids: Sequence[int], lps: Sequence[TokenLogprob]) -> dict:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` of /v1/chat/completions."""
    def entry(t: int, v: float) -> dict:
        s = tok.decode([t])
        return {"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8"))}

    content = []
    for i, lp in zip(ids, lps):
        e = entry(i, lp.logprob)
        e["top_logprobs"] = [entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]
        content.append(e)
    return {"content": content}


# ---------------------------------------------------------------------------
# Response bodies
# ---------------------------------------------------------------------------
def completion_choice(index: int, text_: str, token_ids: list[int], finish_reason: Optional[str],
                      logprobs: Optional[dict] = None, stop_reason: StopReason = None) -> dict:
    """A completion choice (whole or a chunk's); ``stop_reason`` vLLM's (``output.ChoiceOutput.stop_reason``)."""
    return {"index": index, "text": text_, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "token_ids": token_ids}


def chat_choice(index: int, content: Optional[str], finish_reason: Optional[str],
                logprobs: Optional[dict] = None, stop_reason: StopReason = None) -> dict:
    """A chat choice; ``stop_reason`` vLLM's, as in ``completion_choice``."""
    return {"index": index, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_chunk_choice(index: int, delta: dict, finish_reason: Optional[str], logprobs: Optional[dict] = None,
                      stop_reason: StopReason = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def body(request_id: str, created: int, model: str, obj: str, choices: list[dict],
         usage_: Optional[dict] = None, extension: Optional[dict] = None) -> dict:
    out = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    if extension is not None:
        out["pushkv"] = extension
    return out
