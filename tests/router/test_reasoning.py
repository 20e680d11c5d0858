"""``--reasoning-parser`` (pushkv/router/reasoning.py): a chat choice's thinking as ``reasoning_content`` apart from
its ``content``, as vLLM's deepseek_r1 and qwen3 parsers give it, whole and streamed alike however the text is cut
into deltas, through the router."""
from __future__ import annotations

import itertools

import pytest

from pushkv.router import reasoning
from tests.router.test_chat_fields import MESSAGES
from tests.router.test_router import local_script, read_sse, run
from tests.support.router_fakes import Harness, make_cfg

pytestmark = pytest.mark.timeout(30)

# text -> (reasoning_content, content): deepseek_r1's, and qwen3's where the request thinks (vLLM 0.32's, checked
# against its Qwen3Parser); where the output may not reason (reasoning.reasons false) it is the text, all content
CASES = {
    "<think>\nplan</think>\n\nanswer": ("\nplan", "\n\nanswer"),
    "plan</think>answer": ("plan", "answer"),  # opened in the prompt (Thinking-2507's template)
    "just an answer": ("just an answer", None),
    "<think>cut short by max_tokens": ("cut short by max_tokens", None),
    "<think></think>answer": (None, "answer"),
    "<thinking>x": ("<thinking>x", None),  # not the tag
    "<thi": ("<thi", None),
    "a</think>b</think>c": ("a", "b</think>c"),
    "": (None, None),
}
# (parser, whether the output may reason)
SPLITS = [("deepseek_r1", True), ("deepseek_r1", False), ("qwen3", True), ("qwen3", False)]


def want(text: str, parser: str, reasons: bool):
    return CASES[text] if reasons else (None, text or None)


@pytest.mark.parametrize("text", sorted(CASES))
@pytest.mark.parametrize("parser, reasons", SPLITS)
def test_a_whole_output_splits_as_vllms_parsers_split_it(text, parser, reasons):
    assert reasoning.split(text, parser, reasons) == want(text, parser, reasons)


