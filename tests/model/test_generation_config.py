"""A checkpoint's EOS ids (config.json and generation_config.json, an int or a list each) and its
default sampling (generation_config.json, ``--generation-config auto|none``), read and applied
by the router: unset fields take the checkpoint's value, a request's own value wins."""
from __future__ import annotations

import json

import pytest

from processes import cli
from pushkv.config import SamplingDefaults, preset
from pushkv.model.checkpoint import eos_ids_of, model_config_from_hf, sampling_defaults_of
from pushkv.router import api, text
from tests.model.test_model import write_checkpoint

TOK = text.ByteTokenizer()


@pytest.mark.parametrize("config_eos, gen_eos, want", [
    (3, None, (3,)),
    ([7, 3, 9], None, (7, 3, 9)),  # a list: every id, not only the first
    (None, [9, 7], (9, 7)),
    (3, [3, 9], (3, 9)),  # Qwen3: one id in config.json, two in generation_config.json
    ([7, 3], [3, 9, 7], (7, 3, 9)),  # Llama-3 instruct style: the union, config.json's order first
    (None, None, ()),
    ([], None, ()),
])
def test_every_eos_id_from_both_files(config_eos, gen_eos, want):
    assert eos_ids_of({"eos_token_id": config_eos}, {"eos_token_id": gen_eos}, 300) == want


@pytest.mark.parametrize("hf, needle", [
    ({"eos_token_id": 300}, "EOS token id 300 outside the vocabulary"),
    ({"eos_token_id": "3"}, "neither a token id"),
    ({"eos_token_id": [3, True]}, "neither a token id"),
])
def test_bad_eos_ids_are_refused_at_launch(hf, needle):
    with pytest.raises(ValueError, match=needle):
        eos_ids_of(hf, {}, 300)


@pytest.mark.parametrize("gen, want", [
    ({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True},  # Qwen3's
     SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)),
    ({"temperature": 0.6, "top_p": 0.9, "do_sample": True}, SamplingDefaults(temperature=0.6, top_p=0.9)),  # Llama-3.1
    ({"temperature": 0.7, "min_p": 0.05, "max_new_tokens": 64}, SamplingDefaults(0.7, None, None, 0.05, 64)),
    ({"temperature": 0.6, "top_k": 20, "do_sample": False, "max_new_tokens": 9}, SamplingDefaults(max_tokens=9)),
    ({"top_k": 0}, SamplingDefaults()), ({"top_k": -1}, SamplingDefaults()),  # off
    ({"bos_token_id": 1, "eos_token_id": [2, 3]}, SamplingDefaults()),
])
def test_sampling_defaults_from_generation_config(gen, want):
    assert sampling_defaults_of(gen) == want


@pytest.mark.parametrize("gen, needle", [
    ({"temperature": -1}, "temperature must be"), ({"top_p": 0}, "top_p must be"),
    ({"top_k": 2.5}, "top_k must be an integer"), ({"min_p": 2}, "min_p must be"),
    ({"max_new_tokens": 0}, "max_new_tokens must be"), ({"temperature": "hot"}, "must be a number"),
])
def test_defaults_out_of_range_are_refused_naming_the_field(gen, needle):
    with pytest.raises(ValueError, match=needle):
        sampling_defaults_of(gen)


