"""``/v1/chat/completions``: messages -> prompt through a chat template (pure, no I/O
beyond reading the checkpoint's template once at start).

A checkpoint's template comes from ``chat_template.jinja`` (and transformers' named templates beside it in
``additional_chat_templates/``) or the ``chat_template`` field of ``tokenizer_config.json`` (a string, or a list
of named templates of which ``default`` is taken), rendered with jinja2 in a
sandbox as transformers does (``trim_blocks``, ``lstrip_blocks``,
``raise_exception``). The random presets get a plain template: one ``role: content`` line per message, then
``assistant:``; a checkpoint without one gets none, and a chat request is refused as vLLM refuses it
(:data:`NO_TEMPLATE`), not rendered through a template the model never saw.

What a tool-calling template reads is passed to it as transformers'
``apply_chat_template`` passes it: ``tools`` (None when there are none; the
``tool_use`` named template, where there is one, when there are), and each
message's ``name``, ``tool_call_id`` and ``tool_calls`` (a call's JSON-string
arguments as an object).

An assistant message's ``reasoning`` (or ``reasoning_content``) reaches the template under both names, as vLLM
gives it (Qwen3's template writes it back as ``<think>`` for the turns after the last user message).

A request's ``chat_template_kwargs`` (vLLM's: Qwen3's ``enable_thinking``, a template's own switches)
are passed to the template beside these, and its ``add_generation_prompt`` (default true) as given;
``--chat-template`` replaces the checkpoint's template at launch. A request's own ``chat_template``
and ``continue_final_message`` are refused, not ignored.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Optional

import msgspec

from pushkv import limits as L
from pushkv.model.tokenizer import special_tokens
from pushkv.router import api, reasoning, structured, text, tool_calls, tool_choice

ROLES = ("system", "developer", "user", "assistant", "tool")
ADDITIONAL_TEMPLATES = "additional_chat_templates"  # transformers' directory of named templates (tool_use.jinja)
# vLLM's words (its ChatTemplateResolutionError, a 400) for a chat request to a tokenizer that has no template
NO_TEMPLATE = ("As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat "
               "template if the tokenizer does not define one.")
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class TemplateError(Exception):
    pass


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", name: str = "plain"):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template {name!r} does not compile: {e}") from None
        self.bos_token, self.eos_token, self.name = bos_token, eos_token, name
        self.tool_use: Optional["ChatTemplate"] = None  # the checkpoint's "tool_use" template, if named

    def for_tools(self, tools: bool) -> "ChatTemplate":
        return self.tool_use if tools and self.tool_use is not None else self

    def render(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
               **extra) -> str:
        """The messages as the template writes them; ``continue_final_message`` (vLLM's and transformers'): the
        last message left open, the text cut right after its content, so the model goes on with it."""
        import jinja2

        if continue_final_message and add_generation_prompt:
            raise api.bad("continue_final_message", "continue_final_message and add_generation_prompt cannot both be "
                                                    "true (set add_generation_prompt false)")
        try:
            out = self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except TemplateError as e:
            raise api.bad("messages", f"the chat template refused the messages: {e}") from None
        except jinja2.TemplateError as e:
            raise api.bad("messages", f"the chat template failed on the messages: {e}") from None
        return open_final(out, messages[-1]["content"]) if continue_final_message else out


def open_final(rendered: str, final: str) -> str:
    """The rendered chat cut right after the final message's content, as transformers' continue_final_message cuts
    it: at its last occurrence, the content's trailing spaces kept where the template kept them."""
    core = final.strip()
    if not core or core not in rendered:
        raise api.bad("continue_final_message", "continue_final_message needs a final message whose text the "
                                                "chat template writes")
    at = rendered.rindex(core)
    kept = final.lstrip()
    return rendered[:at + len(kept)] if rendered[at:at + len(kept)] == kept else rendered[:at + len(core)]


