"""OpenAI's Responses API (``POST /v1/responses``), as vLLM serves it, over the chat path: a request's ``input`` and
``instructions`` become chat messages, its ``max_output_tokens``, sampling and ``text.format`` the chat request's
fields, and the answer is a ``response`` object whose ``output`` holds the assistant's message (and its reasoning, with
``--reasoning-parser``). Streamed, the answer is OpenAI's typed events (``response.created`` ...
``response.output_text.delta`` ... ``response.completed``), each with its ``sequence_number``.

Function tools as the chat path serves them (``--enable-auto-tool-choice --tool-call-parser``, which a forced
``tool_choice`` needs too): the request's ``tools`` (``{"type": "function", "name", "parameters"}``) and
``tool_choice`` become the chat request's, the model's calls come out as ``function_call`` items (streamed:
``response.output_item.added``, ``response.function_call_arguments.delta`` and ``.done``), and a conversation goes
on with ``function_call`` and ``function_call_output`` input items (an assistant message's tool calls and a tool
message).

``include: ["message.output_text.logprobs"]`` (or ``top_logprobs`` > 0) gives the output text's logprobs, each token's
with its ``top_logprobs`` alternatives, as chat's ``logprobs`` (with ``--reasoning-parser`` they are the whole
output's, the reasoning's tokens too, as the chat choice's are).

Stored responses, as OpenAI's ``store`` (``Store``): the router keeps the latest ``PUSHKV_RESPONSES_STORE`` (1,024,
within 64 MiB; in its memory, so a router restart forgets them) finished responses of requests that did not say
``store: false``, with the conversation that led to each. ``previous_response_id`` continues one: its conversation and
output come before the new input (its ``instructions`` do not, as OpenAI's). ``GET /v1/responses/ID`` answers a kept
one and ``DELETE`` forgets it; an unknown id is a 404.

Background responses, as OpenAI's and vLLM's ``background: true`` (kept, so never with ``store: false``): the answer is
the response at once, ``queued``, while it generates on; ``GET /v1/responses/ID`` shows it ``in_progress``, then as it
ended, and ``POST /v1/responses/ID/cancel`` stops it (``cancelled``, its blocks freed on every instance). Asked with
``stream: true`` its typed events stream as they are made and are kept (``BackgroundLog``): ``GET
/v1/responses/ID?stream=true&starting_after=N`` streams them again from the one after ``N``, and on as they come, so a
client that lost its stream takes it up where it broke.

Not built, and refused by name with a 400: tools other than functions (web search, file search, MCP, ...),
``conversation`` (conversation objects), ``prompt`` (stored prompts), ``include`` of anything but the
logprobs, and input items other than messages of text and function calls and their outputs."""
from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from typing import Any, Optional, Sequence

from pushkv.router import api
from pushkv.router.output import ChoiceOutput, Delta
from pushkv.router.render import ChatRenderer

# the chat request's fields a Responses request passes on as they are (vLLM's sampling extras among them)
SAMPLING = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "logit_bias", "stop", "stream", "user")
NOT_BUILT = {
    "conversation": "conversation objects are not built: send the input, or previous_response_id",
    "prompt": "stored prompts are not built: send the input",
}
LOGPROBS = "message.output_text.logprobs"  # the one ``include`` built
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


def _refuse_unbuilt(body: dict) -> None:
    for name, why in NOT_BUILT.items():
        value = body.get(name)
        if value not in (None, False, [], {}, ""):
            raise api.bad(name, f"{name}: {why}")


def _content(item: dict, i: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise api.bad("input", f"input[{i}].content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise api.bad("input", f"input[{i}].content[{j}]: only text parts ({', '.join(TEXT_PARTS)}) are taken")
        texts.append(part["text"])
    return "".join(texts)


def _logprobs(body: dict) -> Optional[int]:
    """The top logprobs a token the request asks for (0: the chosen token's only), or None: no logprobs."""
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
            raise api.bad("include", "include must be a list of strings")
        for x in include:
            if x != LOGPROBS:
                raise api.bad("include", f"include {x!r} is not built: only {LOGPROBS!r}")
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)):
        raise api.bad("top_logprobs", "top_logprobs must be an integer")
    if include or (top or 0) > 0:
        return top or 0
    return None


