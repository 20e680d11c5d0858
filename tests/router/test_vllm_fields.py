"""vLLM's own request fields: ``add_special_tokens`` taken (completions true by default, chat false, as vLLM's),
``allowed_token_ids`` and ``bad_words`` taken as vLLM takes them, and every field that would change the answer and is
not built refused naming it, never silently ignored."""
from __future__ import annotations

import types

import pytest

from pushkv import limits as L
from pushkv.model.tokenizer import HFTokenizer
from pushkv.router import api, chat, output, tool_calls
from tests.model.test_hf_reference import _tokenizer
from tests.router.test_chat_fields import MESSAGES, QWEN3_LIKE

LIMITS = api.Limits(vocab_size=300, max_model_len=512)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    _tokenizer(path)  # a Llama-style tokenizer: <s> (id 2) put in front of every text
    return HFTokenizer(f"{path}/tokenizer.json", bos_token_id=2)


def test_add_special_tokens_as_vllm_takes_it(tok):
    text = "hello world"
    with_bos = api.parse_completion({"prompt": text}, tok, LIMITS).prompt_token_ids
    bare = api.parse_completion({"prompt": text, "add_special_tokens": False}, tok, LIMITS).prompt_token_ids
    assert with_bos[0] == 2 and bare == with_bos[1:]
    # token ids are taken as given either way
    assert api.parse_completion({"prompt": [2, 5], "add_special_tokens": False}, tok, LIMITS).prompt_token_ids == [2, 5]
    template = chat.ChatTemplate(QWEN3_LIKE)
    plain = chat.parse_chat({"messages": MESSAGES}, tok, LIMITS, template).prompt_token_ids
    special = chat.parse_chat({"messages": MESSAGES, "add_special_tokens": True}, tok, LIMITS,
                              template).prompt_token_ids
    assert special == [2, *plain]


@pytest.mark.parametrize("field, value", [("length_penalty", 0.5), ("priority", 1), ("priority", -3),
                                          # vLLM 0.32's, which pushkv took and ignored
                                          ("watermarking", True), ("repetition_detection", {"max_pattern_size": 4}),
                                          ("prompt_embeds", "AAAA")])
def test_a_vllm_field_that_would_change_the_answer_is_refused(tok, field, value):
    for parse in (lambda b: api.parse_completion({"prompt": "hi", **b}, tok, LIMITS),
                  lambda b: chat.parse_chat({"messages": MESSAGES, **b}, tok, LIMITS, chat.ChatTemplate(QWEN3_LIKE))):
        with pytest.raises(api.ApiError) as e:
            parse({field: value})
        assert (e.value.status, e.value.param) == (400, field) and "is not supported" in e.value.message


@pytest.mark.parametrize("field", sorted(api.VLLM_UNBUILT))
def test_the_values_that_change_nothing_are_taken(tok, field):
    for value in api.VLLM_UNBUILT[field][0]:
        api.parse_completion({"prompt": "hi", field: value}, tok, LIMITS)


