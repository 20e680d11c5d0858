"""Checkpoints written by the installed Hugging Face transformers, served by pushkv:
the same prompt ids (the tokenizer's BOS included) and the same greedy tokens as
transformers' own ``generate``, in float32; RoPE read in both config forms, and a
RoPE pushkv does not implement refused by name."""
from __future__ import annotations

import json
import os

import msgspec
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pushkv.model import build_model, get_tokenizer
from pushkv.model.checkpoint import model_config_from_hf
from tests.model.test_model import new_pool, paged_generate
from tests.support.deploy import deployment

PROMPTS = ["hello", "the quick brown fox jumps over the lazy dog", "hello world, the lazy fox"]
NEW_TOKENS = 8
# a deployment compared with transformers' float32 tokens names the dtype: --dtype auto runs a float32 checkpoint in
# bfloat16 where the instances are on a GPU (as vLLM's), and its tokens part from float32's within a few
FLOAT32 = ("--dtype", "float32")
ROPE_THETA = 50000.0  # not the 10000 a reader falls back to: a wrong read changes every token
GEOMETRY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                bos_token_id=2, eos_token_id=3, initializer_range=0.2)


def _tokenizer(path: str) -> None:
    """A Llama-style BPE tokenizer whose post-processor prepends ``<s>`` (id 2)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=GEOMETRY["vocab_size"], special_tokens=["<pad>", "<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 2)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>", pad_token="<pad>").save_pretrained(path)


HF_CLASSES = {  # the families of pushkv.model.arch, as transformers builds them
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
}


def save_hf_checkpoint(path: str, arch: str = "llama", seed: int = 0, **extra) -> str:
    cls = HF_CLASSES[arch]
    cfg = cls[0](**{"rope_theta": ROPE_THETA, **GEOMETRY, **extra})
    torch.manual_seed(seed)
    cls[1](cfg).to(torch.float32).save_pretrained(path)
    _tokenizer(path)
    return path


def _dequantized(path: str) -> dict:
    """An FP8 checkpoint dequantized by transformers on the CPU: where CUDA is present transformers would
    otherwise reach for its FP8 GPU kernel, which it fetches from the network."""
    with open(os.path.join(path, "config.json")) as f:
        quant = json.load(f).get("quantization_config")
    if not quant or quant.get("quant_method") != "fp8":
        return {}
    return {"quantization_config": transformers.FineGrainedFP8Config(
        weight_block_size=tuple(quant["weight_block_size"]), dequantize=True)}


def hf_reference(path: str, prompts, **generate_kw) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy new tokens) from transformers itself, a fresh model per prompt: dynamic
    RoPE's module keeps the frequencies of the longest sequence it has run and applies them to a
    later, shorter one that still passes max_position_embeddings. ``generate_kw``: more of ``generate``'s
    arguments (a repetition penalty)."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    out = []
    for p in prompts:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                  **_dequantized(path)).eval()
        ids = tok(p).input_ids
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=GEOMETRY["eos_token_id"], pad_token_id=0, **generate_kw)
        out.append((ids, gen[0, len(ids):].tolist()))
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = save_hf_checkpoint(str(tmp_path_factory.mktemp("hf_llama")))
    return path, hf_reference(path, PROMPTS)


def test_transformers_writes_rope_parameters_and_pushkv_reads_them(llama):
    path, _ = llama
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    # the form this test exists for: transformers 5 writes no top-level rope_theta
    assert "rope_theta" not in hf and hf["rope_parameters"]["rope_theta"] == ROPE_THETA
    assert model_config_from_hf(path).rope_theta == ROPE_THETA


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prompt_ids_and_greedy_tokens_equal_transformers(tmp_path, llama, arch):
    path, want = llama if arch == "llama" else (None, None)
    if path is None:
        path = save_hf_checkpoint(str(tmp_path / arch), arch, seed=1)
        want = hf_reference(path, PROMPTS)
    cfg = model_config_from_hf(path)
    model, tok = build_model(cfg), get_tokenizer(cfg)
    for prompt, (ids, new) in zip(PROMPTS, want):
        assert ids[0] == GEOMETRY["bos_token_id"]  # the tokenizer adds <s>; so must pushkv
        assert tok.encode(prompt) == ids
        got = paged_generate(model, new_pool(model, 8, 16), ids, NEW_TOKENS, tuple(range(8)))
        stop = got.index(3) + 1 if 3 in got else len(got)  # HF stops at EOS
        assert got[:stop] == new, prompt


REPETITION_PENALTY = 1.8


def test_served_text_prompt_counts_bos_and_equals_transformers(tmp_path, llama):
    """Through the router (text in, ids and usage out) on P/D push; and with a repetition penalty, as transformers'
    greedy applies it over the prompt and the tokens so far (P draws the first token over the prompt's ids, D the
    rest over both)."""
    path, want = llama
    penalised = hf_reference(path, PROMPTS, repetition_penalty=REPETITION_PENALTY)
    assert [new for _, new in penalised] != [new for _, new in want]  # the penalty changes what is drawn
    with deployment(tmp_path, "--mode", "push", "--checkpoint", path, "--num-blocks", "64",
                    *FLOAT32) as dep:
        for prompt, (ids, new), (_, pen) in zip(PROMPTS, want, penalised):
            body = dep.complete(prompt, NEW_TOKENS)
            assert body["usage"]["prompt_tokens"] == len(ids), prompt
            assert body["choices"][0]["token_ids"] == new, prompt
            body = dep.complete(prompt, NEW_TOKENS, repetition_penalty=REPETITION_PENALTY)
            assert body["choices"][0]["token_ids"] == pen, prompt


@pytest.mark.parametrize("rope, needle", [
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "longrope", "factor": 4.0}}, "rope_type 'longrope'"),
    ({"rope_scaling": {"type": "su", "factor": 2.0}}, "rope_scaling: rope_type 'su'"),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "llama3", "factor": 8.0}},
     "llama3' needs original_max_position_embeddings"),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "linear", "factor": 0.5}}, "needs a factor >= 1"),
    ({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 1e6}}, "two RoPE bases"),
    ({"rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
])
def test_rope_not_implemented_is_refused_by_name(llama, tmp_path, rope, needle):
    path, _ = llama
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    hf.pop("rope_parameters")
    hf.update(rope)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=needle):
        model_config_from_hf(str(tmp_path))


def test_top_level_rope_theta_still_read(llama, tmp_path):
    path, _ = llama
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    hf.pop("rope_parameters")
    hf["rope_theta"] = 123456.0
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert model_config_from_hf(str(tmp_path)).rope_theta == 123456.0


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


def test_hf_overrides_serve_what_transformers_serves_with_the_edited_config(tmp_path, llama):
    """vLLM's --hf-overrides: pushkv reading the checkpoint with YaRN laid over its config.json gives the tokens
    transformers gives from a copy of the checkpoint whose config.json says so; the model's length becomes the
    pretraining context times the factor, as vLLM derives it; every process reads the same (the worker's
    geometry check passes through the overrides)."""
    import shutil

    path, _ = llama
    edited = str(tmp_path / "edited")
    shutil.copytree(path, edited)
    with open(os.path.join(edited, "config.json")) as f:
        hf = json.load(f)
    hf["rope_parameters"] = {**hf["rope_parameters"], **YARN}
    with open(os.path.join(edited, "config.json"), "w") as f:
        json.dump(hf, f)
    want = hf_reference(edited, PROMPTS)
    cfg = model_config_from_hf(path, hf_overrides=json.dumps({"rope_scaling": YARN}))
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_theta == ROPE_THETA and cfg.max_position == 512
    assert cfg == msgspec.structs.replace(model_config_from_hf(edited), checkpoint=cfg.checkpoint, name=cfg.name,
                                          hf_overrides=cfg.hf_overrides)
    model = build_model(cfg)
    for prompt, (ids, new) in zip(PROMPTS, want):
        got = paged_generate(model, new_pool(model, 8, 16), ids, NEW_TOKENS, tuple(range(8)))
        stop = got.index(3) + 1 if 3 in got else len(got)
        assert got[:stop] == new, prompt
    plain = hf_reference(path, PROMPTS[1:2])
    assert plain[0][1] != want[1][1]  # YaRN changed what is drawn: the override was not ignored