def _tools(body: dict) -> list[dict]:
    """The request's function tools as the chat request's; 400 naming a tool that is no function."""
    given = body.get("tools")
    if given in (None, []):
        return []
    if not isinstance(given, list):
        raise api.bad("tools", "tools must be a list")
    out = []
    for i, t in enumerate(given):
        kind = t.get("type") if isinstance(t, dict) else type(t).__name__
        if kind != "function":
            raise api.bad("tools", f"tools[{i}].type {kind!r}: only function tools are built")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise api.bad("tools", f"tools[{i}].name must be a non-empty string")
        fn = {"name": t["name"], **{k: t[k] for k in ("description", "parameters", "strict") if t.get(k) is not None}}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict, tools: list[dict]) -> Any:
    """The request's tool_choice as the chat request's (a named function: ``{"type": "function", "name"}``), checked
    as vLLM 0.32's Responses request checks it (its check_tool_usage), not as chat's: without tools, ``auto`` (the
    default) and ``none`` are none (None: the chat request gets no tool_choice) and ``required`` or a named tool a 400;
    a named tool that none of the tools is, a 400 too."""
    choice = body.get("tool_choice")
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not tools:
        if choice in (None, "auto", "none"):
            return None
        if choice == "required":
            raise api.bad("tool_choice", "Tool choice 'required' must be specified with 'tools' parameter.")
        if named:
            raise api.bad("tool_choice", "Tool choice 'function' not found in 'tools' parameter.")
    elif isinstance(choice, dict) and named and choice.get("name") not in [t["function"]["name"] for t in tools]:
        raise api.bad("tool_choice", "Tool choice 'function' not found in 'tools' parameter.")
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise api.bad("tool_choice", 'tool_choice must be none, auto, required or {"type": "function", "name": ...}')


def _chat_call(item: dict) -> dict:
    """A ``function_call`` item (input or output) as the chat messages' tool_calls carry a call."""
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _call_item(item: dict, i: int) -> dict:
    """A ``function_call`` input item, checked: the call as the chat messages' tool_calls carry it."""
    for k in ("call_id", "name", "arguments"):
        if not isinstance(item.get(k), str):
            raise api.bad("input", f"input[{i}].{k} must be a string (a function_call item)")
    return _chat_call(item)