def test_skip_special_tokens_false_keeps_them_in_the_text_and_the_stop_id_out(tok):
    """vLLM's skip_special_tokens: false keeps special tokens in the text; the id that ended the choice (EOS here)
    is in its token ids and never in its text, either way."""
    ids = tok.encode("hello world")
    eos = 3  # </s>
    assert ids[0] == 2 and 2 not in ids[1:]  # <s>, special
    for body, want in (({}, "hello world"), ({"skip_special_tokens": False}, "<s>hello world"),
                       ({"skip_special_tokens": True}, "hello world")):
        params = api.parse_completion({"prompt": "x", "stop_token_ids": [eos], **body}, tok, LIMITS)
        out = output.ChoiceOutput(0, tok, stop_ids=params.stop_token_ids, skip_special=params.skip_special_tokens)
        streamed = "".join(out.add([i]).text for i in [*ids, eos]) + out.finish("stop").text
        assert (streamed, out.text, out.token_ids) == (want, want, [*ids, eos])
    with pytest.raises(api.ApiError) as e:
        api.parse_completion({"prompt": "x", "skip_special_tokens": "no"}, tok, LIMITS)
    assert (e.value.status, e.value.param) == (400, "skip_special_tokens")


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory):
    """A tokenizer whose decoder puts a space between tokens (WordPiece's), with two added tokens <a> and <b>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    t.train_from_iterator(["hello world the fox"] * 10,
                          trainers.WordPieceTrainer(vocab_size=120, special_tokens=["[UNK]", "<a>", "<b>"]))
    path = str(tmp_path_factory.mktemp("wordpiece") / "tokenizer.json")
    t.save(path)
    return HFTokenizer(path)


@pytest.mark.parametrize("body, want", [
    ({}, "hello world the fox"),  # special tokens skipped: the field changes nothing
    ({"skip_special_tokens": False}, "hello <a> <b> world <a> the <a> <b> <a> fox"),
    ({"skip_special_tokens": False, "spaces_between_special_tokens": True},
     "hello <a> <b> world <a> the <a> <b> <a> fox"),
    ({"skip_special_tokens": False, "spaces_between_special_tokens": False},
     "hello <a><b> world <a> the <a><b><a> fox"),
], ids=["skipped", "kept", "kept-spaces", "kept-no-spaces"])
def test_spaces_between_special_tokens_false_writes_added_tokens_back_to_back(wordpiece, body, want):
    """vLLM's spaces_between_special_tokens: false, with special tokens kept, writes an added token right after
    another with nothing between them; the rest of the text is the tokenizer's, streamed token by token or whole."""
    ids = wordpiece.encode("hello <a><b> world <a> the <a> <b><a> fox")
    assert {1, 2} <= set(ids)
    params = api.parse_completion({"prompt": "x", **body}, wordpiece, api.Limits(vocab_size=120, max_model_len=64))
    assert params.spaces_between_special_tokens == body.get("spaces_between_special_tokens", True)
    out = output.ChoiceOutput(0, wordpiece, skip_special=params.skip_special_tokens,
                              spaces_between_special=params.spaces_between_special_tokens)
    streamed = "".join(out.add([i]).text for i in ids) + out.finish("length").text
    assert (streamed, out.text) == (want, want)
    whole = output.ChoiceOutput(0, wordpiece, skip_special=params.skip_special_tokens,
                                spaces_between_special=params.spaces_between_special_tokens)
    assert whole.add(ids).text + whole.finish("length").text == want


def test_the_request_field_reaches_each_choices_text(wordpiece):
    from pushkv.router.generate import Generation

    params = api.parse_completion({"prompt": "x", "n": 2, "skip_special_tokens": False,
                                   "spaces_between_special_tokens": False}, wordpiece,
                                  api.Limits(vocab_size=120, max_model_len=64))
    run = types.SimpleNamespace(transfer_id="r1-0")  # Generation reads only the id of its first run here
    outs = Generation(params, [run, run], wordpiece, "m").outs
    assert len(outs) == 2 and all(not o.spaces_between_special and not o.skip_special for o in outs)