@pytest.mark.parametrize("text", sorted(CASES))
@pytest.mark.parametrize("parser, reasons", SPLITS)
def test_streamed_in_any_pieces_the_deltas_join_to_the_whole_split(text, parser, reasons):
    whole = tuple(x or "" for x in want(text, parser, reasons))
    for cuts in itertools.combinations(range(1, len(text)), min(2, max(len(text) - 1, 0))):
        bounds = [0, *cuts, len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
        s = reasoning.Splitter(parser, reasons)
        got = [s.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == whole, pieces


# qwen3's reasoning also ends where a tool call opens before </think> (its tag the content's first text), as vLLM
# 0.32's Qwen3Parser ends it there, whole and streamed; deepseek_r1's does not (vLLM's reads the call as reasoning)
CALL = "<tool_call>\n<function=f>\n</function>\n</tool_call>"
CALL_CASES = {
    "plan" + CALL: {"qwen3": ("plan", CALL), "deepseek_r1": ("plan" + CALL, None)},
    "<think>plan" + CALL + "after": {"qwen3": ("plan", CALL + "after"), "deepseek_r1": ("plan" + CALL + "after", None)},
    "plan</think>" + CALL: {"qwen3": ("plan", CALL), "deepseek_r1": ("plan", CALL)},
    "<tool_call>x": {"qwen3": (None, "<tool_call>x"), "deepseek_r1": ("<tool_call>x", None)},
    "plan<tool_cal": {"qwen3": ("plan<tool_cal", None), "deepseek_r1": ("plan<tool_cal", None)},
}


@pytest.mark.parametrize("text", sorted(CALL_CASES))
@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_qwen3s_reasoning_ends_where_a_tool_call_opens_whole_and_streamed(text, parser):
    """vLLM 0.32's qwen3 parser takes <tool_call> as the reasoning's implicit end; pushkv's kept the call in the
    reasoning, so a Qwen3 model that called a tool without closing its thinking made no call."""
    split = CALL_CASES[text][parser]
    assert reasoning.split(text, parser) == split
    for cut in range(len(text) + 1):
        s = reasoning.Splitter(parser)
        got = [s.feed(text[:cut]), s.feed(text[cut:], final=True)]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == tuple(x or "" for x in split), cut
    start, end = reasoning.span(text, parser)
    assert text[start:end] == (split[0] or "")


@pytest.mark.parametrize("parser, body, template, reasons", [
    ("qwen3", {}, "", True),
    ("qwen3", {"chat_template_kwargs": {"enable_thinking": False}}, "", False),
    ("qwen3", {"reasoning_effort": "none"}, "", False),
    ("qwen3", {"reasoning_effort": "high"}, "", True),
    ("deepseek_r1", {"chat_template_kwargs": {"enable_thinking": False}}, "", True),  # it reads no such switch
    # the prompt's last turn closed the reasoning (Qwen3's template with thinking off): all content, either parser
    ("deepseek_r1", {}, "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("qwen3", {}, "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    # an earlier turn's closed reasoning, or one opened in the prompt: the output reasons
    ("qwen3", {}, "<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", True),
    ("deepseek_r1", {}, "</think>x<think>\n", True),
])
def test_whether_the_output_may_reason_as_vllms_parser_reads_the_request(parser, body, template, reasons):
    """vLLM 0.32's qwen3 parser: reasoning up to </think> unless the request turns thinking off (enable_thinking
    false, or reasoning_effort none); pushkv's found reasoning only where the output opened <think>, so a
    Thinking-2507 model's reasoning (its <think> in the prompt) came back as content. And either parser, where the
    prompt's last turn already closed the reasoning, as vLLM's is_reasoning_end reads the prompt: all content (a
    structured output's grammar then holds it from the start)."""
    from pushkv.router import api, chat, text

    limits = api.Limits(vocab_size=320, max_model_len=4096)
    t = chat.ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}" + template)
    p = chat.parse_chat({"messages": MESSAGES, "guided_regex": "a+", **body}, text.ByteTokenizer(), limits, t,
                        reasoning_parser=parser)
    assert p.reasons is reasons
    assert p.structured.after == (tuple(b"</think>") if reasons else ())
    assert reasoning.split("plan</think>answer", parser, p.reasons) == (("plan", "answer") if reasons else
                                                                       (None, "plan</think>answer"))


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_include_reasoning_false_still_holds_the_grammar_to_the_answer_after_the_reasoning(parser):
    """include_reasoning false hides the reasoning and does not stop the model from writing it: the grammar still
    waits for </think> (the reasoning is generated, then left out), as with include_reasoning true. vLLM 0.32
    differs here, and pushkv does not follow it: its ``resolve_reasoning_ended`` takes include_reasoning
    false as "the reasoning has ended" and holds the output to the grammar from the first token, so a model that
    reasons anyway (its template opened <think>) writes the JSON inside its reasoning, which the parser then reads
    as reasoning and hides: the answer's content comes back empty (vllm-project/vllm#54078, open, proposes what
    pushkv does)."""
    from pushkv.router import api, chat, text

    limits = api.Limits(vocab_size=320, max_model_len=4096)
    t = chat.ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    for include in (True, False):
        p = chat.parse_chat({"messages": MESSAGES, "guided_regex": "a+", "include_reasoning": include},
                            text.ByteTokenizer(), limits, t, reasoning_parser=parser)
        assert p.reasons and p.structured.after == tuple(b"</think>") and p.include_reasoning is include


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="'granite' is not one of"):
        reasoning.Splitter("granite")


def test_through_the_router_unary_and_streamed(tmp_path):
    out = list(b"<think>ab</think>hi")
    chunks = [out[:3], out[3:9], out[9:15], out[15:]]  # cut inside both tags

    async def body():
        cfg = make_cfg(tmp_path, "local", reasoning_parser="deepseek_r1")
        async with Harness(cfg, {"local": local_script(chunks, "stop")}) as h:
            r = await h.http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 32})
            assert r.status == 200, await r.text()
            msg = (await r.json())["choices"][0]["message"]
            # vLLM 0.32's name for it, and the older one beside it
            assert (msg["reasoning"], msg["reasoning_content"], msg["content"]) == ("ab", "ab", "hi")
            r = await h.http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 32,
                                                                 "stream": True})
            deltas = [e["choices"][0]["delta"] for e in (await read_sse(r)) if e != "[DONE]" and e["choices"]]
            assert "".join(d.get("reasoning", "") for d in deltas) == "ab"
            assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
            assert "".join(d.get("content", "") for d in deltas) == "hi"
            # completions are not chat: their text is whole
            r = await h.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 32})
            assert (await r.json())["choices"][0]["text"] == "<think>ab</think>hi"
    run(body())


