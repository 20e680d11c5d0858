"""Every architecture of the registry (pushkv.model.arch), proved against transformers: a tiny
random checkpoint that transformers writes gives transformers' float32 greedy tokens in pushkv's
engine (the per-sequence engine, and the batched one's CPU path); the RoPE schemes' frequencies
equal transformers' own; what is not built is refused by field and value, from config.json alone."""
from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pushkv.config import MoeRouting, RopeScaling
from pushkv.model import build_model, get_tokenizer
from pushkv.model.checkpoint import model_config_from_hf
from pushkv.model.moe import moe_mlp, route
from pushkv.model.rope import cos_sin, cos_sin_rows, dynamic_spans, inv_freq, rope_of
from tests.model.test_hf_reference import FLOAT32, GEOMETRY, HF_CLASSES, PROMPTS, hf_reference, save_hf_checkpoint
from tests.model.test_model import new_pool, paged_generate
from tests.support.deploy import deployment

NEW = 8
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
DYNAMIC = {"rope_theta": 5e5, "rope_type": "dynamic", "factor": 4.0}
MOE = dict(num_local_experts=4, num_experts_per_tok=2)

# name -> (transformers family, config extras, what pushkv must read from it)
CASES = {
    "llama3": ("llama", {"rope_parameters": {"rope_theta": 5e5, **LLAMA3}}, dict(architecture="LlamaForCausalLM")),
    "llama-yarn": ("llama", {"rope_parameters": {"rope_theta": 5e5, **YARN}}, {}),
    "llama-linear": ("llama", {"rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}}, {}),
    # a context of 5: the prompts of 7 and 10 tokens prefill past it, the one of 2 decodes past it
    "llama-dynamic": ("llama", {"max_position_embeddings": 5, "rope_parameters": DYNAMIC},
                      dict(max_position=20, rope_scaling=RopeScaling("dynamic", 4.0, 5))),
    "qwen2": ("qwen2", {}, dict(architecture="Qwen2ForCausalLM", qkv_bias=True)),
    # a window shorter than the prompts, so that the window decides tokens
    "mistral": ("mistral", {"sliding_window": 4}, dict(sliding_window=4, window_layers=(0, 1))),
    "qwen3": ("qwen3", {}, dict(qk_norm=True)),
    "qwen3_moe": ("qwen3_moe", dict(MOE, moe_intermediate_size=32, norm_topk_prob=True),
                  dict(num_experts=4, experts_per_token=2, intermediate_size=32, qk_norm=True)),
    "qwen3_moe-unnormed": ("qwen3_moe", dict(MOE, moe_intermediate_size=32, norm_topk_prob=False),
                           dict(norm_topk_prob=False)),
    "mixtral": ("mixtral", dict(MOE), dict(num_experts=4, experts_per_token=2, intermediate_size=128)),
    # Qwen1.5-MoE / Qwen2-57B-A14B: q/k/v bias, a shared expert its sigmoid gate scales, unnormalised routing
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, norm_topk_prob=False),
                  dict(architecture="Qwen2MoeForCausalLM", num_experts=4, experts_per_token=2, intermediate_size=32,
                       qkv_bias=True, shared_intermediate_size=48, shared_gate=True, norm_topk_prob=False)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, extra, expect = CASES[request.param]
    path = save_hf_checkpoint(str(tmp_path_factory.mktemp(request.param)), family, seed=3, **extra)
    return path, expect, hf_reference(path, PROMPTS)


@pytest.mark.parametrize("engine", ["per-seq", "batched"])
def test_greedy_tokens_equal_transformers(case, engine):
    path, expect, want = case
    cfg = model_config_from_hf(path, engine=engine)
    assert {k: getattr(cfg, k) for k in expect} == expect
    model, tok = build_model(cfg), get_tokenizer(cfg)
    for prompt, (ids, new) in zip(PROMPTS, want):
        assert tok.encode(prompt) == ids
        got = paged_generate(model, new_pool(model, 8, 16), ids, NEW, tuple(range(8)))
        stop = got.index(3) + 1 if 3 in got else len(got)  # transformers stops at EOS
        assert got[:stop] == new, prompt


class _HFConfig:
    """What transformers' RoPE init functions read off a config."""

    def __init__(self, params: dict, max_pos: int = 512):
        self.rope_parameters = params
        self.head_dim, self.hidden_size, self.num_attention_heads = 16, 64, 4
        self.max_position_embeddings = max_pos

    def standardize_rope_params(self) -> None:
        pass


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "factor": 4.0},
    LLAMA3,
    dict(LLAMA3, factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0),
    YARN,
    dict(YARN, factor=16.0, beta_fast=16.0, beta_slow=2.0),
    dict(YARN, truncate=False),
    dict(YARN, attention_factor=0.8),
    dict(YARN, mscale=0.7, mscale_all_dim=0.5),
])
def test_rope_frequencies_and_scale_equal_transformers(params):
    params = dict(params, rope_theta=1e4)
    want, want_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](_HFConfig(params), "cpu")
    theta, rs = rope_of({"rope_parameters": params, "max_position_embeddings": 512})
    got = inv_freq(theta, 16, rs)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-6, atol=0)
    assert (rs.attention_factor if rs.rope_type == "yarn" else 1.0) == pytest.approx(want_scale)