@pytest.mark.parametrize("parser, keeps", [("mistral", True), ("hermes", False), ("pythonic", False)])
def test_a_parser_whose_markers_are_special_tokens_keeps_them_in_the_text(tok, parser, keeps):
    """Mistral's [TOOL_CALLS] is a special token: a chat request its parser reads keeps special tokens, as vLLM's
    mistral parser does; with tool_choice none (no parser) the text is as usual."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": MESSAGES, "tools": tools}
    template = chat.ChatTemplate(QWEN3_LIKE)
    params = chat.parse_chat(body, tok, LIMITS, template, tool_call_parser=parser)
    assert (params.tool_call_parser, params.skip_special_tokens) == (parser, not keeps)
    assert (parser in tool_calls.KEEPS_SPECIAL_TOKENS) == keeps
    plain = chat.parse_chat({**body, "tool_choice": "none"}, tok, LIMITS, template, tool_call_parser=parser)
    assert (plain.tool_call_parser, plain.skip_special_tokens) == ("", True)


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output_ends_the_text_with_the_stop(tok, include):
    """vLLM's include_stop_str_in_output: the text ends with the stop string that ended it (the first to begin,
    the longest of those beginning there), or with the stop id's text (special tokens kept, here); without it,
    before them. Streamed piece by piece or whole, the same text."""
    body = {"prompt": "x", "stop": ["o w", "zz"], "include_stop_str_in_output": include}
    params = api.parse_completion(body, tok, LIMITS)
    assert params.include_stop_str_in_output is include
    ids = tok.encode("hello world")[1:]
    out = output.ChoiceOutput(0, tok, params.stop, stop_ids=params.stop_token_ids,
                              include_stop=params.include_stop_str_in_output)
    text = "".join(out.add([i]).text for i in ids)
    assert (text, out.finish_reason) == (("hello w" if include else "hell"), "stop")
    # two beginning at one place in the text at hand: the longest
    assert output.StopStrings(["o", "o w", "l"], include).feed("hello world", final=True) == (
        "hel" if include else "he", "l")
    assert output.StopStrings(["o", "o w"], include).feed("hello world", final=True) == (
        "hello w" if include else "hell", "o w")
    eos = 3  # </s>, kept in the text with skip_special_tokens false
    by_id = api.parse_completion({"prompt": "x", "stop_token_ids": [eos], "skip_special_tokens": False,
                                  "include_stop_str_in_output": include}, tok, LIMITS)
    out = output.ChoiceOutput(0, tok, stop_ids=by_id.stop_token_ids, skip_special=False,
                              include_stop=by_id.include_stop_str_in_output)
    text = "".join(out.add([i]).text for i in [*ids, eos]) + out.finish("stop").text
    assert text == ("hello world</s>" if include else "hello world")


def test_stop_reason_names_the_stop_string_or_the_requests_own_stop_id(tok):
    """vLLM's stop_reason (its check_stop and detokenizer): the stop string that matched, the stop_token_ids entry
    or other EOS id that ended the choice, None on the tokenizer's EOS (one the request lists too, unless it ignores
    EOS) or length."""
    eos = 3
    limits = api.Limits(vocab_size=300, max_model_len=512, eos_token_ids=(eos,))
    ids = tok.encode("hello world")[1:]
    for body, last, want in [({"stop_token_ids": [eos, 9]}, 9, 9), ({"stop_token_ids": [eos, 9]}, eos, None),
                             ({"stop_token_ids": [eos], "ignore_eos": True}, eos, eos), ({}, eos, None)]:
        params = api.parse_completion({"prompt": "x", **body}, tok, limits)
        out = output.ChoiceOutput(0, tok, stop_ids=params.stop_token_ids, reason_ids=params.stop_reason_ids)
        out.add([*ids, last])
        assert (out.finish("stop").stop_reason, out.stop_reason) == (want, want), body
    # a checkpoint with several EOS ids (a Llama 3 instruct's three): the tokenizer's own ends with no stop_reason,
    # the others name themselves, as in vLLM, where generation_config's EOS ids join the stop_token_ids
    for main, last, want in [(-1, 3, None), (-1, 5, 5), (5, 5, None), (5, 3, 3)]:
        several = api.Limits(vocab_size=300, max_model_len=512, eos_token_ids=(3, 5), main_eos_id=main)
        params = api.parse_completion({"prompt": "x"}, tok, several)
        out = output.ChoiceOutput(0, tok, stop_ids=params.stop_token_ids, reason_ids=params.stop_reason_ids)
        out.add([*ids, last])
        assert out.finish("stop").stop_reason == want, (main, last)
    capped = output.ChoiceOutput(0, tok, stop_ids=(9,), reason_ids=(9,))
    capped.add(ids)
    assert capped.finish("length").stop_reason is None
    out = output.ChoiceOutput(0, tok, ("o w", "zz"))
    assert out.add(ids).stop_reason == "o w" and (out.finish_reason, out.stop_reason) == ("stop", "o w")


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tok):
    """vLLM's truncate_prompt_tokens: k keeps the last k tokens of each prompt (chat: of the rendered prompt), -1
    the last max_model_len; echo shows the prompt that was kept; 0 and below -1 are a 400 naming the field."""
    ids = tok.encode("hello world, the quick brown fox")
    assert len(ids) > 4
    p = api.parse_completion({"prompt": "hello world, the quick brown fox", "truncate_prompt_tokens": 4,
                              "echo": True, "max_tokens": 1}, tok, LIMITS)
    assert p.prompt_token_ids == ids[-4:] and p.prompt_text == tok.decode(ids[-4:])
    batch = api.parse_completion({"prompt": [[5, 6, 7], [8, 9]], "truncate_prompt_tokens": 2}, tok, LIMITS)
    assert [i for i, _ in batch.prompts()] == [[6, 7], [8, 9]]
    small = api.Limits(vocab_size=300, max_model_len=3)
    # -1: the last max_model_len (which leaves no room for an output: refused then, as a prompt that long is)
    assert api.truncate_prompt([5, 6, 7, 8, 9], {"truncate_prompt_tokens": -1}, small) == [7, 8, 9]
    template = chat.ChatTemplate(QWEN3_LIKE)
    whole = chat.parse_chat({"messages": MESSAGES}, tok, LIMITS, template).prompt_token_ids
    assert chat.parse_chat({"messages": MESSAGES, "truncate_prompt_tokens": 5}, tok, LIMITS,
                           template).prompt_token_ids == whole[-5:]
    for bad_k in (0, -2, "3"):
        with pytest.raises(api.ApiError) as e:
            api.parse_completion({"prompt": [5, 6], "truncate_prompt_tokens": bad_k}, tok, LIMITS)
        assert (e.value.status, e.value.param) == (400, "truncate_prompt_tokens")
    with pytest.raises(api.ApiError) as e:  # more than max_model_len
        api.parse_completion({"prompt": [5, 6], "truncate_prompt_tokens": 4}, tok, small)
    assert e.value.param == "truncate_prompt_tokens"


def _both(tok, body: dict):
    """``body``'s sampling parameters as completions and as chat take them (the same)."""
    a = api.parse_completion({"prompt": "hi", **body}, tok, LIMITS).sampling
    b = chat.parse_chat({"messages": MESSAGES, **body}, tok, LIMITS, chat.ChatTemplate(QWEN3_LIKE)).sampling
    assert a == b
    return a