class Store:
    """The finished responses kept for ``previous_response_id`` and ``GET /v1/responses/ID``: the latest ``limit``
    within ``max_bytes`` (their JSON), each with the chat messages that led to it; the oldest go first. Shared by
    the parse threads (which read it) and the event loop (which keeps): a lock."""

    def __init__(self, limit: int, max_bytes: int = 64 << 20):
        self.limit, self.max_bytes = limit, max_bytes
        self._kept: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def keep(self, response_: dict, conversation: list[dict]) -> None:
        """A finished response and the conversation (its input's messages, instructions left out) it answered; kept
        without pushkv's own extension, as ``GET /v1/responses/ID`` answers it."""
        response_ = {k: v for k, v in response_.items() if k != "pushkv"}
        size = len(json.dumps(response_)) + len(json.dumps(conversation))
        if not self.limit or size > self.max_bytes:
            return
        with self._lock:
            old = self._kept.pop(response_["id"], None)
            self._bytes -= old[2] if old else 0
            self._kept[response_["id"]] = (response_, conversation, size)
            self._bytes += size
            while len(self._kept) > self.limit or self._bytes > self.max_bytes:
                self._bytes -= self._kept.popitem(last=False)[1][2]

    def get(self, rid: str) -> Optional[dict]:
        with self._lock:
            got = self._kept.get(rid)
        return got[0] if got else None

    def delete(self, rid: str) -> bool:
        with self._lock:
            got = self._kept.pop(rid, None)
            self._bytes -= got[2] if got else 0
        return got is not None

    def restatus(self, rid: str, status: str) -> Optional[dict]:
        """A kept response, its status now ``status`` (a background one as it runs or is cancelled)."""
        with self._lock:
            got = self._kept.get(rid)
            if got is None:
                return None
            changed = {**got[0], "status": status}
            self._kept[rid] = (changed, got[1], got[2])
        return changed

    def conversation(self, rid: str) -> list[dict]:
        """The chat messages that continue response ``rid``: its conversation, then its output (the message's text
        and the calls it made; its reasoning is left out, as chat templates leave it); 404 where it is not kept."""
        with self._lock:
            got = self._kept.get(rid)
        if got is None:
            raise api.ApiError(404, f"previous_response_id {rid!r}: no such response is kept (they are kept in the "
                                    "router's memory, the latest ones; store: false keeps none)",
                               param="previous_response_id")
        response_, before, _ = got
        said: Optional[str] = None  # the output message's text, where there is one
        calls = []
        for item in response_.get("output", ()):
            if item.get("type") == "message":
                said = (said or "") + "".join(p.get("text", "") for p in item["content"])
            elif item.get("type") == "function_call":
                calls.append(_chat_call(item))
        if said is None and not calls:
            return list(before)
        answer: dict[str, Any] = {"role": "assistant", "content": said}
        if calls:  # the text and the calls of one turn: one assistant message, as chat gives them
            answer["tool_calls"] = calls
        return [*before, answer]


def _instructions(body: dict) -> list[dict]:
    instructions = body.get("instructions")
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise api.bad("instructions", "instructions must be a string")
    return [{"role": "system", "content": instructions}]


def _messages(body: dict) -> list[dict]:
    """The input's messages (the instructions apart)."""
    messages: list[dict[str, Any]] = []
    given = body.get("input")
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise api.bad("input", "input must be a string or a non-empty list of messages")
    for i, item in enumerate(given):
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        if kind == "function_call":  # the model's call: one assistant message carries a run of them
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(_call_item(item, i))
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [_call_item(item, i)]})
            continue
        if kind == "function_call_output":  # what the call returned
            if not isinstance(item.get("call_id"), str):
                raise api.bad("input", f"input[{i}].call_id must be a string (a function_call_output item)")
            out = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": out if isinstance(out, str) else _content({"content": out}, i)})
            continue
        if kind != "message":
            raise api.bad("input", f"input[{i}]: only messages, function_call and function_call_output items are "
                                   f"taken, not {kind}")
        role = ROLES.get(item.get("role", ""))
        if role is None:
            raise api.bad("input", f"input[{i}].role must be one of {sorted(ROLES)}, got {item.get('role')!r}")
        messages.append({"role": role, "content": _content(item, i)})
    return messages


def _response_format(body: dict) -> Optional[dict]:
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise api.bad("text", "text.format.schema must be a JSON schema object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt["schema"],
                                                        "strict": fmt.get("strict", False)}}
    raise api.bad("text", f"text.format.type must be text, json_object or json_schema, got {kind!r}")


def conversation(body: dict, store: Optional[Store] = None) -> list[dict]:
    """The messages a request answers, its instructions left out: those of its ``previous_response_id`` (from
    ``store``), then its input's."""
    prev = body.get("previous_response_id")
    if prev is None:
        return _messages(body)
    if not isinstance(prev, str):
        raise api.bad("previous_response_id", "previous_response_id must be a string")
    if store is None:
        raise api.ApiError(404, f"previous_response_id {prev!r}: this router keeps no responses "
                                "(PUSHKV_RESPONSES_STORE=0)", param="previous_response_id")
    return store.conversation(prev) + _messages(body)