@pytest.mark.parametrize("length", [1, 511, 512, 513, 700, 4096])
def test_dynamic_frequencies_per_length_equal_transformers(length):
    """transformers' NTK base for a sequence of `length` (max_position_embeddings 512), and the
    engine's tables: row p of cos_sin for length p + 1 (a decode step), cos_sin_rows for any."""
    params = dict(DYNAMIC, rope_theta=1e4)
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](_HFConfig(params, 512), "cpu", seq_len=length)
    theta, rs = rope_of({"rope_parameters": params, "max_position_embeddings": 512})
    torch.testing.assert_close(inv_freq(theta, 16, rs, length).float(), want.float(), rtol=1e-6, atol=0)
    p = length - 1
    cos, sin = cos_sin(theta, 16, rs, length, "cpu", torch.float64)
    ang = p * inv_freq(theta, 16, rs, length)
    torch.testing.assert_close(cos[p], torch.cat((ang, ang)).cos())
    rows = cos_sin_rows(theta, 16, rs, 0, length, length, "cpu", torch.float64)[1]
    torch.testing.assert_close(rows[p], sin[p])
    if length > 513:  # earlier rows: the table's are for their own length, a prompt's for its whole one
        assert not torch.allclose(rows[p - 100], sin[p - 100])


@pytest.mark.parametrize("kind, spans, want", [
    ("dynamic", [(0, 7, 7), (7, 1, 8), (0, 3, 3), (0, 4, 9), (4, 5, 9)], [(0, 0, 7, 7), (11, 0, 4, 9), (15, 4, 5, 9)]),
    ("dynamic", [(9, 1, 10), (0, 5, 5), (20, 1, 21)], []),  # decodes, and a prompt within the context
    ("yarn", [(0, 7, 7)], []),
])
def test_dynamic_spans_are_the_rows_off_the_table(kind, spans, want):
    """(start, count, length) per sequence, context 5: rows to recompute, as (row, start, count, length)."""
    assert dynamic_spans(RopeScaling(kind, 4.0, 5), spans) == want


@pytest.fixture(scope="module")
def dynamic_ckpt(tmp_path_factory):
    family, extra, _ = CASES["llama-dynamic"]
    path = save_hf_checkpoint(str(tmp_path_factory.mktemp("llama-dynamic")), family, seed=3, **extra)
    return path, hf_reference(path, PROMPTS)