def test_allowed_token_ids_are_taken_sorted_once_each(tok):
    assert _both(tok, {"allowed_token_ids": [9, 4, 9, 0]}).allowed_token_ids == (0, 4, 9)
    assert _both(tok, {}).allowed_token_ids == ()


def test_bad_words_are_written_as_vllm_writes_them(tok):
    """Each word as the tokenizer writes it at a text's start and, where that is another first token and as many
    tokens, after a space ("the lazy": both; "fox" and "hello" take another length after a space: the bare one
    only). A leading space is the word's own, dropped as vLLM drops it; a word given twice is one."""
    bare, spaced = api.encode_bare(tok, "the lazy", "x"), api.encode_bare(tok, " the lazy", "x")
    assert len(bare) == len(spaced) == 2 and bare[0] != spaced[0] and bare[1] == spaced[1]
    fox = api.encode_bare(tok, "fox", "x")
    assert len(api.encode_bare(tok, " fox", "x")) != len(fox)
    got = _both(tok, {"bad_words": ["the lazy", "fox", " fox", "hello"]}).bad_words
    assert got == (tuple(bare), tuple(spaced), tuple(fox), tuple(api.encode_bare(tok, "hello", "x")))
    assert 2 not in {t for w in got for t in w}  # never the tokenizer's <s>


@pytest.mark.parametrize("body, field, needle", [
    ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty list"),
    ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids", "non-empty list"),
    ({"allowed_token_ids": [300]}, "allowed_token_ids", "token id 300 outside"),
    ({"allowed_token_ids": list(range(L.MAX_ALLOWED_TOKEN_IDS + 1))}, "allowed_token_ids",
     f"at most {L.MAX_ALLOWED_TOKEN_IDS}"),
    ({"bad_words": "fox"}, "bad_words", "list of non-blank strings"),
    ({"bad_words": ["fox", "  "]}, "bad_words", "list of non-blank strings"),
    ({"bad_words": ["fox"] * (L.MAX_BAD_WORDS + 1)}, "bad_words", f"at most {L.MAX_BAD_WORDS} bad_words"),
    ({"bad_words": ["z" * 3 * L.MAX_BAD_WORD_TOKENS]}, "bad_words", f"at most {L.MAX_BAD_WORD_TOKENS} tokens"),
    ({"allowed_token_ids": [3, 4], "bad_words": ["hello", "fox"], "_ban": [3, 4]}, "bad_words",
     "ban every one of allowed_token_ids"),
    ({"allowed_token_ids": [5, 6], "stop_token_ids": [5, 6], "min_tokens": 1}, "min_tokens", "is a stop token"),
], ids=["allowed-empty", "allowed-type", "allowed-outside", "allowed-many", "bad-type", "bad-blank", "bad-many",
        "bad-long", "nothing-left-bad", "nothing-left-stops"])