def test_repetition_penalty_is_a_default_too_and_greedy_keeps_it():
    """Qwen2.5-Instruct ships repetition_penalty 1.05: vLLM applies it to a request that leaves it unset, and
    transformers' greedy (do_sample false) applies it too."""
    assert sampling_defaults_of({"repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}) == \
        SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    assert sampling_defaults_of({"repetition_penalty": 1.1, "temperature": 0.7, "do_sample": False}) == \
        SamplingDefaults(repetition_penalty=1.1)
    assert sampling_defaults_of({"repetition_penalty": 1.0}) == SamplingDefaults()
    limits = api.Limits(vocab_size=300, max_model_len=64, defaults=SamplingDefaults(repetition_penalty=1.05))
    assert api.parse_completion({"prompt": "hi"}, TOK, limits).sampling.repetition_penalty == 1.05
    assert api.parse_completion({"prompt": "hi", "repetition_penalty": 1.3}, TOK, limits).sampling.repetition_penalty \
        == 1.3
    with pytest.raises(ValueError, match="repetition_penalty must be"):
        sampling_defaults_of({"repetition_penalty": 0})


def ckpt(tmp_path, config_eos, gen):
    write_checkpoint(str(tmp_path), preset("tiny", seed=5, qk_norm=False, vocab_size=300), "LlamaForCausalLM", False)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["eos_token_id"] = config_eos
    (tmp_path / "config.json").write_text(json.dumps(hf))
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return str(tmp_path)


def test_checkpoint_and_flag(tmp_path):
    path = ckpt(tmp_path, [3, 5], {"eos_token_id": [5, 7], "temperature": 0.6, "top_k": 20, "do_sample": True})
    cfg = model_config_from_hf(path)
    assert (cfg.eos_token_id, cfg.eos_token_ids, cfg.all_eos_ids) == (3, (3, 5, 7), (3, 5, 7))
    assert cfg.sampling_defaults == SamplingDefaults(temperature=0.6, top_k=20)
    none = model_config_from_hf(path, "none")
    assert none.eos_token_ids == (3, 5, 7) and none.sampling_defaults == SamplingDefaults()  # EOS either way
    for flags, want in [([], SamplingDefaults(temperature=0.6, top_k=20)),
                        (["--generation-config", "none"], SamplingDefaults())]:
        args = cli.build_parser().parse_args(["up", "--checkpoint", path, *flags])
        assert cli.config_from_args(args).model.sampling_defaults == want
    vllm = model_config_from_hf(path, "vllm")  # vLLM's word for none
    assert vllm.eos_token_ids == (3, 5, 7) and vllm.sampling_defaults == SamplingDefaults()
    assert preset("small").all_eos_ids == ()  # random weights: never stop on EOS


def test_generation_config_from_a_directory_as_vllm_takes_it(tmp_path):
    """--generation-config DIR: DIR/generation_config.json in place of the checkpoint's: its sampling defaults, its
    EOS ids, and its max_new_tokens a bound on every request's max_tokens (vLLM's override_max_tokens), a preset's
    too; a directory without the file is refused naming it."""
    path = ckpt(tmp_path / "model", [3, 5], {"eos_token_id": [5, 7], "temperature": 0.6, "top_k": 20})
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 9, "temperature": 0.2,
                                                                "max_new_tokens": 12}))
    cfg = model_config_from_hf(path, str(folder))
    assert cfg.all_eos_ids == (3, 5, 9)  # config.json's and the directory's, not the checkpoint's generation config
    assert cfg.sampling_defaults == SamplingDefaults(temperature=0.2, max_tokens=12, max_tokens_cap=12)
    for model in ([path], ["tiny", "--load-format", "dummy"]):
        args = cli.build_parser().parse_args(["up", "--model", *model, "--generation-config", str(folder)])
        assert cli.config_from_args(args).model.sampling_defaults.max_tokens_cap == 12
    limits = api.Limits(vocab_size=320, max_model_len=256, defaults=cfg.sampling_defaults)
    assert api.parse_completion({"prompt": "hi", "max_tokens": 100}, TOK, limits).max_tokens == 12
    assert api.parse_completion({"prompt": "hi", "max_tokens": 5}, TOK, limits).max_tokens == 5
    assert api.parse_completion({"prompt": "hi"}, TOK, limits).sampling.temperature == 0.2
    for bad, needle in [(tmp_path / "nowhere", "no such directory"), (tmp_path, "it holds no generation_config")]:
        with pytest.raises(ValueError, match=f"--generation-config {bad}: {needle}"):
            model_config_from_hf(path, str(bad))


def test_override_generation_config_over_the_checkpoints_or_alone(tmp_path):
    """vLLM's --override-generation-config: its fields replace the checkpoint's (auto) or stand alone (none), a
    preset takes it too, and top_k -1 turns a default top_k off; a field it does not set, or a bad value, is refused
    at launch naming it."""
    path = ckpt(tmp_path, 3, {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.05})
    over = '{"temperature": 0.3, "repetition_penalty": 1.2}'
    for flags, want in [
        ([], SamplingDefaults(temperature=0.3, top_k=20, repetition_penalty=1.2)),
        (["--generation-config", "none"], SamplingDefaults(temperature=0.3, repetition_penalty=1.2)),
    ]:
        args = cli.build_parser().parse_args(["up", "--model", path, "--override-generation-config", over, *flags])
        assert cli.config_from_args(args).model.sampling_defaults == want
    args = cli.build_parser().parse_args(["up", "--model", path, "--override-generation-config", '{"top_k": -1}'])
    assert cli.config_from_args(args).model.sampling_defaults == SamplingDefaults(temperature=0.6, top_k=0,
                                                                                 repetition_penalty=1.05)
    args = cli.build_parser().parse_args(["up", "--model", "tiny", "--load-format", "dummy",
                                          "--override-generation-config", '{"max_new_tokens": 7}'])
    # its max_new_tokens bounds a request's own max_tokens too, as vLLM's override_max_tokens
    assert cli.config_from_args(args).model.sampling_defaults == SamplingDefaults(max_tokens=7, max_tokens_cap=7)
    for bad, needle in [('{"seed": 1}', "seed is not a sampling field"), ("[1]", "a JSON object"),
                        ("{temperature: 1}", "not JSON"), ('{"top_p": 0}', "top_p must be")]:
        args = cli.build_parser().parse_args(["up", "--model", path, "--override-generation-config", bad])
        with pytest.raises(ValueError, match=needle):
            cli.config_from_args(args)


