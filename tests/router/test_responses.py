"""OpenAI's Responses API (router/responses.py) over the chat path, with a fake scheduler: what reaches the instance
(the messages' prompt, max_output_tokens, a JSON schema's grammar), the response object and its status, the typed
stream, and the fields not built refused by name."""
import asyncio
import json
import threading

import msgspec

import pytest

from pushkv import messages as m
from tests.support.router_fakes import Harness, make_cfg, stage, tokens

pytestmark = pytest.mark.timeout(30)

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"


def answer(finish):
    def script(g):
        return [(None, tokens(g, [72, 105], True, finish, (stage("scheduled"), stage("finished"))))]
    return script


def _serve(tmp_path, script, fn):
    """fn(harness) against a local fake answering with ``script``."""
    async def body():
        async with Harness(make_cfg(tmp_path, "local", chat_template=TEMPLATE), {"local": script}) as h:
            await fn(h)
    asyncio.run(asyncio.wait_for(body(), 25))


def run(tmp_path, finish, fn):
    _serve(tmp_path, answer(finish), fn)


def test_a_response_from_instructions_and_input(tmp_path):
    async def fn(h):
        r = await h.http.post("/v1/responses", json={
            "model": "tiny", "instructions": "Be terse.", "max_output_tokens": 2,
            "input": [{"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
                      {"type": "message", "role": "user", "content": "Hey"}], "metadata": {"k": "v"}})
        got = await r.json()
        assert r.status == 200 and got["object"] == "response" and got["id"].startswith("resp_")
        assert got["status"] == "completed" and got["incomplete_details"] is None and got["store"] is True
        [item] = got["output"]
        assert item["type"] == "message" and item["role"] == "assistant"
        assert item["content"] == [{"type": "output_text", "text": "Hi", "annotations": []}]
        assert got["usage"]["output_tokens"] == 2 and got["usage"]["total_tokens"] == got["usage"]["input_tokens"] + 2
        assert got["instructions"] == "Be terse." and got["max_output_tokens"] == 2 and got["metadata"] == {"k": "v"}
        assert got["temperature"] is None  # not given: the deployment's default ran, not OpenAI's 1
        [g] = h.log.received("local", m.Generate)
        assert bytes(g.prompt_token_ids).decode() == "[system]Be terse.[system]Rules.[user]Hey"
        assert g.max_tokens == 2

    run(tmp_path, "stop", fn)


def test_a_response_cut_by_max_output_tokens_is_incomplete_and_streams_typed_events(tmp_path):
    async def fn(h):
        r = await h.http.post("/v1/responses", json={"model": "tiny", "input": "Hey", "max_output_tokens": 2})
        got = await r.json()
        assert got["status"] == "incomplete" and got["incomplete_details"] == {"reason": "max_output_tokens"}
        r = await h.http.post("/v1/responses", json={"model": "tiny", "input": "Hey", "stream": True})
        raw = await r.text()
        assert "[DONE]" not in raw
        events = [(blk.split("\n")[0][len("event: "):], json.loads(blk.split("\n")[1][len("data: "):]))
                  for blk in raw.strip().split("\n\n")]
        kinds = [k for k, _ in events]
        assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                         "response.content_part.done", "response.output_item.done", "response.incomplete"], kinds
        assert all(ev["type"] == k and ev["sequence_number"] == i for i, (k, ev) in enumerate(events))
        assert events[4][1]["delta"] == "Hi" and events[5][1]["text"] == "Hi"
        final = events[-1][1]["response"]
        assert final["output"][0]["content"][0]["text"] == "Hi" and final["usage"]["output_tokens"] == 2

    run(tmp_path, "length", fn)