def load_template(checkpoint: str, given: str = "") -> Optional[ChatTemplate]:
    """``given`` (--chat-template's text) with the checkpoint's special tokens, else the
    checkpoint's chat template; the plain one where there is no checkpoint (a preset), None where the
    checkpoint has no template."""
    cfg: dict = {}
    path = os.path.join(checkpoint, "tokenizer_config.json") if checkpoint else ""
    if path and os.path.exists(path):
        with open(path) as f:
            cfg = json.load(f)
    named_tokens = special_tokens(checkpoint) if checkpoint else {}
    specials = (named_tokens.get("bos_token", ""), named_tokens.get("eos_token", ""))
    if given:
        return ChatTemplate(given, *specials, name="--chat-template")
    if not checkpoint:
        return ChatTemplate(PLAIN_TEMPLATE)
    source: Any = None
    named: dict = {}
    jinja_path = os.path.join(checkpoint, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path) as f:
            source = f.read()
    extra = os.path.join(checkpoint, ADDITIONAL_TEMPLATES)
    if os.path.isdir(extra):  # transformers 5 saves the named templates beside chat_template.jinja (the default)
        for file in sorted(os.listdir(extra)):
            if file.endswith(".jinja"):
                with open(os.path.join(extra, file)) as f:
                    named[file[:-len(".jinja")]] = f.read()
        if source is not None:
            named["default"] = source
        source = named.get("default") or next(iter(named.values()), None)
    if source is None:
        source = cfg.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    if not isinstance(source, str) or not source:
        return None
    template = ChatTemplate(source, *specials, name=checkpoint)
    if isinstance(named.get("tool_use"), str) and named["tool_use"] != source:
        template.tool_use = ChatTemplate(named["tool_use"], *specials, name=f"{checkpoint} (tool_use)")
    return template