def test_router_stops_on_every_eos_id_and_fills_unset_fields_from_the_checkpoint():
    d = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, max_tokens=9)
    limits = api.Limits(vocab_size=320, max_model_len=256, eos_token_ids=(257, 300, 301), defaults=d)
    p = api.parse_completion({"prompt": "hi", "stop_token_ids": [300, 5]}, TOK, limits)
    assert p.stop_token_ids == (300, 5, 257, 301)
    assert api.parse_completion({"prompt": "hi", "ignore_eos": True}, TOK, limits).stop_token_ids == ()
    s = p.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.6, 0.95, 20, 0.05)
    assert p.max_tokens == 9  # max_new_tokens, under completions' 16
    own = api.parse_completion({"prompt": "hi", "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0,
                                "max_tokens": 30}, TOK, limits)
    assert (own.sampling.temperature, own.sampling.top_p, own.sampling.top_k, own.sampling.min_p) == (0, 1, 0, 0)
    assert own.max_tokens == 30  # a request's own value wins
    plain = api.parse_completion({"prompt": "hi"}, TOK, api.Limits(320, 256))
    assert plain.sampling.temperature == 0 and plain.max_tokens == 16 and plain.stop_token_ids == ()


@pytest.mark.parametrize("eos_token, want", [("</s>", 3), ({"content": "<s>", "special": True}, 2), (None, -1),
                                             ("<none of these>", -1)])
def test_the_tokenizers_own_eos_comes_from_tokenizer_config(tmp_path, eos_token, want):
    """tokenizer_config.json's eos_token (a string or an added token's dict) is the id whose stop names no
    stop_reason (``api.Limits.main_eos_id``); without one the router takes the first of the checkpoint's EOS ids."""
    from pushkv.model.tokenizer import get_tokenizer

    write_checkpoint(str(tmp_path), preset("tiny", seed=1, vocab_size=300), "LlamaForCausalLM", False)
    if eos_token is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token}))
    assert get_tokenizer(model_config_from_hf(str(tmp_path))).config_eos_id == want


def test_presence_and_frequency_penalties_are_defaults_too_as_vllm_takes_them(tmp_path):
    """vLLM's get_diff_sampling_param takes presence_penalty and frequency_penalty from generation_config.json and
    --override-generation-config (Qwen3's recommended presence_penalty 1.5): a request that leaves them unset gets
    them; an override of 0 turns the checkpoint's off; out of [-2, 2] is refused at launch."""
    assert sampling_defaults_of({"presence_penalty": 1.5, "frequency_penalty": 0.0}) == \
        SamplingDefaults(presence_penalty=1.5)
    path = ckpt(tmp_path, 3, {"presence_penalty": 1.5, "repetition_penalty": 1.05})
    args = cli.build_parser().parse_args(["up", "--model", path, "--override-generation-config",
                                          '{"frequency_penalty": -0.5, "presence_penalty": 0, "repetition_penalty": 1}'])
    d = cli.config_from_args(args).model.sampling_defaults
    assert (d.presence_penalty, d.frequency_penalty, d.repetition_penalty) == (0.0, -0.5, 1.0)
    limits = api.Limits(vocab_size=300, max_model_len=64, defaults=SamplingDefaults(presence_penalty=1.5,
                                                                                    frequency_penalty=0.25))
    s = api.parse_completion({"prompt": "hi"}, TOK, limits).sampling
    assert (s.presence_penalty, s.frequency_penalty) == (1.5, 0.25)
    own = api.parse_completion({"prompt": "hi", "presence_penalty": 0, "frequency_penalty": 1}, TOK, limits).sampling
    assert (own.presence_penalty, own.frequency_penalty) == (0, 1)
    with pytest.raises(ValueError, match=r"presence_penalty must be \[-2, 2\]"):
        sampling_defaults_of({"presence_penalty": 3})
