"""Pure router pieces of the OpenAI surface: text held back until whole (CJK, emoji,
two tokenizer kinds), stop strings, chat templates, request parsing."""
import json

import msgspec
import pytest

from pushkv.config import preset
from pushkv.messages import SamplingParams
from pushkv.router import api, chat, output, render, text

CJK_EMOJI = ["你好，世界！今天天气很好。", "hi 你好 😀 ok", "a 👨‍👩‍👧 b 👍🏽!", "héllo wörld 日本語 ☃"]
LIMITS = api.Limits(vocab_size=320, max_model_len=256)


class HF:
    """A `tokenizers.Tokenizer` behind the router's Tokenizer protocol."""

    def __init__(self, tok):
        self.tok = tok
        self.bos_token_id = -1

    def encode(self, s):
        return self.tok.encode(s, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=True)


def byte_level_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox"] * 10, trainer)
    return HF(tok)


def byte_fallback():
    """Llama-style: sentencepiece pieces, unknown characters as <0xNN> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyz,.!":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return HF(tok)


TOKENIZERS = {"bytes": text.ByteTokenizer, "byte-level-bpe": byte_level_bpe, "byte-fallback": byte_fallback}


@pytest.mark.parametrize("kind", list(TOKENIZERS))
@pytest.mark.parametrize("s", CJK_EMOJI)
def test_split_characters_are_held_until_whole(kind, s):
    tok = TOKENIZERS[kind]()
    ids = tok.encode(s)
    assert tok.decode(ids) == s
    streamed = output.ChoiceOutput(0, tok)
    deltas = [streamed.add([i]).text for i in ids] + [streamed.finish("length").text]
    assert all(text.REPLACEMENT not in d for d in deltas), deltas
    assert "".join(deltas) == s == streamed.text
    unary = output.ChoiceOutput(0, tok)
    unary.add(ids)
    unary.finish("length")
    assert unary.text == s
    # cut in the middle of the last multi-byte character: nothing partial before the end
    cut = output.ChoiceOutput(0, tok)
    partial = [cut.add([i]).text for i in ids[:-1]]
    assert all(text.REPLACEMENT not in d for d in partial)


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_stop_string_inside_cjk_spanning_tokens(kind):
    tok = TOKENIZERS[kind]()
    s = "你好，世界！今天天气很好。"
    ids = tok.encode(s)
    for stream in (True, False):
        out = output.ChoiceOutput(0, tok, ("世界",))
        got = "".join(out.add([i]).text for i in ids) if stream else out.add(ids).text
        assert got == "你好，" and out.finish_reason == "stop", stream
        assert out.add([ids[0]]).text == ""  # nothing after the stop


STOP_CASES = [
    # (stops, pieces, released per piece (final on the last), the stop string that matched)
    (("END",), ["abc", "E", "N", "D", "x"], ["abc", "", "", "", ""], "END"),
    (("END",), ["abE", "Nx"], ["ab", "ENx"], None),
    (("END", "NDX"), ["aEN", "DX"], ["a", ""], "END"),
    (("\n\n",), ["a\n", "b\n", "\n"], ["a", "\nb", ""], "\n\n"),
    ((), ["a", "b"], ["a", "b"], None),
    (("xy",), ["ax"], ["ax"], None),  # final: a held prefix is released
]


@pytest.mark.parametrize("stops, pieces, released, stopped", STOP_CASES)
def test_stop_strings(stops, pieces, released, stopped):
    st = output.StopStrings(stops)
    got, hit = [], None
    for n, p in enumerate(pieces):
        if hit is not None:
            got.append("")
            continue
        out, hit = st.feed(p, final=n == len(pieces) - 1)
        got.append(out)
    assert got == released and hit == stopped


def test_logprob_shapes():
    from pushkv.messages import TokenLogprob

    tok = text.ByteTokenizer()
    lps = [TokenLogprob(-0.5, (104, 105), (-0.5, -1.0)), TokenLogprob(float("-inf"), (), ()),
           TokenLogprob(-2.0, (104, 105), (-0.5, -1.0))]
    c = render.completion_logprobs(tok, [104, 105, 106], lps, offset=3)
    # completions: the sampled token's own entry first, then the top N (N + 1 at most, as OpenAI's and vLLM's)
    assert c == {"tokens": ["h", "i", "j"], "token_logprobs": [-0.5, render.FLOOR_LOGPROB, -2.0],
                 "top_logprobs": [{"h": -0.5, "i": -1.0}, {"i": render.FLOOR_LOGPROB},
                                  {"j": -2.0, "h": -0.5, "i": -1.0}], "text_offset": [3, 4, 5]}
    assert list(c["top_logprobs"][2]) == ["j", "h", "i"]
    ch = render.chat_logprobs(tok, [104], lps[:1])["content"][0]
    assert ch["token"] == "h" and ch["bytes"] == [104] and [t["token"] for t in ch["top_logprobs"]] == ["h", "i"]
    json.dumps(c, allow_nan=False)


@pytest.mark.parametrize("chat_", [False, True])
def test_return_tokens_as_token_ids_writes_each_logprob_token_as_its_id(chat_):
    """vLLM's return_tokens_as_token_ids: every logprob token (the sampled one and its alternatives) is written
    "token_id:N", completions' text offsets and chat's bytes following that text; the choice's text is unchanged."""
    from pushkv.messages import TokenLogprob

    tok = text.ByteTokenizer()
    limits = api.Limits(vocab_size=258, max_model_len=64)
    body = {"logprobs": True, "top_logprobs": 1} if chat_ else {"logprobs": 1}
    body["return_tokens_as_token_ids"] = True
    params = (chat.parse_chat({"messages": [{"role": "user", "content": "x"}], **body}, tok, limits,
                                  chat.ChatTemplate("{{ messages[0]['content'] }}")) if chat_
              else api.parse_completion({"prompt": "x", **body}, tok, limits))
    r = render.for_endpoint(tok, params)
    out = output.ChoiceOutput(0, tok)
    out.add([104, 105], [TokenLogprob(-0.5, (105,), (-0.7,)), TokenLogprob(-1.0, (104,), (-0.2,))])
    out.finish("length")
    c = r.choice(out)
    if chat_:
        assert c["message"]["content"] == "hi"
        (first, second) = c["logprobs"]["content"]
        assert first["token"] == "token_id:104" and first["bytes"] == list(b"token_id:104")
        assert [t["token"] for t in first["top_logprobs"]] == ["token_id:105"]
        assert second["token"] == "token_id:105"
    else:
        lp = c["logprobs"]
        assert c["text"] == "hi" and lp["tokens"] == ["token_id:104", "token_id:105"]
        assert lp["top_logprobs"] == [{"token_id:104": -0.5, "token_id:105": -0.7},
                                      {"token_id:105": -1.0, "token_id:104": -0.2}]
        assert lp["text_offset"] == [0, len("token_id:104")]


LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
    "<|start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def test_checkpoint_chat_template(tmp_path):
    cfg = {"chat_template": LLAMA3_LIKE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = chat.load_template(str(tmp_path))
    msgs = [{"role": "system", "content": " be brief "}, {"role": "user", "content": [{"type": "text", "text": "你好"}]}]
    body = {"messages": msgs, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2}
    p = chat.parse_chat(body, text.ByteTokenizer(), LIMITS, t)
    want = "<s><|start|>system\nbe brief<|end|><|start|>user\n你好<|end|><|start|>assistant\n"
    assert bytes(p.prompt_token_ids).decode() == want
    assert p.chat and p.max_tokens == 4 and p.sampling.logprobs == 2
    with pytest.raises(api.ApiError) as e:
        chat.parse_chat({"messages": [{"role": "tool", "content": "x"}]}, text.ByteTokenizer(), LIMITS, t)
    assert e.value.param == "messages" and "no tools" in e.value.message
    # a chat_template.jinja file wins; a list of named templates takes "default"
    (tmp_path / "chat_template.jinja").write_text("J:{{ messages[0]['content'] }}")
    assert chat.load_template(str(tmp_path)).render([{"role": "user", "content": "q"}]) == "J:q"
    (tmp_path / "chat_template.jinja").unlink()
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert chat.load_template(str(tmp_path)).render([]) == "D"
    assert chat.load_template("").render([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


@pytest.mark.parametrize("decoder", [False, True])
def test_a_template_reads_special_tokens_as_transformers_merges_them(tmp_path, decoder):
    """An older tokenizer_config.json (no added_tokens_decoder) leaves its bos_token to special_tokens_map.json, which
    transformers merges over it: pushkv read tokenizer_config.json alone, so {{ bos_token }} rendered empty and the
    chat prompt lost its BOS. A newer one's own tokens stand, as transformers takes them."""
    import transformers

    from pushkv.model.tokenizer import HFTokenizer, get_tokenizer
    from tests.model.test_hf_reference import _tokenizer

    _tokenizer(str(tmp_path))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("bos_token", "eos_token", "added_tokens_decoder")}
    cfg.update({"bos_token": "<pad>", "chat_template": "{{ bos_token }}[{{ messages[0].content }}]{{ eos_token }}"})
    if decoder:
        cfg["added_tokens_decoder"] = {"0": {"content": "<pad>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    want = transformers.AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        [{"role": "user", "content": "q"}], tokenize=False)
    assert chat.load_template(str(tmp_path)).render([{"role": "user", "content": "q"}]) == want
    assert want == ("<pad>[q]" if decoder else "<s>[q]</s>")
    tok = get_tokenizer(msgspec.structs.replace(preset("tiny"), tokenizer=str(tmp_path)))
    assert isinstance(tok, HFTokenizer) and tok.config_eos_id == (-1 if decoder else 3)  # "</s>" is id 3


def test_chat_defaults_and_refusals():
    t = chat.load_template("")
    tok = text.ByteTokenizer()
    p = chat.parse_chat({"messages": [{"role": "user", "content": "hi"}]}, tok, LIMITS, t)
    assert p.max_tokens == LIMITS.max_model_len - len(p.prompt_token_ids)  # what fits
    cut = chat.parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9999}, tok, LIMITS, t)
    assert cut.max_tokens == LIMITS.max_model_len - len(cut.prompt_token_ids) < 9999  # cut to what fits (vLLM 0.32)
    assert p.sampling.logprobs == -1 and p.sampling.temperature == 0
    for body, param in [
        ({}, "messages"), ({"messages": []}, "messages"), ({"messages": ["x"]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{}], "tool_choice": "required"}, "tool_choice"),
    ]:
        with pytest.raises(api.ApiError) as e:
            chat.parse_chat(body, tok, LIMITS, t)
        assert e.value.status == 400 and e.value.param == param, body


def test_completion_sampling_fields():
    tok = text.ByteTokenizer()
    body = {"prompt": "hi", "temperature": 0.5, "top_p": 0.9, "top_k": -1, "min_p": 0.1, "seed": -3,
            "presence_penalty": 1, "frequency_penalty": -1, "logit_bias": {"65": -100, "7": 1.5},
            "stop": ["a", "a", "bc"], "min_tokens": 2, "max_tokens": 5, "logprobs": 0, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}, "user": "ignored", "whatever": [1]}
    p = api.parse_completion(body, tok, LIMITS)
    s = p.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.5, 0.9, 0, 0.1)
    assert s.seed == (1 << 64) - 3 and s.logit_bias == ((7, 1.5), (65, -100.0))
    assert (s.presence_penalty, s.frequency_penalty, s.min_tokens, s.logprobs) == (1.0, -1.0, 2, 0)
    assert p.stop == ("a", "bc") and p.n == 2 and p.include_usage and p.stream
    unseeded = {api.parse_completion({"prompt": "hi", "temperature": 1}, tok, LIMITS).sampling.seed for _ in range(5)}
    assert len(unseeded) == 5  # the router picks each unseeded request's stream
    assert api.parse_completion({"prompt": "hi"}, tok, LIMITS).sampling == SamplingParams()  # greedy: sent as None
    echo = api.parse_completion({"prompt": [104, 105], "echo": True}, tok, LIMITS)
    assert echo.echo and echo.prompt_text == "hi"