def chat_body(body: dict, store: Optional[Store] = None, conv: Optional[list[dict]] = None) -> dict:
    """The chat completion request a Responses request stands for (``conv``: its ``conversation``, where the caller
    has it); ApiError (400) naming a field not built here."""
    _refuse_unbuilt(body)
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise api.bad("store", "store must be true or false")
    out: dict[str, Any] = {k: body[k] for k in SAMPLING if k in body}
    out["messages"] = _instructions(body) + (conversation(body, store) if conv is None else conv)
    tools = _tools(body)
    if tools:
        out["tools"] = tools
    choice = _tool_choice(body, tools)
    if choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("include_reasoning") is not None:  # vLLM's: false, the reasoning generated but not returned
        out["include_reasoning"] = body["include_reasoning"]
    top = _logprobs(body)
    if top is not None:
        out["logprobs"], out["top_logprobs"] = True, top
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    fmt = _response_format(body)
    if fmt is not None:
        out["response_format"] = fmt
    effort = _reasoning_effort(body)
    if effort is not None:
        out["reasoning_effort"] = effort
    return out


def _reasoning_effort(body: dict) -> Optional[str]:
    """``reasoning.effort``: the chat request's ``reasoning_effort``, as vLLM passes it to the template."""
    given = body.get("reasoning")
    if given is None:
        return None
    if not isinstance(given, dict):
        raise api.bad("reasoning", "reasoning must be an object")
    return given.get("effort")


def echo(body: dict) -> dict:
    """The request's settings a response object repeats."""
    given = body.get("text")
    text: dict = given if isinstance(given, dict) else {}
    return {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            # as given; absent, the deployment's default ran (the checkpoint's, else greedy), which null says
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "text": {"format": text.get("format") or {"type": "text"}}, "metadata": body.get("metadata") or {},
            "user": body.get("user"), "tools": body.get("tools") or [], "top_logprobs": body.get("top_logprobs"),
            # as vLLM's: none without tools, whatever was asked (a choice that needs tools was a 400)
            "tool_choice": (body.get("tool_choice") or "auto") if body.get("tools") else "none",
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "store": False,
            "background": bool(body.get("background")), "reasoning": body.get("reasoning")}


def usage(chat_usage: dict) -> dict:
    """A chat usage as the Responses API writes it."""
    out = {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
           "total_tokens": chat_usage["total_tokens"], "output_tokens_details": {
               "reasoning_tokens": (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)}}
    details = chat_usage.get("prompt_tokens_details")
    # (cache_write_tokens: what the openai package's types ask for; nothing is written to a cache but the prefix's)
    out["input_tokens_details"] = {"cached_tokens": details["cached_tokens"] if details else 0,
                                   "cache_write_tokens": 0}
    return out


def response(rid: str, created: int, model: str, settings: dict, output: list[dict], status: str,
             usage_: Optional[dict], incomplete: Optional[str] = None, error: Optional[dict] = None) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "usage": usage_, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None, "parallel_tool_calls": True,
            "tool_choice": "none", "tools": [], "previous_response_id": None, "store": False, "truncation": "disabled",
            "reasoning": None, **settings}


def message_item(rid: str, text: str, status: str = "completed", logprobs: Optional[list] = None) -> dict:
    return {"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant",
            "content": [output_text(text, logprobs)] if status == "completed" else []}


def reasoning_item(rid: str, text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{rid}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def call_item(rid: str, n: int, call: dict, status: str = "completed") -> dict:
    """The model's n-th call of a response (a chat tool call) as a ``function_call`` output item."""
    fn = call.get("function") or {}
    return {"type": "function_call", "id": f"fc_{rid}_{n}", "call_id": call.get("id") or f"call_{rid}_{n}",
            "name": fn.get("name", ""), "arguments": fn.get("arguments", "") if status == "completed" else "",
            "status": status}


def output_text(text: str, logprobs: Optional[list] = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], **({"logprobs": logprobs} if logprobs else {})}