def test_the_flag_sets_the_deployments_parser():
    from processes import cli
    from pushkv.config_flags import user_config

    args = cli.build_parser().parse_args(["up", "tiny", "--load-format", "dummy", "--reasoning-parser", "qwen3"])
    assert user_config(vars(args), lambda: (0, "")).reasoning_parser == "qwen3"
    assert user_config(vars(cli.build_parser().parse_args(["up"])), lambda: (0, "")).reasoning_parser == ""


def test_include_reasoning_false_leaves_the_reasoning_out(tmp_path):
    """vLLM's include_reasoning false: no reasoning, whole or streamed (no chunk of reasoning alone), nor the logprobs
    and token ids that would spell it; pushkv took the field and returned the reasoning."""
    out = list(b"<think>ab</think>hi")
    chunks = [out[:3], out[3:9], out[9:15], out[15:]]

    async def body():
        cfg = make_cfg(tmp_path, "local", reasoning_parser="deepseek_r1")
        async with Harness(cfg, {"local": local_script(chunks, "stop")}) as h:
            req = {"messages": MESSAGES, "max_tokens": 32, "include_reasoning": False, "logprobs": True,
                   "return_token_ids": True}
            choice = (await (await h.http.post("/v1/chat/completions", json=req)).json())["choices"][0]
            r = await h.http.post("/v1/chat/completions", json=dict(req, stream=True))
            return choice, [e["choices"][0] for e in await read_sse(r) if e != "[DONE]" and e["choices"]]
    choice, streamed = run(body())
    msg = choice["message"]
    assert (msg["reasoning"], msg["reasoning_content"], msg["content"]) == (None, None, "hi")
    assert choice["logprobs"] is None and "token_ids" not in choice
    deltas = [c["delta"] for c in streamed]
    assert not any(d.get("reasoning") or d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == "hi" and streamed[-1]["finish_reason"] == "stop"
    assert all(c["logprobs"] is None and "token_ids" not in c for c in streamed)
    assert len(streamed) <= 3  # the role, then the answer's: no chunk for the reasoning alone


@pytest.mark.parametrize("output, want", [("<think>ab</think>hi", 2), ("<think>你好</think>hi", 6), ("no tags", 7),
                                          ("plan</think>x", 4)])
def test_usage_counts_the_reasoning_tokens_as_vllm_does(tmp_path, output, want):
    """vLLM 0.32, with a reasoning parser: usage.completion_tokens_details.reasoning_tokens, the output tokens that
    wrote reasoning (its tags not; a character's bytes each a token here), unary and in a stream's usage chunk,
    include_reasoning false or not; pushkv had no such field."""
    ids = list(output.encode())

    async def body():
        cfg = make_cfg(tmp_path, "local", reasoning_parser="deepseek_r1")
        async with Harness(cfg, {"local": local_script([ids[:5], ids[5:]], "stop")}) as h:
            got = []
            for extra in ({}, {"include_reasoning": False},
                          {"stream": True, "stream_options": {"include_usage": True}}):
                r = await h.http.post("/v1/chat/completions", json={"messages": MESSAGES, "n": 2, **extra})
                usage = (await read_sse(r))[-2]["usage"] if extra.get("stream") else (await r.json())["usage"]
                got.append(usage["completion_tokens_details"])
            return got
    assert run(body()) == [{"reasoning_tokens": 2 * want}] * 3  # both choices'


def test_continuous_usage_counts_the_reasoning_tokens_so_far_in_each_chunk(tmp_path):
    """vLLM 0.32's continuous_usage_stats with a reasoning parser: every chunk's usage has
    completion_tokens_details.reasoning_tokens, the choice's so far (the role's chunk 0); pushkv gave it only in the
    final usage chunk, so a client reading it per chunk found None."""
    ids = list(b"<think>abc</think>hi")

    async def body():
        cfg = make_cfg(tmp_path, "local", reasoning_parser="deepseek_r1")
        async with Harness(cfg, {"local": local_script([ids[:9], ids[9:12], ids[12:]], "stop")}) as h:
            r = await h.http.post("/v1/chat/completions", json={
                "messages": MESSAGES, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
            return [e["usage"] for e in await read_sse(r) if e != "[DONE]"]
    usages = run(body())
    got = [(u["completion_tokens"], u["completion_tokens_details"]["reasoning_tokens"]) for u in usages]
    assert got[0] == (0, 0) and got[-1] == (len(ids), 3)  # the role's chunk; the final usage
    assert (9, 2) in got and all(a <= b for a, b in zip(got, got[1:]))  # "<think>ab" so far: 2
