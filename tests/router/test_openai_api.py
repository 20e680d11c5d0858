"""The OpenAI surface through the official `openai` client against real deployments
(local, push, pull): completions and chat, streaming and not, seeded sampling
equal across modes, stop strings, logprobs, n, echo, penalties, bias, min_tokens.

The random-weight preset answers with random bytes, so what is compared is
exact equality across modes and between streaming and not, and the text's
relation to the token ids (the byte tokenizer: text = the ids' UTF-8 decode).
"""
import json

import pytest

from tests.support.deploy import deployment, wait_pools_free

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(600)

COMMON = ("--model", "tiny", "--num-blocks", "256", "--tool-call-parser", "hermes")  # (a forced tool_choice needs it)
MODES = {
    "local": ("--mode", "local"),
    "push": ("--mode", "push"),
    "pull": ("--mode", "pull", "--pull-read", "background"),
}
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=4242, presence_penalty=0.3, frequency_penalty=0.2,
               logit_bias={"65": 2.0}, extra_body={"top_k": 100, "min_p": 0.01})  # vLLM's extras
PROMPTS = ["The quick brown fox", "你好，世界！今天天气很好。", "emoji 😀👍🏽 family 👨‍👩‍👧 ok"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "早上好 😀, say hi"}]


@pytest.fixture(scope="module")
def deps(tmp_path_factory):
    from contextlib import ExitStack

    with ExitStack() as stack:
        out = {name: stack.enter_context(deployment(tmp_path_factory.mktemp(name), *flags, *COMMON))
               for name, flags in MODES.items()}
        yield out
        for dep in out.values():
            wait_pools_free(dep)