def test_stop_strings_wait_for_min_tokens():
    tok = text.ByteTokenizer()
    out = output.ChoiceOutput(0, tok, ("a",), min_tokens=3)
    got = "".join(out.add([i]).text for i in b"aaba")
    assert got == "aab" and out.finish_reason == "stop"  # the first two "a"s came before min_tokens


@pytest.mark.parametrize("writes_bos", [True, False])
def test_chat_prompt_has_the_templates_special_tokens_only(writes_bos):
    """A tokenizer whose post-processor adds <s> (Llama): chat prompts carry what the template
    writes and nothing more, as vLLM's chat does."""
    from tokenizers import processors

    hf = byte_fallback()
    hf.tok.add_special_tokens(["<s>", "</s>"])  # "<s>" in text is the token, as in Llama's tokenizer
    hf.tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])

    class Adds:  # the router's view of pushkv.model.tokenizer.HFTokenizer (special tokens added)
        def encode(self, s):
            return hf.tok.encode(s, add_special_tokens=True).ids

        def decode(self, ids):
            return hf.decode(ids)

    tok = Adds()
    assert tok.encode("hi")[0] == 1
    t = chat.ChatTemplate(("{{ bos_token }}" if writes_bos else "") + "{{ messages[0]['content'] }}", "<s>")
    ids = chat.parse_chat({"messages": [{"role": "user", "content": "hi"}]}, tok, LIMITS, t).prompt_token_ids
    want = hf.tok.encode(("<s>" if writes_bos else "") + "hi", add_special_tokens=False).ids
    assert ids == want and ids.count(1) == (1 if writes_bos else 0)