def test_a_json_schema_format_holds_the_output(tmp_path):
    pytest.importorskip("xgrammar")

    async def fn(h):
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        r = await h.http.post("/v1/responses", json={"model": "tiny", "input": "Hey", "text": {
            "format": {"type": "json_schema", "name": "thing", "schema": schema}}})
        assert r.status == 200 and (await r.json())["text"]["format"]["name"] == "thing"
        [g] = h.log.received("local", m.Generate)
        assert g.structured is not None and g.structured.kind == "json" and json.loads(g.structured.spec) == schema

    run(tmp_path, "stop", fn)


@pytest.mark.parametrize("field, value, says", [
    ("tools", [{"type": "web_search_preview"}], "only function tools"),
    ("tools", [{"type": "function", "parameters": {}}], "name must be"),
    ("tool_choice", {"type": "allowed_tools", "mode": "auto"}, "tool_choice must be"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}, "Tool choice 'function' not found"),
    ("store", "yes", "true or false"),
    ("include", ["reasoning.encrypted_content"], "not built"),
    ("top_logprobs", "3", "must be an integer"),
    ("input", [{"type": "web_search_call", "id": "w"}], "only messages, function_call"),
    ("input", [{"type": "function_call", "name": "f", "arguments": "{}"}], "call_id must be a string"),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "only text parts"),
    ("input", [], "non-empty"),
    ("text", {"format": {"type": "grammar"}}, "json_schema"),
])
def test_what_is_not_built_is_refused_by_name(tmp_path, field, value, says):
    async def fn(h):
        body = {"model": "tiny", "input": "Hey", field: value}
        r = await h.http.post("/v1/responses", json=body)
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == field and says in err["message"], err
        assert not h.log.received("local", m.Generate)

    run(tmp_path, "stop", fn)


async def _thought_and_said(h, ask: dict) -> tuple[dict, list[dict]]:
    """The whole answer to ``ask`` and its streamed events."""
    got = await (await h.http.post("/v1/responses", json=ask)).json()
    raw = await (await h.http.post("/v1/responses", json={**ask, "stream": True})).text()
    return got, [json.loads(blk.split("\n")[1][len("data: "):]) for blk in raw.strip().split("\n\n")]


def _reasoning_run(tmp_path, fn):
    """``fn(h)`` on a local deployment with the qwen3 reasoning parser whose model says ``<think>ab</think>Hi``."""
    said = list(b"<think>ab</think>Hi")

    def script(g):
        return [(None, tokens(g, said[:9], False, "", (stage("scheduled"),))),
                (None, tokens(g, said[9:], True, "stop", (stage("finished"),)))]

    async def body():
        cfg = make_cfg(tmp_path, "local", chat_template=TEMPLATE, reasoning_parser="qwen3")
        async with Harness(cfg, {"local": script}) as h:
            await fn(h)

    asyncio.run(asyncio.wait_for(body(), 25))


def test_reasoning_comes_as_its_own_item_before_the_message(tmp_path):
    """With --reasoning-parser the thinking is a ``reasoning`` item ahead of the message, whole and streamed."""
    async def fn(h):
        got, events = await _thought_and_said(h, {"model": "tiny", "input": "Hey"})
        assert [i["type"] for i in got["output"]] == ["reasoning", "message"], got["output"]
        assert got["output"][0]["content"] == [{"type": "reasoning_text", "text": "ab"}]
        assert got["output"][1]["content"][0]["text"] == "Hi"
        kinds = [e["type"] for e in events]
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
        thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert (thought, text) == ("ab", "Hi")
        assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]
        assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]

    _reasoning_run(tmp_path, fn)


def test_include_reasoning_false_leaves_the_reasoning_item_out_whole_and_streamed(tmp_path):
    """vLLM 0.32's Responses include_reasoning false: the reasoning is still generated but not returned (no reasoning
    item, no reasoning events), as chat's; pushkv passed the field nowhere and returned the reasoning."""
    async def fn(h):
        got, events = await _thought_and_said(h, {"model": "tiny", "input": "Hey", "include_reasoning": False})
        assert [i["type"] for i in got["output"]] == ["message"], got["output"]
        assert got["output"][0]["content"][0]["text"] == "Hi"
        assert not [e for e in events if "reasoning" in e["type"]], events
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hi"
        assert [i["type"] for i in events[-1]["response"]["output"]] == ["message"]

    _reasoning_run(tmp_path, fn)