def client(dep):
    return openai.OpenAI(base_url=dep.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def as_text(ids):
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def completion(dep, prompt, **kw):
    r = client(dep).completions.create(model="tiny", prompt=prompt, **kw)
    c = r.choices[0]
    lp = c.logprobs
    return c.text, c.token_ids, c.finish_reason, (lp.token_logprobs, lp.top_logprobs) if lp else None


def test_models_lists_the_served_model(deps):
    for dep in deps.values():
        models = client(dep).models.list().data
        assert [m.id for m in models] == ["tiny"] and models[0].owned_by == "pushkv"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_seeded_completion_equal_across_modes(deps, prompt):
    got = {name: completion(dep, prompt, max_tokens=12, logprobs=3, **SAMPLED) for name, dep in deps.items()}
    ref = got["local"]
    text, ids, reason, (lps, tops) = ref
    assert len(ids) == 12 and reason == "length" and text == as_text(ids)
    # the sampled token's entry and the top 3 (N + 1 at most, as OpenAI's; token strings may collide)
    assert len(lps) == 12 and all(len(t) <= 4 and t for t in tops)
    for name in ("push", "pull"):
        assert got[name][:3] == ref[:3], name
        assert got[name][3][0] == pytest.approx(lps, abs=1e-5), name
    greedy = completion(deps["local"], prompt, max_tokens=12)[1]
    assert ids != greedy  # sampling did something
    again = completion(deps["push"], prompt, max_tokens=12, logprobs=3, **SAMPLED)
    assert again[1] == ids  # the seed fixes it
    other = completion(deps["push"], prompt, max_tokens=12, **{**SAMPLED, "seed": 7})
    assert other[1] != ids


def stream_completion(dep, prompt, **kw):
    chunks = list(client(dep).completions.create(model="tiny", prompt=prompt, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    body = [c for c in chunks if c.choices]
    return ("".join(c.choices[0].text for c in body), [t for c in body for t in c.choices[0].token_ids],
            body[-1].choices[0].finish_reason, chunks[-1].usage)


@pytest.mark.parametrize("mode", list(MODES))
def test_streaming_equals_unary(deps, mode):
    dep = deps[mode]
    for prompt in PROMPTS:
        text, ids, reason, _ = completion(dep, prompt, max_tokens=10, **SAMPLED)
        s_text, s_ids, s_reason, usage = stream_completion(dep, prompt, max_tokens=10, **SAMPLED)
        assert (s_text, s_ids, s_reason) == (text, ids, reason)
        assert usage.completion_tokens == 10


def chat(dep, **kw):
    r = client(dep).chat.completions.create(model="tiny", messages=MESSAGES, **kw)
    return r


@pytest.mark.parametrize("mode", list(MODES))
def test_chat_streaming_and_not_equal_local(deps, mode):
    kw = dict(max_completion_tokens=10, logprobs=True, top_logprobs=2, **SAMPLED)
    ref = chat(deps["local"], **kw)
    got = chat(deps[mode], **kw)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    msg = got.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.choices[0].message.content
    assert got.usage.completion_tokens == 10 and got.usage.prompt_tokens == ref.usage.prompt_tokens
    content = got.choices[0].logprobs.content
    assert len(content) == 10 and all(len(c.top_logprobs) == 2 for c in content)
    assert [c.logprob for c in content] == pytest.approx([c.logprob for c in ref.choices[0].logprobs.content],
                                                         abs=1e-5)
    chunks = list(client(deps[mode]).chat.completions.create(
        model="tiny", messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == got.usage.total_tokens


def test_chat_prompt_uses_the_plain_template(deps):
    r = chat(deps["local"], max_tokens=1)
    rendered = "system: You are terse.\nuser: 早上好 😀, say hi\nassistant:"
    assert r.usage.prompt_tokens == len(rendered.encode("utf-8"))


@pytest.mark.parametrize("mode", list(MODES))
def test_stop_string_spanning_tokens(deps, mode):
    dep = deps[mode]
    prompt = "Stop strings: "
    full, ids, _, _ = completion(dep, prompt, max_tokens=16, logit_bias={str(i): 8.0 for i in range(97, 123)})
    assert full.isascii() and len(full) == 16  # bias to a..z: one letter per token, readable
    stop = full[5:8]  # three tokens
    cut = full.index(stop)
    for stream in (False, True):
        kw = dict(max_tokens=16, logit_bias={str(i): 8.0 for i in range(97, 123)}, stop=[stop, "never"])
        text, got_ids, reason, _ = (stream_completion(dep, prompt, **kw) if stream else completion(dep, prompt, **kw))
        assert text == full[:cut] and reason == "stop", stream
        assert got_ids == ids[:cut + len(stop)]  # generation ended on the token that completed the stop
    wait_pools_free(dep)


@pytest.mark.parametrize("mode", list(MODES))
def test_min_tokens_bias_and_n(deps, mode):
    dep = deps[mode]
    greedy = completion(dep, "abc", max_tokens=6)[1]
    # the first greedy token as a stop id: generation ends there, unless min_tokens holds it off
    stopped = completion(dep, "abc", max_tokens=6, extra_body={"stop_token_ids": [greedy[0]]})
    assert stopped[1] == greedy[:1] and stopped[2] == "stop"
    held = completion(dep, "abc", max_tokens=6, extra_body={"stop_token_ids": [greedy[0]], "min_tokens": 3})
    assert len(held[1]) >= 3 and greedy[0] not in held[1][:3]
    forced = completion(dep, "abc", max_tokens=4, logit_bias={"90": 100})
    assert forced[0] == "ZZZZ"
    r = client(dep).completions.create(model="tiny", prompt="abc", max_tokens=8, n=3, **SAMPLED)
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 24
    one = completion(dep, "abc", max_tokens=8, **SAMPLED)
    assert r.choices[0].token_ids == one[1]  # choice 0 draws from the request's own seed
    assert len({tuple(c.token_ids) for c in r.choices}) == 3
    echo = client(dep).completions.create(model="tiny", prompt="abc", max_tokens=3, echo=True)
    assert echo.choices[0].text.startswith("abc") and echo.choices[0].text[3:] == as_text(greedy[:3])
    wait_pools_free(dep)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_batch_of_prompts_gives_each_prompts_own_choices(deps, mode):
    """The openai client's prompt as a list: prompt p's n choices are choices p * n ... (vLLM's order), each the
    tokens that prompt gives alone; usage counts each prompt once; streamed, the same choices by index."""
    dep = deps[mode]
    prompts = ["abc", "The quick brown fox", [5, 17, 42]]
    alone = [completion(dep, p, max_tokens=5)[1] for p in prompts]
    r = client(dep).completions.create(model="tiny", prompt=prompts, max_tokens=5, n=2, echo=True)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.token_ids for c in r.choices] == [ids for ids in alone for _ in range(2)]  # greedy: n alike
    assert r.choices[2].text == "The quick brown fox" + as_text(alone[1])  # echo: each choice's own prompt
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3 + 19 + 3, 6 * 5)
    chunks = list(client(dep).completions.create(model="tiny", prompt=prompts, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed: dict[int, list[int]] = {}
    for c in chunks:
        for ch in c.choices:
            streamed.setdefault(ch.index, []).extend(ch.token_ids)
    assert streamed == dict(enumerate(alone)) and chunks[-1].usage.prompt_tokens == 25
    wait_pools_free(dep)


def test_bad_fields_are_400_naming_the_field(deps):
    c = client(deps["push"])
    for kw, field in [({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"),
                      ({"logprobs": 99}, "logprobs"), ({"n": 100}, "n"), ({"stop": [3]}, "stop")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt="x", max_tokens=2, **kw)
        assert e.value.body["param"] == field and field in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "", "content": "x"}])
    assert e.value.body["param"] == "messages[0].role"
    # unknown fields are ignored
    r = c.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"no_such_field": {"a": 1}})
    assert len(r.choices[0].token_ids) == 2


def test_checkpoint_chat_template_and_cjk_text(tmp_path):
    """A Llama checkpoint with a Hugging Face tokenizer and a chat template in tokenizer_config.json:
    chat renders through it; CJK and emoji prompts come back as whole characters, streamed or not."""
    import json

    from tokenizers import Tokenizer

    from pushkv.config import preset
    from pushkv.router.chat import ChatTemplate
    from tests.model.test_model import write_checkpoint

    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), preset("tiny", seed=5, qk_norm=False, vocab_size=300), "LlamaForCausalLM", False)
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>",
                                                            "eos_token": "</s>"}))
    hf = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    d = tmp_path / "dep"
    d.mkdir()
    with deployment(d, "--mode", "push", "--checkpoint", str(ckpt), "--num-blocks", "128") as dep:
        c = client(dep)
        r = c.chat.completions.create(model="ckpt", messages=MESSAGES, max_tokens=6, temperature=0.7, seed=3)
        rendered = ChatTemplate(template, "<s>", "</s>").render(MESSAGES)
        assert rendered.startswith("<s><|system|>You are terse.</s>")
        assert r.usage.prompt_tokens == len(hf.encode(rendered, add_special_tokens=False).ids)
        for prompt in PROMPTS[1:]:
            kw = dict(max_tokens=24, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
            unary = c.completions.create(model="ckpt", prompt=prompt, **kw).choices[0]
            chunks = [ch for ch in c.completions.create(model="ckpt", prompt=prompt, stream=True, **kw) if ch.choices]
            assert "".join(ch.choices[0].text for ch in chunks) == unary.text
            assert [t for ch in chunks for t in ch.choices[0].token_ids] == unary.token_ids
            whole = hf.decode(unary.token_ids, skip_special_tokens=True)
            assert unary.text == whole
        wait_pools_free(dep)


@pytest.mark.parametrize("mode", list(MODES))
def test_responses_api_gives_the_chat_completions_text(deps, mode):
    """/v1/responses through the official client (which parses every object and event it gets): the greedy text of
    instructions + input equals the chat completion's of the same two messages, unary and streamed, with the same
    usage; the stream is OpenAI's typed events in sequence, ending with the whole response."""
    c = client(deps[mode])
    chat = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    want = chat.choices[0].message.content
    ask = dict(model="tiny", instructions=MESSAGES[0]["content"], input=MESSAGES[1]["content"], max_output_tokens=12,
               temperature=0)
    r = c.responses.create(**ask)
    assert r.output_text == want and r.object == "response"
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    events = list(c.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-1] == f"response.{r.status}" and [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want and events[-1].response.usage.output_tokens == r.usage.output_tokens


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def streamed_calls(chunks) -> dict[int, list[dict]]:
    """Each choice's tool calls, joined from a stream's pieces as an OpenAI client joins them, each with how many
    pieces carried its arguments; every piece after a call's first carries arguments alone."""
    out: dict[int, list[dict]] = {}
    for ch in chunks:
        for c in ch.choices:
            assert c.delta.content in (None, "") or c.delta.role, c  # the role's chunk alone has content ""
            for t in c.delta.tool_calls or []:
                calls = out.setdefault(c.index, [])
                if t.id is not None:
                    assert t.index == len(calls) and t.type == "function" and t.function.name, t
                    calls.append({"name": t.function.name, "arguments": "", "pieces": 0})
                else:
                    assert t.type is None and t.function.name is None, t
                calls[t.index]["arguments"] += t.function.arguments
                calls[t.index]["pieces"] += bool(t.function.arguments)
    return out


@pytest.mark.parametrize("mode", ["local", "push"])
def test_a_forced_named_tool_call_streams_its_arguments_as_they_come(deps, mode):
    """tool_choice naming a function, streamed as vLLM streams it (pushkv sent each call whole at the end): each
    choice's call opens with its id, type and name, its arguments follow a token at a time and join to the whole
    response's, n > 1 each choice its own; cut by max_tokens, the call is still there (finish_reason length); the
    usage chunk last, as the whole response's usage."""
    c = client(deps[mode])
    ask = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, CLOCK], n=2, temperature=0.9, seed=11,
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for max_tokens, finish in ((40, "stop"), (6, "length")):
        whole = c.chat.completions.create(**ask, max_tokens=max_tokens)
        chunks = list(c.chat.completions.create(**ask, max_tokens=max_tokens, stream=True,
                                                stream_options={"include_usage": True}))
        got = streamed_calls(chunks)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        for choice in whole.choices:
            (call,) = choice.message.tool_calls
            assert (choice.finish_reason, choice.message.content) == (finish, "")
            assert got[choice.index] == [{"name": "get_weather", "arguments": call.function.arguments,
                                          "pieces": got[choice.index][0]["pieces"]}]
            assert got[choice.index][0]["pieces"] > 2, got  # a token at a time (the tiny model's are bytes)
            if finish == "stop":
                assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
            last = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == choice.index][-1]
            assert last.finish_reason == finish