def _content(msg: dict, i: int) -> str:
    c = msg.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise api.bad(f"messages[{i}].content", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise api.bad(f"messages[{i}].content", "content must be a string or a list of text parts")


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's tool calls, for the template. A call's ``function.arguments`` comes
    as a JSON string (OpenAI's shape) and templates expect an object (transformers' chat
    template docs; vLLM converts it too): a string holding a JSON object is parsed."""
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise api.bad(where, "tool_calls must be a list of objects")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise api.bad(f"{where}[{j}].function", "a tool call needs a function with a name")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except (ValueError, RecursionError):
                parsed = None
            if isinstance(parsed, dict):
                args = parsed
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _reasoning(msg: dict, i: int) -> Optional[str]:
    """An assistant message's earlier thinking: vLLM's ``reasoning``, else the older ``reasoning_content`` (which
    vLLM renames to it)."""
    for key in ("reasoning", "reasoning_content"):
        v = msg.get(key)
        if v is not None:
            if not isinstance(v, str):
                raise api.bad(f"messages[{i}].{key}", f"{key} must be a string")
            return v
    return None


def parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise api.bad("messages", "missing field 'messages'")
    if not isinstance(msgs, list) or not msgs:
        raise api.bad("messages", "messages must be a non-empty list")
    out = []
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict):
            raise api.bad(f"messages[{i}]", "each message must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or not role:  # vLLM's custom roles too (Llama 3.1's ipython): the template's
            raise api.bad(f"messages[{i}].role", f"role must be a non-empty string such as one of {list(ROLES)}, "
                                                 f"got {role!r}")
        parsed: dict[str, Any] = {"role": role, "content": _content(msg, i)}
        for key in ("name", "tool_call_id"):  # who spoke; which call a tool message answers
            if msg.get(key) is not None:
                if not isinstance(msg[key], str):
                    raise api.bad(f"messages[{i}].{key}", f"{key} must be a string")
                parsed[key] = msg[key]
        if msg.get("tool_calls") is not None:
            parsed["tool_calls"] = _tool_calls(msg["tool_calls"], f"messages[{i}].tool_calls")
        thought = _reasoning(msg, i) if role == "assistant" else None
        if thought is not None:  # as vLLM gives it (interleaved thinking): under both names templates read
            parsed["reasoning"] = parsed["reasoning_content"] = thought
        out.append(parsed)
    return out


def parse_tools(body: dict) -> list[dict]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise api.bad("tools", "tools must be a list of objects")
    if len(tools) > L.MAX_TOOLS:
        raise api.bad("tools", f"at most {L.MAX_TOOLS} tools, got {len(tools)}")
    return tools


# what the template is given by pushkv itself: chat_template_kwargs may not replace them
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                   "strftime_now")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # vLLM 0.32's


def parse_template_kwargs(body: dict) -> dict:
    """vLLM's ``chat_template_kwargs``: an object of extra variables for the template; vLLM's ``documents`` (a list
    of objects, for retrieval templates), given to the template as ``documents``; and ``reasoning_effort``, given to
    the template as it is (over the kwargs' own), with ``enable_thinking`` false for "none" and true for any other
    where the kwargs do not say, as vLLM's (a template that opts into thinking, Gemma 4's, thinks then)."""
    docs = body.get("documents")
    if docs is not None and not (isinstance(docs, list) and all(isinstance(d, dict) for d in docs)):
        raise api.bad("documents", "documents must be a list of objects")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise api.bad("reasoning_effort", f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                                          f"{effort!r}")
    kw = body.get("chat_template_kwargs")
    if kw is not None and not isinstance(kw, dict):
        raise api.bad("chat_template_kwargs", "chat_template_kwargs must be an object")
    taken = [k for k in kw or () if k in RESERVED_KWARGS]
    if taken:
        raise api.bad("chat_template_kwargs", f"chat_template_kwargs may not set {taken[0]!r} (the request's own "
                                              "fields give it)")
    out = {} if docs is None else {"documents": docs}
    out.update(kw or {})
    if effort is not None:
        out["reasoning_effort"] = effort
        out.setdefault("enable_thinking", effort != "none")
    return out


def forced_choice(body: dict, tools: list[dict]) -> Optional[tuple[str, dict]]:
    """A tool_choice that forces calls (vLLM's and OpenAI's ``required``, or ``{"type": "function", "function":
    {"name": ...}}``): the choice's parser and the schema that holds the output; None for none and auto. Any choice
    but none given without tools is vLLM 0.32's 400 (``tools`` an empty list is refused before, as vLLM's)."""
    choice = body.get("tool_choice")
    if choice not in (None, "none") and not tools:  # vLLM 0.32's check_tool_usage: auto, forced or not a choice
        raise api.bad("tool_choice", "When using `tool_choice`, `tools` must be set.")
    if choice in (None, "none", "auto"):
        return None
    if choice != "required" and not isinstance(choice, dict):  # vLLM 0.32's check_tool_usage, in its order and words
        raise api.bad("tool_choice", f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" "
                                     "or \"required\" are supported.")
    names = [tool_calls.function_of(t).get("name") for t in tools]
    if not all(isinstance(n, str) and n for n in names):
        raise api.bad("tool_choice", "a forced tool_choice needs every tool to be a function with a name")
    if choice == "required":
        try:
            schema = tool_choice.forced_schema(tools, parallel=api.get_bool(body, "parallel_tool_calls", True))
        except ValueError as e:
            raise api.bad("tools", str(e)) from None
        return tool_choice.REQUIRED, schema
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    fn = choice.get("function")
    if not isinstance(fn, dict):
        raise api.bad("tool_choice.function", f"Invalid value for `function`: `{fn}` in `tool_choice`! {usage}")
    if "name" not in fn:
        raise api.bad("tool_choice.function.name", f"Expected field `name` in `function` in `tool_choice`! {usage}")
    name = fn["name"]
    if not isinstance(name, str) or not name:
        raise api.bad("tool_choice.function.name", f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}")
    if name not in names:
        raise api.bad("tool_choice", "The tool specified in `tool_choice` does not match any of the specified `tools`")
    return tool_choice.NAMED + name, tool_choice.forced_schema(tools, name)


def tool_choice_refused(body: dict, tools: list[dict], tool_call_parser: str) -> str:
    """vLLM 0.32's refusal (its renderer's, 400, no param) of a tool_choice that wants calls parsed on a deployment
    without --tool-call-parser: ``auto`` (the default with tools) and a forced one (``required``, a named function)
    alike, as vLLM needs its parser to make a forced choice's output calls; "" where it stands (``none`` always).
    The choice is one forced_choice took."""
    choice = body.get("tool_choice")
    if tool_call_parser or not tools or choice == "none":
        return ""
    if choice in (None, "auto"):
        return '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    named = f'function "{choice["function"]["name"]}"' if isinstance(choice, dict) else f'"{choice}"'
    return f"tool_choice={named} requires --tool-call-parser to be set"


def render_request(template: ChatTemplate, body: dict, messages: list[dict], tools: list[dict]) -> str:
    """A chat request's prompt text: its messages through the deployment's template (the tool-use one with tools),
    with its add_generation_prompt (default true), continue_final_message and chat_template_kwargs."""
    # as transformers' apply_chat_template: tools=None when there are none (templates test `if tools`)
    return template.for_tools(bool(tools)).render(
        messages, add_generation_prompt=api.get_bool(body, "add_generation_prompt", True),
        continue_final_message=api.get_bool(body, "continue_final_message"), tools=tools or None,
        **parse_template_kwargs(body))


def parse_chat(body: dict, tok: text.Tokenizer, limits: api.Limits, template: ChatTemplate,
               reasoning_parser: str = "", tool_call_parser: str = "") -> api.CompletionParams:
    if body.get("chat_template") is not None:
        raise api.bad("chat_template", "a request's own chat template is not accepted: the deployment's is used "
                                       "(pushkv up --chat-template sets it)")
    if body.get("tools") == []:  # vLLM 0.32's (and OpenAI's) 400; its tokenize, which parse_tools serves too, takes []
        raise api.bad("tools", "`tools` must not be an empty array. Either provide at least one tool or omit the "
                               "field entirely.")
    tools = parse_tools(body)
    messages = parse_messages(body)
    forced = forced_choice(body, tools)
    # tool_choice auto (the default with tools): the deployment's parser takes the calls out of the output; without
    # one, refused as vLLM refuses it (clients probe tool support by it), rather than calls left in the text; a
    # forced one too, as vLLM's, before the prompt is rendered
    refused = tool_choice_refused(body, tools, tool_call_parser)
    if refused:
        raise api.ApiError(400, refused)
    prompt = render_request(template, body, messages, tools)
    ids = api.encode_text(tok, prompt, "messages")
    # The template writes the special tokens itself (Llama's writes "<s>"): drop what the
    # tokenizer's post-processor adds in front, as vLLM's chat does (its add_special_tokens, false by default)
    if not api.get_bool(body, "add_special_tokens", False):
        ids = api.strip_added(tok, ids)
    if not ids:
        raise api.bad("messages", "the rendered prompt is empty")
    ids = api.truncate_prompt(ids, body, limits)
    api.check_prompt_ids(ids, limits, "messages")
    want = api.get_bool(body, "logprobs")
    top = api.get_int(body, "top_logprobs", None, 0, L.MAX_LOGPROBS)
    if top is not None and top > 0 and not want:
        raise api.bad("top_logprobs", "top_logprobs needs logprobs: true")
    # a forced tool_choice wins over the request's own structured output, as vLLM's: its calls' schema holds the output
    # (but for structured_outputs' structural_tag, which vLLM's tool parser leaves to hold it)
    own = forced is not None and structured.keeps_own(body)
    generation = body if forced is None or own else structured.set_aside(body, named=forced[0] != tool_choice.REQUIRED)
    params = api.parse_generation(generation, ids, tok, limits, None, (top or 0) if want else -1,
                                  max_tokens_field="max_completion_tokens", prompt_field="messages")
    prompt_logprobs = api.parse_prompt_logprobs(body, params.stream)
    if prompt_logprobs is not None:
        params.sampling = msgspec.structs.replace(params.sampling, prompt_logprobs=prompt_logprobs)
    params.chat = True
    # vLLM's echo: the last message, where it is the assistant's (the one continued), opens each choice's content
    last = messages[-1]
    params.echo_text = last["content"] if api.get_bool(body, "echo") and last["role"] == "assistant" else ""
    params.reasoning_parser = reasoning_parser
    if reasoning_parser:  # (enable_thinking as vLLM's qwen3 parser reads it)
        thinking = bool(parse_template_kwargs(body).get("enable_thinking", True))
        params.reasons = reasoning.reasons(reasoning_parser, thinking, prompt)
    params.include_reasoning = api.get_bool(body, "include_reasoning", True)
    auto = bool(tools) and body.get("tool_choice") in (None, "auto")
    params.tool_call_parser = tool_call_parser if auto else ""
    params.tools = tools
    params.parallel_tool_calls = api.get_bool(body, "parallel_tool_calls", True)
    if forced is not None:  # required or a named function: the output held to the calls' schema, then made calls
        parser, schema = forced
        # compact JSON (structured_outputs' disable_any_whitespace): a call's arguments need no layout, and a weak
        # model held to a schema can otherwise fill max_tokens with white space
        if not own:
            params.structured = structured.parse({"structured_outputs": {"json": schema,
                                                                         "disable_any_whitespace": True}})
        params.tool_call_parser = parser
    if params.structured is not None and reasoning_parser and params.reasons:  # the answer after the reasoning
        params.structured = msgspec.structs.replace(params.structured,
                                                    after=tuple(api.encode_bare(tok, reasoning.END, "messages")))
    if params.tool_call_parser in tool_calls.KEEPS_SPECIAL_TOKENS:  # its markers are special tokens, as vLLM keeps
        params.skip_special_tokens = False
    return params