TOOL_TEMPLATE = (
    "{% if tools %}[tools]{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] or '' }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.id }}>{{ c.function.name }}{{ c.function.arguments | tojson }}</call>{% endfor %}"
    "{% if m.tool_call_id %}<for {{ m.tool_call_id }}>{% endif %}{% endfor %}")
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALLS = 'Looking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def _tools_run(tmp_path, said: str, fn):
    out = list(said.encode())

    def script(g):
        return [(None, tokens(g, out[:20], False, "", (stage("scheduled"),))),
                (None, tokens(g, out[20:], True, "stop", (stage("finished"),)))]

    async def body():
        cfg = make_cfg(tmp_path, "local", chat_template=TOOL_TEMPLATE, tool_call_parser="hermes")
        async with Harness(cfg, {"local": script}) as h:
            await fn(h)
    asyncio.run(asyncio.wait_for(body(), 25))


def test_function_tools_give_function_call_items_whole_and_streamed(tmp_path):
    """The model's hermes call comes out as a ``function_call`` item after its text, and OpenAI's types take the
    response and every streamed event (the ``openai`` package's own models)."""
    openai_types = pytest.importorskip("openai.types.responses")
    from pydantic import TypeAdapter

    async def fn(h):
        req = {"model": "tiny", "input": "Weather in Oslo?", "tools": [WEATHER]}
        got = await (await h.http.post("/v1/responses", json=req)).json()
        [g] = h.log.received("local", m.Generate)
        assert bytes(g.prompt_token_ids).decode() == "[tools]get_weather;[user]Weather in Oslo?"
        assert [i["type"] for i in got["output"]] == ["message", "function_call"], got["output"]
        call = got["output"][1]
        assert (call["name"], json.loads(call["arguments"]), call["status"]) == ("get_weather", {"city": "Oslo"},
                                                                                 "completed")
        assert call["call_id"] and got["output"][0]["content"][0]["text"] == "Looking."
        assert got["tools"] == [WEATHER] and got["tool_choice"] == "auto" and got["status"] == "completed"
        openai_types.Response.model_validate({k: v for k, v in got.items() if k != "pushkv"})
        raw = await (await h.http.post("/v1/responses", json=dict(req, stream=True))).text()
        events = [json.loads(blk.split("\n")[1][len("data: "):]) for blk in raw.strip().split("\n\n")]
        adapter = TypeAdapter(openai_types.ResponseStreamEvent)
        for e in events:
            adapter.validate_python(e)
        kinds = [e["type"] for e in events]
        at = kinds.index("response.function_call_arguments.delta")
        assert kinds[at - 1:at + 3] == ["response.output_item.added", "response.function_call_arguments.delta",
                                        "response.function_call_arguments.done", "response.output_item.done"]
        assert kinds.index("response.output_text.done") < at  # the text's item closed before the call's opened
        done = events[at + 1]
        assert json.loads(done["arguments"]) == {"city": "Oslo"} and done["output_index"] == 1
        final = events[-1]["response"]
        assert final["output"][1]["call_id"] and [i["type"] for i in final["output"]] == ["message", "function_call"]

    _tools_run(tmp_path, CALLS, fn)