def test_dynamic_rope_chunked_prefill_takes_the_prompts_length(dynamic_ckpt):
    """A prompt past the context prefilled in chunks of 3 rotates every chunk for the whole
    prompt's length, as transformers' one prefill does: the same keys as one prefill's (a chunk
    rotated for its own end differs by up to ~0.3), and transformers' tokens."""
    path, want = dynamic_ckpt
    model = build_model(model_config_from_hf(path, engine="batched"))
    for ids, new in want:
        kv = {}
        for chunk in (None, 3):
            pool = new_pool(model, 8, 16)
            got = paged_generate(model, pool, ids, 1, tuple(range(8)), chunk=chunk)
            kv[chunk] = pool.clone()
            assert got == new[:1]
        torch.testing.assert_close(kv[3], kv[None], rtol=1e-5, atol=1e-5, equal_nan=True)
        assert paged_generate(model, new_pool(model, 8, 16), ids, NEW, tuple(range(8)), chunk=3) == new


@pytest.mark.parametrize("flags", [("--mode", "local", "--prefill-chunk", "3"), ("--mode", "push")])
def test_dynamic_rope_served_equals_transformers(tmp_path, dynamic_ckpt, flags):
    """Served: local with the scheduler chunking the prompts, and P/D push, where the prompt's KV is
    made on P (rotated for the prompt's length) and decoded past it on D."""
    path, want = dynamic_ckpt
    with deployment(tmp_path, *flags, "--model", path, "--num-blocks", "32", *FLOAT32) as dep:
        for ids, new in want:
            assert dep.tokens(ids, NEW) == new, ids


def test_transformers_4_rope_scaling_form_is_read():
    theta, rs = rope_of({"rope_theta": 5e5, "rope_scaling": dict(LLAMA3, type="llama3")})
    assert theta == 5e5 and rs == RopeScaling("llama3", 8.0, 64, 1.0, 4.0)


BASE = dict(GEOMETRY, architectures=["LlamaForCausalLM"], rope_theta=1e4, hidden_act="silu")


@pytest.mark.parametrize("change, needle", [
    ({"architectures": ["GPTNeoXForCausalLM"]}, r"architectures \['GPTNeoXForCausalLM'\]: not supported"),
    ({"architectures": []}, r"architectures \[\]: not supported"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}},
     "quantization_config: activation_scheme 'static' is not supported"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config: weight_block_size None"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method 'awq'"),
    ({"attention_bias": True}, r"attention_bias: True \(a bias on q/k/v and o projections\) is not built"),
    ({"mlp_bias": True}, "mlp_bias: True"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping: 50.0"),
    ({"hidden_act": "gelu"}, "hidden_act: 'gelu'"),
    ({"max_position_embeddings": None, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     "max_position_embeddings null: a positive integer is needed"),
    ({"max_position_embeddings": None}, "max_position_embeddings null: a positive integer is needed .the model's "
                                        "longest sequence: --hf-overrides"),  # was a TypeError's traceback
    ({"hidden_size": None}, "hidden_size null: a positive integer is needed"),  # was a TypeError's traceback
    ({"num_hidden_layers": "2"}, 'num_hidden_layers "2": a positive integer is needed'),
    ({"rms_norm_eps": None}, "rms_norm_eps null: a number between 0 and 1 is needed"),  # was a TypeError's traceback
    ({"dtype": "float8_e4m3fn"}, "dtype 'float8_e4m3fn' is not supported"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32, "decoder_sparse_step": 2}, "dense layers between MoE layers are not built"),
])
def test_what_is_not_built_is_refused_by_field_and_value(tmp_path, change, needle):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **change}))
    with pytest.raises(ValueError, match=needle):
        model_config_from_hf(str(tmp_path))


@pytest.mark.parametrize("family", sorted(HF_CLASSES))
def test_a_config_without_max_position_embeddings_or_rope_theta_reads_as_transformers_reads_it(tmp_path, family):
    """Left out, each is what transformers' config class sets (and so what transformers and vLLM run with): pushkv
    took 32768 positions and a base of 10000 for every family, where Llama's are 2048 positions, Mistral's 131072,
    Mixtral's base 1e6. A required size left out is refused by name (it was a KeyError's traceback)."""
    hf = {k: v for k, v in HF_CLASSES[family][0](**GEOMETRY, num_experts_per_tok=2).to_dict().items()
          if k not in ("max_position_embeddings", "rope_theta", "rope_parameters", "rope_scaling")}
    hf["architectures"] = [HF_CLASSES[family][1].__name__]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    want = transformers.AutoConfig.from_pretrained(str(tmp_path))
    cfg = model_config_from_hf(str(tmp_path))
    assert (cfg.max_position, cfg.rope_theta) == (want.max_position_embeddings, want.rope_parameters["rope_theta"])
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if k != "num_hidden_layers"}))
    with pytest.raises(ValueError, match="config.json: num_hidden_layers missing: a positive integer is needed"):
        model_config_from_hf(str(tmp_path))


