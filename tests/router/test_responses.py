"""OpenAI's Responses API (router/responses.py) over the chat path, with a fake scheduler: what reaches the instance
(the messages' prompt, max_output_tokens, a JSON schema's grammar), the response object and its status, the typed
stream, and the fields not built refused by name."""
import asyncio
import json

import pytest

from pushkv import messages as m
from tests.support.router_fakes import Harness, make_cfg, stage, tokens

pytestmark = pytest.mark.timeout(30)

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"


def answer(finish):
    def script(g):
        return [(None, tokens(g, [72, 105], True, finish, (stage("scheduled"), stage("finished"))))]
    return script


def run(tmp_path, finish, fn):
    async def body():
        async with Harness(make_cfg(tmp_path, "local", chat_template=TEMPLATE), {"local": answer(finish)}) as h:
            await fn(h)
    asyncio.run(asyncio.wait_for(body(), 25))


def test_a_response_from_instructions_and_input(tmp_path):
    async def fn(h):
        r = await h.http.post("/v1/responses", json={
            "model": "tiny", "instructions": "Be terse.", "max_output_tokens": 2,
            "input": [{"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
                      {"type": "message", "role": "user", "content": "Hey"}], "metadata": {"k": "v"}})
        got = await r.json()
        assert r.status == 200 and got["object"] == "response" and got["id"].startswith("resp_")
        assert got["status"] == "completed" and got["incomplete_details"] is None and got["store"] is False
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
    ("tools", [{"type": "function", "name": "f", "parameters": {}}], "/v1/chat/completions"),
    ("previous_response_id", "resp_1", "not stored"),
    ("background", True, "not built"),
    ("include", ["message.output_text.logprobs"], "not built"),
    ("input", [{"type": "function_call_output", "call_id": "c", "output": "x"}], "only messages"),
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


def test_reasoning_comes_as_its_own_item_before_the_message(tmp_path):
    """With --reasoning-parser the thinking is a ``reasoning`` item ahead of the message, whole and streamed."""
    said = list(b"<think>ab</think>Hi")

    def script(g):
        return [(None, tokens(g, said[:9], False, "", (stage("scheduled"),))),
                (None, tokens(g, said[9:], True, "stop", (stage("finished"),)))]

    async def body():
        cfg = make_cfg(tmp_path, "local", chat_template=TEMPLATE, reasoning_parser="qwen3")
        async with Harness(cfg, {"local": script}) as h:
            got = await (await h.http.post("/v1/responses", json={"model": "tiny", "input": "Hey"})).json()
            assert [i["type"] for i in got["output"]] == ["reasoning", "message"], got["output"]
            assert got["output"][0]["content"] == [{"type": "reasoning_text", "text": "ab"}]
            assert got["output"][1]["content"][0]["text"] == "Hi"
            raw = await (await h.http.post("/v1/responses", json={"model": "tiny", "input": "Hey",
                                                                   "stream": True})).text()
            events = [json.loads(blk.split("\n")[1][len("data: "):]) for blk in raw.strip().split("\n\n")]
            kinds = [e["type"] for e in events]
            assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
            thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
            text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert (thought, text) == ("ab", "Hi")
            assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]
            assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]

    asyncio.run(asyncio.wait_for(body(), 25))