def test_allowed_token_ids_and_bad_words_past_a_bound_are_400_naming_the_field(tok, body, field, needle):
    body = dict(body)
    if body.pop("_ban", None):  # the allowed ids: exactly the one-token bad words' tokens
        words = [w for w in ("hello", "the", "fox", "dog", "o", "x") if len(api.encode_bare(tok, w, "x")) == 1][:2]
        body["bad_words"] = words
        body["allowed_token_ids"] = [api.encode_bare(tok, w, "x")[0] for w in words]
    with pytest.raises(api.ApiError) as e:
        api.parse_completion({"prompt": "hi", **body}, tok, LIMITS)
    assert (e.value.status, e.value.param) == (400, field) and needle in e.value.message, e.value.message


def test_cache_salt_is_taken_as_a_non_empty_string(tok):
    for parse in (lambda b: api.parse_completion({"prompt": "hi", **b}, tok, LIMITS),
                  lambda b: chat.parse_chat({"messages": MESSAGES, **b}, tok, LIMITS, chat.ChatTemplate(QWEN3_LIKE))):
        assert parse({"cache_salt": "tenant-7"}).cache_salt == "tenant-7" and parse({}).cache_salt == ""
        for bad_salt, needle in (("", "non-empty string"), (7, "non-empty string"),
                                 ("x" * (L.MAX_CACHE_SALT_CHARS + 1), f"at most {L.MAX_CACHE_SALT_CHARS}")):
            with pytest.raises(api.ApiError) as e:
                parse({"cache_salt": bad_salt})
            assert (e.value.status, e.value.param) == (400, "cache_salt") and needle in e.value.message


def test_newer_vllm_fields_are_served_or_refused_never_ignored(tok):
    """truncation_side right keeps a prompt's first tokens; documents reach the template; a custom role (Llama
    3.1's ipython) goes to the template as it is; an integral float is an integer (pydantic's lax mode, as vLLM's);
    logprob_token_ids and thinking_token_budget, which would change the answer, are refused by name."""
    ids = [5, 6, 7, 8, 9]
    assert api.parse_completion({"prompt": ids, "truncate_prompt_tokens": 3}, tok, LIMITS).prompt_token_ids == ids[2:]
    right = {"prompt": ids, "truncate_prompt_tokens": 3, "truncation_side": "right"}
    assert api.parse_completion(right, tok, LIMITS).prompt_token_ids == ids[:3]
    template = chat.ChatTemplate("{% for d in documents %}[{{ d['title'] }}]{% endfor %}"
                                 "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}")
    body = {"messages": [{"role": "ipython", "content": "42"}], "documents": [{"title": "a"}, {"title": "b"}]}
    got = chat.parse_chat(body, tok, LIMITS, template).prompt_token_ids
    assert tok.decode(got) == "[a][b]ipython:42;"
    assert api.parse_completion({"prompt": "x", "max_tokens": 7.0}, tok, LIMITS).max_tokens == 7
    for body, param in [({"prompt": "x", "max_tokens": 7.5}, "max_tokens"),
                        ({"prompt": ids, "truncate_prompt_tokens": 3, "truncation_side": "middle"}, "truncation_side"),
                        ({"prompt": "x", "logprob_token_ids": [5, 6]}, "logprob_token_ids"),
                        ({"prompt": "x", "thinking_token_budget": 100}, "thinking_token_budget")]:
        with pytest.raises(api.ApiError) as e:
            api.parse_completion(body, tok, LIMITS)
        assert (e.value.status, e.value.param) == (400, param), e.value.message
    for msgs, docs, param in [([{"role": "", "content": "x"}], None, "messages[0].role"),
                              ([{"role": "user", "content": "x"}], [{"title": "a"}, "b"], "documents")]:
        with pytest.raises(api.ApiError) as e:
            chat.parse_chat({"messages": msgs, "documents": docs}, tok, LIMITS, template)
        assert (e.value.status, e.value.param) == (400, param), e.value.message