def test_tool_choice_without_tools_is_checked_as_vllms_responses_request_checks_it():
    """vLLM 0.32's Responses request (its check_tool_usage), unlike its chat request: without tools (absent or [])
    tool_choice auto and none are none, and the chat request gets none (chat's 400 for auto without tools would
    otherwise refuse it); required, or a named tool that is not among the tools, is a 400 naming tool_choice."""
    from pushkv.router import api, responses

    for tools in (None, []):
        for choice in (None, "auto", "none"):
            body = {"input": "Hey", "tools": tools, "tool_choice": choice}
            chat = responses.chat_body(body)
            assert "tool_choice" not in chat and "tools" not in chat and responses.echo(body)["tool_choice"] == "none"
    assert responses.echo({"input": "Hey", "tools": [WEATHER]})["tool_choice"] == "auto"
    named = {"type": "function", "name": "get_weather"}
    assert responses.chat_body({"input": "Hey", "tools": [WEATHER], "tool_choice": named})["tool_choice"] == {
        "type": "function", "function": {"name": "get_weather"}}
    not_found = "Tool choice 'function' not found in 'tools' parameter."
    required = "Tool choice 'required' must be specified with 'tools' parameter."
    for body, says in [({"tool_choice": "required"}, required),
                       ({"tool_choice": named}, not_found),
                       ({"tool_choice": {"type": "function", "name": "x"}, "tools": [WEATHER]}, not_found)]:
        with pytest.raises(api.ApiError) as e:
            responses.chat_body({"input": "Hey", **body})
        assert (e.value.status, e.value.param, e.value.message) == (400, "tool_choice", says), body