def test_required_tool_calls_stream_as_they_come(deps):
    """tool_choice required, streamed as vLLM streams it: each call opens once its name is written, its parameters
    follow as written (compact: the grammar writes no white space), and they are JSON-equal to the whole
    response's (which re-writes them); finish_reason tool_calls."""
    c = client(deps["local"])
    ask = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice="required", temperature=0.9,
               seed=5, max_tokens=400)
    whole = c.chat.completions.create(**ask).choices[0]
    got = streamed_calls(c.chat.completions.create(**ask, stream=True))[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    assert [(g["name"], json.loads(g["arguments"])) for g in got] == [
        (t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
    assert all(g["pieces"] > 2 for g in got), got


def test_echo_streams_the_prompt_with_the_first_tokens(deps):
    """/v1/completions echo streamed as vLLM streams it: the prompt's text (and its tokens' logprobs) in the chunk of
    the choice's first tokens, never a token-less chunk of its own; joined, the whole response. Chat's echo: the
    continued message in a chunk of its own after the role's."""
    c = client(deps["local"])
    prompt = PROMPTS[0]
    ask = dict(model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=1, n=2, seed=3, temperature=0.9)
    whole = c.completions.create(**ask)
    chunks = [ch for ch in c.completions.create(**ask, stream=True) if ch.choices]
    for choice in whole.choices:
        mine = [ch.choices[0] for ch in chunks if ch.choices[0].index == choice.index]
        assert all(m.token_ids for m in mine), mine  # each chunk its tokens: none the prompt's alone
        assert mine[0].text.startswith(prompt)  # with its first tokens (token_ids above)
        assert "".join(m.text for m in mine) == choice.text
        lps = [x for m in mine for x in m.logprobs.token_logprobs]
        assert lps == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5) and lps[0] is None
        assert [x for m in mine for x in m.logprobs.text_offset] == choice.logprobs.text_offset
    prefix = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    chat_chunks = list(c.chat.completions.create(model="tiny", messages=prefix, max_tokens=3, stream=True,
                                                 extra_body={"echo": True, "continue_final_message": True,
                                                             "add_generation_prompt": False}))
    deltas = [(ch.choices[0].delta.role, ch.choices[0].delta.content) for ch in chat_chunks[:2]]
    assert deltas == [("assistant", ""), (None, "The answer is")]


def test_an_auto_tool_call_streams_its_arguments_as_they_come(tmp_path):
    """tool_choice auto with --tool-call-parser hermes, streamed as vLLM 0.32 streams it (pushkv sent each call whole
    once its closing tag came): the content before the call as it comes, then the call opens with its id, type and
    name and its arguments follow a token at a time, joining to the whole response's (json.dumps' layout, whatever
    spacing the model wrote); finish_reason tool_calls. The tiny model is held to a hermes call by a regex."""
    regex = (r'Checking\.\n<tool_call>\n\{"name": ?"get_weather", ?"arguments": ?\{"city": ?"(Paris|Rome)", ?'
             r'"days": ?[1-9]\}\}\n</tool_call>')
    with deployment(tmp_path, *MODES["local"], *COMMON) as dep:
        c = client(dep)
        ask = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, CLOCK], n=2, temperature=0.9, seed=3,
                   max_tokens=200, extra_body={"structured_outputs": {"regex": regex}})
        whole = c.chat.completions.create(**ask)
        chunks = list(c.chat.completions.create(**ask, stream=True))
        wait_pools_free(dep)
    got = streamed_calls([ch for ch in chunks if not (ch.choices and ch.choices[0].delta.content)])
    for choice in whole.choices:
        (call,) = choice.message.tool_calls
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", "Checking.\n")
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == choice.index]
        assert "".join(m.delta.content or "" for m in mine) == "Checking.\n"
        assert got[choice.index] == [{"name": "get_weather", "arguments": call.function.arguments,
                                      "pieces": got[choice.index][0]["pieces"]}]
        assert got[choice.index][0]["pieces"] > 10, got  # a token at a time (the tiny model's are bytes)
        opening = next(t for m in mine for t in m.delta.tool_calls or [] if t.id is not None)
        assert opening.function.arguments == ""  # opened with its name, before its arguments were written
        assert mine[-1].finish_reason == "tool_calls" and all(m.finish_reason is None for m in mine[:-1])