def test_moe_reference_equals_each_token_through_its_experts():
    """The grouped reference against the definition, token by token (no transformers)."""
    g = torch.Generator().manual_seed(0)
    T, d, i, E, k = 11, 8, 6, 5, 2
    h, router = torch.randn(T, d, generator=g), torch.randn(E, d, generator=g)
    gate_up, down = torch.randn(E, 2 * i, d, generator=g), torch.randn(E, d, i, generator=g)
    for renorm in (True, False):
        got = moe_mlp(h, router, gate_up, down, k, renorm)
        w, ids = route(h, router, k, renorm)
        for t in range(T):
            want = torch.zeros(d)
            for j in range(k):
                e = int(ids[t, j])
                gate, up = (gate_up[e] @ h[t]).chunk(2)
                want += w[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
            torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)
        assert torch.allclose(w.sum(-1), torch.ones(T)) == renorm


def test_moe_shape_preset_counts_qwen3_30b_a3b_parameters():
    """The random shape of Qwen3-30B-A3B names (hf_names) 30.5B parameters, 3.3B active per token."""
    from pushkv.config import preset
    from pushkv.model.weights import hf_names

    cfg = preset("qwen3-30b-a3b")
    sizes = {name: torch.Size(shape).numel() for name, shape in hf_names(cfg)}
    total = sum(sizes.values())
    experts = sum(n for name, n in sizes.items() if ".experts." in name)
    active = total - experts + experts * cfg.experts_per_token // cfg.num_experts
    assert round(total / 1e9, 1) == 30.5 and 3.3 <= active / 1e9 <= 3.4
    assert sum(".experts.0.gate_proj" in n for n in sizes) == cfg.num_layers