def status_of(finish_reason: Optional[str]) -> tuple[str, Optional[str]]:
    """(status, incomplete reason) of a response whose one choice ended so."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


class ResponsesRenderer(ChatRenderer):
    """The chat renderer's text and reasoning, in a response object (unary) or OpenAI's typed events (streamed:
    ``ResponseEvents``)."""

    id_prefix = "resp"
    object = "response"
    chunk_object = "response"

    def __init__(self, tok, params: api.CompletionParams):
        super().__init__(tok, params)
        self.settings: dict = params.responses or {}

    def request_id(self, transfer_id: str) -> str:
        return f"resp_{transfer_id}"

    def unary_body(self, rid: str, created: int, model: str, outs: Sequence[ChoiceOutput], usage_: dict,
                   extension: dict) -> dict:
        out = outs[0]
        choice = self.choice(out)
        message = choice["message"]  # the chat choice's content, and its reasoning apart where parsed
        logprobs = (choice.get("logprobs") or {}).get("content")
        thought = message.get("reasoning_content")
        items = [reasoning_item(rid, thought)] if thought else []
        calls = message.get("tool_calls") or []
        if message["content"] or not calls:
            items.append(message_item(rid, message["content"] or "", logprobs=logprobs))
        items += [call_item(rid, n, c) for n, c in enumerate(calls)]
        status, incomplete = status_of(out.finish_reason)
        return {**response(rid, created, model, self.settings, items, status, usage(usage_), incomplete),
                "pushkv": extension}


class ResponseEvents:
    """One streamed response's typed events, from its choice's deltas: the message item opened with its first text,
    a reasoning item before it with its first thought (``--reasoning-parser``), each delta an event, and the items
    and the response closed at the end."""

    def __init__(self, render: ResponsesRenderer, rid: str, created: int, model: str):
        self.render, self.rid, self.created, self.model = render, rid, created, model
        self.seq = 0
        self.items: list[dict] = []  # closed ones, in order
        self.open: Optional[str] = None  # "reasoning", "message" or "call"
        self.call: dict = {}  # the open call's item
        self.text = ""
        self.calls = 0
        self.logprobs: list[dict] = []  # the open message's, so far
        self.pending: list[dict] = []  # tokens' logprobs whose text has not gone out yet

    def _ev(self, kind: str, **fields: Any) -> tuple[str, dict]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return kind, ev

    def _response(self, status: str, usage_: Optional[dict] = None, incomplete: Optional[str] = None,
                  error: Optional[dict] = None) -> dict:
        return response(self.rid, self.created, self.model, self.render.settings, list(self.items), status, usage_,
                        incomplete, error)

    def start(self) -> list[tuple[str, dict]]:
        return [self._ev("response.created", response=self._response("in_progress")),
                self._ev("response.in_progress", response=self._response("in_progress"))]

    def _item_id(self) -> str:
        return f"{'rs' if self.open == 'reasoning' else 'msg'}_{self.rid}"

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        idx, iid, text = len(self.items), self._item_id(), self.text
        if self.open == "call":  # its arguments are whole now
            item = dict(self.call, arguments=text, status="completed")
            evs = [self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                            arguments=text)]
        elif self.open == "reasoning":
            item = reasoning_item(self.rid, text)
            evs = [self._ev("response.reasoning_text.done", item_id=iid, output_index=idx, content_index=0,
                            text=text)]
        else:
            lps, self.logprobs, self.pending = self.logprobs + self.pending, [], []
            item = message_item(self.rid, text, logprobs=lps)
            evs = [self._ev("response.output_text.done", item_id=iid, output_index=idx, content_index=0, text=text,
                            logprobs=lps),
                   self._ev("response.content_part.done", item_id=iid, output_index=idx, content_index=0,
                            part=output_text(text, lps))]
        evs.append(self._ev("response.output_item.done", output_index=idx, item=item))
        self.items.append(item)
        self.open, self.text = None, ""
        return evs

    def _feed(self, kind: str, text: str) -> list[tuple[str, dict]]:
        evs: list[tuple[str, dict]] = []
        if self.open != kind:
            evs += self._close()
            self.open = kind
            idx, iid = len(self.items), self._item_id()
            if kind == "reasoning":
                evs.append(self._ev("response.output_item.added", output_index=idx,
                                    item={"type": "reasoning", "id": iid, "summary": [], "content": [],
                                          "status": "in_progress"}))
            else:
                evs.append(self._ev("response.output_item.added", output_index=idx,
                                    item=message_item(self.rid, "", "in_progress")))
                evs.append(self._ev("response.content_part.added", item_id=iid, output_index=idx, content_index=0,
                                    part=output_text("")))
        if text:
            self.text += text
            kind_ev = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra: dict = {}
            if kind == "message":  # the logprobs of the tokens whose text this is (and of any held back before it)
                extra["logprobs"], self.pending = self.pending, []
                self.logprobs += extra["logprobs"]
            evs.append(self._ev(kind_ev, item_id=self._item_id(), output_index=len(self.items), content_index=0,
                                delta=text, **extra))
        return evs

    def _call(self, call: dict) -> list[tuple[str, dict]]:
        """A piece of a call the model made, as the chat stream gives it: a call's first (its ``id``) adds its item,
        each piece's arguments are a delta, and the call is done when the next item opens or the response ends (the
        chat stream gives a forced tool choice's call in pieces, a parser's whole)."""
        evs: list[tuple[str, dict]] = []
        if "id" in call:
            evs += self._close()
            self.open, self.text = "call", ""
            self.call = call_item(self.rid, self.calls, call, "in_progress")
            self.calls += 1
            evs.append(self._ev("response.output_item.added", output_index=len(self.items), item=self.call))
        args = (call.get("function") or {}).get("arguments") or ""
        if args and self.open == "call":
            self.text += args
            evs.append(self._ev("response.function_call_arguments.delta", item_id=self.call["id"],
                                output_index=len(self.items), delta=args))
        return evs

    def delta(self, delta: Delta) -> list[tuple[str, dict]]:
        final = bool(delta.finish_reason)
        chunk = self.render.chunk_choice(0, delta)
        if chunk is None:  # reasoning alone that include_reasoning false hides
            return []
        d = chunk["delta"]  # the chat chunk's content, its reasoning and calls apart
        self.pending += (chunk.get("logprobs") or {}).get("content") or []
        thought, text = d.get("reasoning_content", ""), d.get("content", "")
        evs = self._feed("reasoning", thought) if thought else []
        if text or (final and self.open != "message" and not self.calls
                    and not any(i["type"] == "message" for i in self.items)):
            evs += self._feed("message", text)
        for call in d.get("tool_calls", ()):
            evs += self._call(call)
        return evs

    def finish(self, finish_reason: Optional[str], usage_: dict, extension: dict) -> list[tuple[str, dict]]:
        evs = self._close()
        status, incomplete = status_of(finish_reason)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        body = {**self._response(status, usage(usage_), incomplete), "pushkv": extension}
        return evs + [self._ev(kind, response=body)]

    def failed(self, status: int, reason: str) -> list[tuple[str, dict]]:
        code = "server_error" if status >= 500 else "invalid_request"
        return [self._ev("response.failed", response=self._response("failed", error={"code": code,
                                                                                       "message": reason}))]


class BackgroundLog:
    """A streamed background response's typed events, kept as they are made, so that ``GET
    /v1/responses/ID?stream=true&starting_after=N`` streams them again from the one after ``N`` and follows the rest.
    Its events are the stream's own (each ``sequence_number`` its index here)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.ended = False
        self._more = asyncio.Event()

    def add(self, kind: str, body: dict) -> None:
        self.events.append((kind, body))
        self._more.set()

    def end(self) -> None:
        self.ended = True
        self._more.set()

    async def follow(self, after: int = -1):
        """The events after sequence number ``after``, then each as it comes, until the response ends."""
        i = after + 1
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.ended:
                return
            self._more.clear()
            await self._more.wait()