def test_a_conversation_goes_on_with_the_call_and_its_output_and_a_named_choice_forces_it(tmp_path):
    async def fn(h):
        req = {"model": "tiny", "tools": [WEATHER], "input": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Bergen"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "4 C"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "9 C"}]}]}
        r = await h.http.post("/v1/responses", json=req)
        assert r.status == 200, await r.text()
        [g] = h.log.received("local", m.Generate)
        assert bytes(g.prompt_token_ids).decode() == (
            '[tools]get_weather;[user]Weather in Oslo?[assistant]<call c1>get_weather{"city": "Oslo"}</call>'
            '<call c2>get_weather{"city": "Bergen"}</call>[tool]4 C<for c1>[tool]9 C<for c2>')
        # a named function: the output held to its arguments' schema (the fake ignores the mask)
        forced = dict(req, input="Weather?", tool_choice={"type": "function", "name": "get_weather"})
        got = await (await h.http.post("/v1/responses", json=forced)).json()
        spec = h.log.received("local", m.Generate)[-1].structured
        assert spec is not None and spec.kind == "json", spec
        assert got["tool_choice"] == {"type": "function", "name": "get_weather"}

    _tools_run(tmp_path, '{"city": "Oslo"}', fn)


def test_the_output_texts_logprobs_whole_and_streamed_when_included(tmp_path):
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: each token's logprob and alternatives on
    the output text, whole and on the streamed deltas and the done event, in the openai package's own types."""
    openai_types = pytest.importorskip("openai.types.responses")
    from pydantic import TypeAdapter

    lp = [m.TokenLogprob(-0.25, (72, 73), (-0.25, -2.0)), m.TokenLogprob(-0.5, (105, 106), (-0.5, -1.5))]

    def script(g):
        first = tokens(g, [72], False, "", (stage("scheduled"),))
        last = tokens(g, [105], True, "stop", (stage("finished"),))
        return [(None, msgspec.structs.replace(first, logprobs=tuple(lp[:1]))),
                (None, msgspec.structs.replace(last, logprobs=tuple(lp[1:])))]

    async def body():
        async with Harness(make_cfg(tmp_path, "local", chat_template=TEMPLATE), {"local": script}) as h:
            req = {"model": "tiny", "input": "Hey", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
            got = await (await h.http.post("/v1/responses", json=req)).json()
            [g] = h.log.received("local", m.Generate)
            assert g.sampling is not None and g.sampling.logprobs == 2
            part = got["output"][0]["content"][0]
            assert [(x["token"], x["logprob"]) for x in part["logprobs"]] == [("H", -0.25), ("i", -0.5)]
            assert [t["token"] for t in part["logprobs"][0]["top_logprobs"]] == ["H", "I"]
            assert got["top_logprobs"] == 2
            openai_types.Response.model_validate({k: v for k, v in got.items() if k != "pushkv"})
            raw = await (await h.http.post("/v1/responses", json=dict(req, stream=True))).text()
            events = [json.loads(blk.split("\n")[1][len("data: "):]) for blk in raw.strip().split("\n\n")]
            adapter = TypeAdapter(openai_types.ResponseStreamEvent)
            for e in events:
                adapter.validate_python(e)
            deltas = [e for e in events if e["type"] == "response.output_text.delta"]
            assert [[x["token"] for x in e["logprobs"]] for e in deltas] == [["H"], ["i"]]
            done = next(e for e in events if e["type"] == "response.output_text.done")
            assert [x["logprob"] for x in done["logprobs"]] == [-0.25, -0.5]
            # not asked: none
            plain = await (await h.http.post("/v1/responses", json={"model": "tiny", "input": "Hey"})).json()
            assert "logprobs" not in plain["output"][0]["content"][0]

    asyncio.run(asyncio.wait_for(body(), 25))


def test_responses_are_kept_continued_fetched_and_deleted(tmp_path):
    """OpenAI's store: a finished response is kept (unary and streamed), ``GET /v1/responses/ID`` answers it,
    ``previous_response_id`` puts its conversation and output before the new input (its instructions not), ``DELETE``
    forgets it, and an unknown id, or ``store: false``'s, is a 404."""
    async def fn(h):
        first = await (await h.http.post("/v1/responses", json={
            "model": "tiny", "instructions": "Be terse.", "input": "Hey"})).json()
        assert first["store"] is True
        got = await h.http.get(f"/v1/responses/{first['id']}")
        assert got.status == 200 and await got.json() == {k: v for k, v in first.items() if k != "pushkv"}
        r = await h.http.post("/v1/responses", json={"model": "tiny", "input": "More", "instructions": "Again.",
                                                     "previous_response_id": first["id"], "stream": True})
        raw = await r.text()
        final = json.loads(raw.strip().split("\n\n")[-1].split("\n")[1][len("data: "):])["response"]
        assert final["previous_response_id"] == first["id"] and final["store"] is True
        g = h.log.received("local", m.Generate)[-1]
        assert bytes(g.prompt_token_ids).decode() == "[system]Again.[user]Hey[assistant]Hi[user]More"
        # the streamed one was kept too, and continues in turn
        assert (await h.http.get(f"/v1/responses/{final['id']}")).status == 200
        await h.http.post("/v1/responses", json={"model": "tiny", "input": "Last", "previous_response_id": final["id"]})
        g = h.log.received("local", m.Generate)[-1]
        assert bytes(g.prompt_token_ids).decode() == "[user]Hey[assistant]Hi[user]More[assistant]Hi[user]Last"
        gone = await h.http.delete(f"/v1/responses/{first['id']}")
        assert gone.status == 200 and (await gone.json())["deleted"] is True
        for path in (f"/v1/responses/{first['id']}", "/v1/responses/resp_nope"):
            assert (await h.http.get(path)).status == 404
        assert (await h.http.delete(f"/v1/responses/{first['id']}")).status == 404
        r = await h.http.post("/v1/responses", json={"model": "tiny", "input": "x", "previous_response_id": first["id"]})
        err = (await r.json())["error"]
        assert r.status == 404 and err["param"] == "previous_response_id", err
        unkept = await (await h.http.post("/v1/responses", json={"model": "tiny", "input": "x",
                                                                 "store": False})).json()
        assert unkept["store"] is False and (await h.http.get(f"/v1/responses/{unkept['id']}")).status == 404

    run(tmp_path, "stop", fn)


def test_a_router_that_keeps_none_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PUSHKV_RESPONSES_STORE", "0")

    async def fn(h):
        got = await (await h.http.post("/v1/responses", json={"model": "tiny", "input": "Hey"})).json()
        assert got["store"] is False and (await h.http.get(f"/v1/responses/{got['id']}")).status == 404
        r = await h.http.post("/v1/responses", json={"model": "tiny", "input": "x", "previous_response_id": got["id"]})
        assert r.status == 404 and "keeps no responses" in (await r.json())["error"]["message"]

    run(tmp_path, "stop", fn)


def test_the_store_keeps_the_latest_within_its_bounds_and_turns_calls_back_into_messages():
    from pushkv.router import api
    from pushkv.router.responses import Store

    def resp(rid, text="", calls=()):
        out = [{"type": "message", "content": [{"type": "output_text", "text": text}]}] if text else []
        out += [{"type": "function_call", "call_id": c, "name": "f", "arguments": "{}"} for c in calls]
        return {"id": rid, "output": out}

    store = Store(2)
    for i in range(3):
        store.keep(resp(f"r{i}", "t"), [{"role": "user", "content": str(i)}])
    assert store.get("r0") is None and store.get("r2") is not None  # the oldest went first
    store.keep(resp("r3", "", ("c1", "c2")), [{"role": "user", "content": "q"}])
    assert store.conversation("r3") == [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
        "tool_calls": [{"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}} for c in ("c1", "c2")]}]
    store.keep(resp("r4", "Let me see.", ("c3",)), [])
    [said] = store.conversation("r4")
    assert said["content"] == "Let me see." and [c["id"] for c in said["tool_calls"]] == ["c3"]
    # an input that ended with the assistant's own message keeps it: the calls are the new turn's
    store.keep(resp("r5", "", ("c4",)), [{"role": "assistant", "content": "Earlier."}])
    earlier, turn = store.conversation("r5")
    assert earlier == {"role": "assistant", "content": "Earlier."} and turn["content"] is None
    small = Store(100, max_bytes=400)
    for i in range(5):
        small.keep(resp(f"s{i}", "x" * 50), [])
    assert small.get("s0") is None and small.get("s4") is not None and small._bytes <= 400
    with pytest.raises(api.ApiError) as e:
        small.conversation("s0")
    assert e.value.status == 404


def _gated(go: "threading.Event"):
    """The first token at once, the second and the end only once ``go`` is set."""
    def script(g):
        return [(None, tokens(g, [72])), (go, tokens(g, [105], True, "stop", (stage("scheduled"), stage("finished"))))]
    return script


def _run_gated(tmp_path, go, fn):
    _serve(tmp_path, _gated(go), fn)


async def _until(h, rid: str, status: str) -> dict:
    """The kept response once it has ``status`` (the background task gets there on its own)."""
    while True:
        got = await (await h.http.get(f"/v1/responses/{rid}")).json()
        if got["status"] == status:
            return got
        await asyncio.sleep(0.01)


def test_a_background_response_answers_queued_then_generates_on_to_completed(tmp_path):
    """OpenAI's and vLLM's background: the POST answers at once, queued; the response generates on, in progress,
    while its client is gone, and is kept completed with the same output as a plain request's."""
    openai_types = pytest.importorskip("openai.types.responses")
    go = threading.Event()

    async def fn(h):
        r = await h.http.post("/v1/responses", json={"model": "tiny", "input": "Hey", "background": True})
        queued = await r.json()
        assert r.status == 200 and queued["status"] == "queued" and queued["background"] is True
        assert queued["output"] == [] and queued["usage"] is None and queued["store"] is True
        openai_types.Response.model_validate(queued)
        running = await _until(h, queued["id"], "in_progress")
        assert running["output"] == []
        go.set()
        done = await _until(h, queued["id"], "completed")
        openai_types.Response.model_validate(done)
        assert done["output"][0]["content"][0]["text"] == "Hi" and done["usage"]["output_tokens"] == 2
        assert done["background"] is True and "pushkv" not in done
        r = await h.http.post(f"/v1/responses/{queued['id']}/cancel")  # it has ended: nothing to cancel
        assert r.status == 400 and "completed" in (await r.json())["error"]["message"]
        # background needs the response kept
        r = await h.http.post("/v1/responses", json={"model": "tiny", "input": "Hey", "background": True,
                                                     "store": False})
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == "background" and "store" in err["message"]

    _run_gated(tmp_path, go, fn)


def test_a_background_response_is_cancelled_its_choice_aborted_and_its_blocks_freed(tmp_path):
    go = threading.Event()  # unset while the background response runs: it waits for its last token until cancelled

    async def fn(h):
        rid = (await (await h.http.post("/v1/responses", json={"model": "tiny", "input": "Hey",
                                                               "background": True})).json())["id"]
        await _until(h, rid, "in_progress")
        while not h.log.received("local", m.Generate):  # in progress from its task's start: its Generate is out next
            await asyncio.sleep(0.01)
        r = await h.http.post(f"/v1/responses/{rid}/cancel")
        got = await r.json()
        assert r.status == 200 and got["status"] == "cancelled" and got["id"] == rid
        [g] = h.log.received("local", m.Generate)
        while not h.log.received("local", m.Abort):  # the instance is told: it frees the choice's blocks
            await asyncio.sleep(0.01)
        assert h.log.received("local", m.Abort)[0].transfer_id == g.transfer_id
        assert (await (await h.http.get(f"/v1/responses/{rid}")).json())["status"] == "cancelled"
        r = await h.http.post(f"/v1/responses/{rid}/cancel")
        assert r.status == 400 and "cancelled" in (await r.json())["error"]["message"]
        assert (await h.http.post("/v1/responses/resp_nope/cancel")).status == 404
        go.set()  # a plain request ends
        plain = await (await h.http.post("/v1/responses", json={"model": "tiny", "input": "Hey",
                                                                "max_output_tokens": 1})).json()
        r = await h.http.post(f"/v1/responses/{plain['id']}/cancel")  # not a background one
        assert r.status == 400

    _run_gated(tmp_path, go, fn)


def _events(raw: str) -> list[dict]:
    return [json.loads(block.split("\n")[1][len("data: "):]) for block in raw.strip().split("\n\n")]


def test_a_streamed_background_responses_events_stream_again_from_any_point(tmp_path):
    """background with stream: the events stream as they are made and are kept; ``GET ?stream=true&starting_after=N``
    streams them again from the one after N, the same events, while and after it generates."""
    go = threading.Event()

    async def fn(h):
        r = await h.http.post("/v1/responses", json={"model": "tiny", "input": "Hey", "background": True,
                                                     "stream": True})
        first = await r.content.readuntil(b"\n\n")  # response.created: the response is under way
        created = json.loads(first.decode().split("\n")[1][len("data: "):])
        rid = created["response"]["id"]
        # a second client takes the stream up from the start while the first still reads it
        again = await h.http.get(f"/v1/responses/{rid}?stream=true&starting_after=-1")
        go.set()
        whole = _events(first.decode() + (await r.text()))
        assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
        assert whole[0]["type"] == "response.created" and whole[-1]["type"] == "response.completed"
        assert _events(await again.text()) == whole
        tail = await h.http.get(f"/v1/responses/{rid}?stream=true&starting_after=2")
        assert _events(await tail.text()) == whole[3:]
        kept = await (await h.http.get(f"/v1/responses/{rid}")).json()
        assert kept["status"] == "completed" and kept["output"][0]["content"][0]["text"] == "Hi"
        plain = await (await h.http.post("/v1/responses", json={"model": "tiny", "input": "Hey"})).json()
        r = await h.http.get(f"/v1/responses/{plain['id']}?stream=true")
        assert r.status == 400 and "background" in (await r.json())["error"]["message"]
        r = await h.http.get(f"/v1/responses/{rid}?stream=true&starting_after=x")
        assert r.status == 400

    _run_gated(tmp_path, go, fn)