# config.json fields as the published checkpoints carry them (geometry shrunk), in the transformers 4 form
# most Hub repos still have: what each must read as
REAL = {
    "Llama-3.1": ({"architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0, "attention_bias": False,
                   "mlp_bias": False, "pretraining_tp": 1, "torch_dtype": "bfloat16", "eos_token_id": [5, 6, 7],
                   "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
                  dict(rope_theta=5e5, dtype="bfloat16", eos_token_ids=(5, 6, 7),
                       rope_scaling=RopeScaling("llama3", 8.0, 8192, 1.0, 4.0))),
    "Qwen2.5-YaRN": ({"architectures": ["Qwen2ForCausalLM"], "rope_theta": 1e6, "use_sliding_window": False,
                      "sliding_window": 131072, "max_window_layers": 1,
                      "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}},
                     dict(qkv_bias=True, sliding_window=0, window_layers=(), rope_scaling=RopeScaling(
                         "yarn", 4.0, 32768, attention_factor=pytest.approx(0.1 * math.log(4) + 1)))),
    "Mistral-7B-v0.1": ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096},
                        dict(sliding_window=4096, window_layers=(0, 1))),
    "Mistral-7B-v0.3": ({"architectures": ["MistralForCausalLM"], "sliding_window": None},
                        dict(sliding_window=0, window_layers=())),
    "Mixtral-8x7B": ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "num_experts_per_tok": 2,
                      "sliding_window": None, "output_router_logits": False, "router_aux_loss_coef": 0.02},
                     dict(num_experts=8, experts_per_token=2, norm_topk_prob=True, intermediate_size=128)),
    "Qwen3-30B-A3B": ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 16, "num_experts_per_tok": 4,
                       "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
                       "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None},
                      dict(num_experts=16, experts_per_token=4, intermediate_size=32, qk_norm=True)),
    "Qwen1.5-MoE-A2.7B": ({"architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "num_experts": 8,
                           "num_experts_per_tok": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                           "norm_topk_prob": False, "use_sliding_window": False, "sliding_window": 32768,
                           "max_window_layers": 21, "router_aux_loss_coef": 0.001, "rope_theta": 1e6},
                          dict(num_experts=8, experts_per_token=4, intermediate_size=32, shared_intermediate_size=64,
                               shared_gate=True, qkv_bias=True, norm_topk_prob=False, window_layers=())),
    "DeepSeek-V2-Lite": ({"architectures": ["DeepseekV2ForCausalLM"], "first_k_dense_replace": 1, "kv_lora_rank": 16,
                          "moe_intermediate_size": 32, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 8,
                          "n_shared_experts": 2, "norm_topk_prob": False, "num_experts_per_tok": 6,
                          "num_key_value_heads": 4, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                          "v_head_dim": 16, "rope_theta": 10000, "routed_scaling_factor": 1.0,
                          "scoring_func": "softmax", "topk_group": 1, "topk_method": "greedy",
                          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                           "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                           "type": "yarn"}, "max_position_embeddings": 163840},
                         dict(kv_lora_rank=16, qk_rope_dim=8, head_dim=16, q_lora_rank=0, num_experts=8,
                              experts_per_token=6, shared_intermediate_size=64, dense_layers=1,
                              dense_intermediate_size=128, routing=MoeRouting(), norm_topk_prob=False,
                              attn_scale=pytest.approx(24 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2),
                              max_position=163840)),
    "DeepSeek-V3": ({"architectures": ["DeepseekV3ForCausalLM"], "first_k_dense_replace": 3, "kv_lora_rank": 16,
                     "moe_intermediate_size": 32, "n_group": 2, "n_routed_experts": 8, "n_shared_experts": 1,
                     "norm_topk_prob": True, "num_experts_per_tok": 2, "num_nextn_predict_layers": 1,
                     "num_key_value_heads": 4, "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                     "v_head_dim": 16, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_group": 1,
                     "topk_method": "noaux_tc",
                     "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
                     "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [128, 128]}},
                    dict(q_lora_rank=24, dense_layers=3, shared_intermediate_size=32, norm_topk_prob=True,
                         routing=MoeRouting("sigmoid", 2, 1, "top2", True, 2.5), rope_interleave=True,
                         attn_scale=pytest.approx(24 ** -0.5 * (0.1 * math.log(40) + 1) ** 2))),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_published_config_forms_are_read(tmp_path, name):
    hf, want = REAL[name]
    base = {k: v for k, v in GEOMETRY.items() if k not in ("bos_token_id", "eos_token_id")}
    (tmp_path / "config.json").write_text(json.dumps({**base, "hidden_act": "silu", **hf}))
    cfg = model_config_from_hf(str(tmp_path))
    assert cfg.architecture == hf["architectures"][0]
    assert {k: getattr(cfg, k) for k in want} == want


def test_hf_overrides_replace_fields_and_reach_rope_in_either_form():
    from pushkv.model.checkpoint import with_overrides

    v4 = {"rope_theta": 1e6, "rope_scaling": None, "num_hidden_layers": 2}
    assert with_overrides(v4, "") is v4
    assert with_overrides(v4, '{"rope_theta": 5e5, "sliding_window": 8}') == {**v4, "rope_theta": 5e5,
                                                                              "sliding_window": 8}
    v5 = {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    assert rope_of(with_overrides(v5, '{"rope_theta": 5e5}'))[0] == 5e5
    theta, rs = rope_of(with_overrides(v5, '{"rope_scaling": {"type": "linear", "factor": 2.0}}'))
    assert (theta, rs.rope_type, rs.factor) == (1e6, "linear", 2.0)  # the base kept, the scaling the override's
    per_type = {"rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}}
    with pytest.raises(ValueError, match="per layer type"):
        with_overrides(per_type, '{"rope_theta": 5e5}')
    with pytest.raises(ValueError, match="not JSON"):
        with_overrides(v4, "{rope_theta: 1}")
