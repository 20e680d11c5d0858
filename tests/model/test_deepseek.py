"""DeepSeek-V2 and V3 checkpoints (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``) written by transformers:
multi-head latent attention (a query LoRA on V3, RoPE on adjacent pairs, YaRN's mscale on the softmax) and the MoE
(softmax or sigmoid scores, groups of experts, V3's correction bias, a scaling factor, shared experts, dense first
layers) give transformers' float32 greedy tokens; what is not built is refused by field and value. Each case
changes the tokens where a part is left out (checked when the cases were written: without the RoPE permutation,
the mscale, the groups, the bias or the shared experts, 0-1 of 3 prompts stay equal)."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from pushkv.config import MoeRouting  # noqa: E402
from pushkv.model import build_model, get_tokenizer  # noqa: E402
from pushkv.model.checkpoint import model_config_from_hf  # noqa: E402
from tests.model.test_hf_reference import PROMPTS, hf_reference, save_hf_checkpoint  # noqa: E402
from tests.model.test_model import new_pool, paged_generate  # noqa: E402

# MLA: 4 heads of 16 no-RoPE dims + 8 RoPE dims, a latent of 16; 8 experts of 32 columns, 2 a token, one shared
# expert, the first layer dense (GEOMETRY's intermediate_size, 128)
MLA = dict(num_key_value_heads=4, head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
           kv_lora_rank=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
           first_k_dense_replace=1)
YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0}
CASES = {  # name: (family, config, the routing pushkv reads)
    "v2-lite": ("deepseek_v2", dict(MLA, q_lora_rank=None, topk_method="greedy"), MoeRouting()),
    "v2-groups": ("deepseek_v2", dict(MLA, q_lora_rank=None, topk_method="group_limited_greedy", n_group=2,
                                      topk_group=1, routed_scaling_factor=1.5),
                  MoeRouting("softmax", 2, 1, "max", False, 1.5)),
    "v3": ("deepseek_v3", dict(MLA, q_lora_rank=24, n_group=2, topk_group=1), MoeRouting("sigmoid", 2, 1, "top2",
                                                                                          True, 2.5)),
    "v3-yarn": ("deepseek_v3", dict(MLA, q_lora_rank=24, n_group=4, topk_group=2, rope_parameters=YARN),
                MoeRouting("sigmoid", 4, 2, "top2", True, 2.5)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, extra, routing = CASES[request.param]
    path = save_hf_checkpoint(str(tmp_path_factory.mktemp(request.param)), family, seed=3, **extra)
    return request.param, path, routing, hf_reference(path, PROMPTS)


@pytest.mark.parametrize("engine", ["per-seq", "batched"])
def test_float32_greedy_tokens_equal_transformers(case, engine):
    name, path, routing, want = case
    cfg = model_config_from_hf(path, engine=engine)
    assert (cfg.is_mla, cfg.head_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, cfg.num_experts, cfg.dense_layers,
            cfg.shared_intermediate_size, cfg.routing, cfg.rope_interleave) == \
        (True, 16, 8, 16, 8, 1, 32, routing, True)
    assert cfg.q_lora_rank == (24 if name.startswith("v3") else 0)
    if name == "v3-yarn":  # 1/sqrt(24) times (0.1 * 0.707 * ln 4 + 1) squared
        assert cfg.attn_scale == pytest.approx(24 ** -0.5 * (0.1 * 0.707 * 1.3862943611198906 + 1) ** 2)
    model, tok = build_model(cfg), get_tokenizer(cfg)
    assert type(model).__name__ == "MLAModel" and (model.batched is None) == (engine == "per-seq")
    for prompt, (ids, new) in zip(PROMPTS, want):
        assert tok.encode(prompt) == ids
        assert paged_generate(model, new_pool(model, 16, 16), ids, len(new), tuple(range(16))) == new, prompt


def _refused(tmp_path, family: str, needle: str, **extra):
    path = save_hf_checkpoint(str(tmp_path), family, seed=3, **dict(MLA, **extra))
    with pytest.raises(ValueError, match=needle):
        model_config_from_hf(path)


def test_what_is_not_built_is_refused_by_field_and_value(tmp_path):
    _refused(tmp_path / "a", "deepseek_v2", "moe_layer_freq: 2", q_lora_rank=None, moe_layer_freq=2)
    _refused(tmp_path / "b", "deepseek_v2", "v_head_dim 32 with qk_nope_head_dim 16", q_lora_rank=None,
             v_head_dim=32)
    _refused(tmp_path / "c", "deepseek_v2", "scoring_func 'sigmoid' with topk_method 'greedy'", q_lora_rank=None,
             scoring_func="sigmoid")


def test_a_v3_config_naming_another_routing_is_refused(tmp_path):
    path = save_hf_checkpoint(str(tmp_path), "deepseek_v3", seed=3, **dict(MLA, q_lora_rank=24, n_group=2,
                                                                            topk_group=1))
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    hf["topk_method"] = "greedy"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match="routes by sigmoid and noaux_tc only"):
        model_config_from_hf(path)


def test_the_batched_engine_runs_a_step_of_several_sequences_as_each_alone(case):
    """The batched engine's MLA path: three prompts prefilled in one step, then decoded together, give each
    prompt's own tokens (transformers')."""
    from pushkv.messages import SeqWork

    _, path, _, want = case
    model = build_model(model_config_from_hf(path, engine="batched"))
    pool = new_pool(model, 48, 16)
    tables = [tuple(range(16 * i, 16 * i + 16)) for i in range(len(want))]
    outs = [[t] for t in model.execute([SeqWork(i, tuple(ids), 0, tables[i]) for i, (ids, _) in enumerate(want)],
                                       pool)]
    for step in range(1, len(want[0][1])):
        seqs = [SeqWork(i, (o[-1],), len(ids) + step - 1, tables[i]) for i, ((ids, _), o) in enumerate(zip(want, outs))]
        for o, t in zip(outs, model.execute(seqs, pool)):
            o.append(t)
    assert outs == [new for _, new in want]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("engine", ["per-seq", "auto"])
def test_gpu_float32_greedy_tokens_equal_transformers(case, engine):
    """On a GPU: the same, through torch's CUDA ops, on the per-sequence engine and on what "auto" runs MLA on
    there, the batched one (its MLA path; its decode steps replayed from CUDA graphs with ``batched.MLA_GRAPHS``)."""
    from pushkv.model import batched

    _, path, _, want = case
    model = build_model(model_config_from_hf(path, engine=engine), device="cuda")
    assert (model.batched is None) == (engine == "per-seq")
    assert model.batched is None or model.batched.use_graphs == batched.MLA_GRAPHS
    for ids, new in want:
        pool = new_pool(model, 16, 16).cuda()
        assert paged_generate(model, pool, ids, len(new), tuple(range(16))) == new
    if model.batched is not None and batched.MLA_GRAPHS:
        assert model.batched.graphs, "no decode step was replayed from a graph"


def test_a_block_scaled_fp8_v3_checkpoint_gives_transformers_tokens(tmp_path):
    """DeepSeek-V3 ships block-scaled fp8 (as its -FP8 releases and V3 itself): its quantized projections (here the
    experts', the shared expert's, the dense layer's and o's) dequantized at load give the tokens transformers gives
    loading the same checkpoint."""
    pytest.importorskip("accelerate")
    from tests.model.test_fp8_checkpoint import quantize_checkpoint

    path = save_hf_checkpoint(str(tmp_path), "deepseek_v3", seed=5, **dict(MLA, q_lora_rank=24, n_group=2,
                                                                           topk_group=1))
    assert quantize_checkpoint(path, (16, 32)) >= 8 * 3 + 3 + 3  # every expert, the shared and dense SwiGLUs
    want = hf_reference(path, PROMPTS)
    model = build_model(model_config_from_hf(path))
    for ids, new in want:
        assert paged_generate(model, new_pool(model, 16, 16), ids, len(new), tuple(range(16))) == new


def test_a_decode_rows_absorbed_attention_equals_the_expanded_one(case):
    """One decode row over the latent rows as they are (``mla.absorbed_attention``) equals expanding every row
    into each head's keys and values first (``MLAModel._expand``, what a prefill does) to float32 rounding; and the
    batched engine's decode rows of a step, done together through their block tables (``_mla_decode_rows``), equal
    it row by row, with the slots past each sequence's length NaN."""
    import torch.nn.functional as F

    from pushkv.messages import SeqWork
    from pushkv.model.mla import absorbed_attention
    from pushkv.model.step import StepTensors, plan_step

    _, path, _, _ = case
    model = build_model(model_config_from_hf(path, engine="batched"))
    cfg, lw, heads = model.cfg, model.w.layers[1], model.plan.q_heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, heads, cfg.head_dim + cfg.qk_rope_dim, generator=g)
    rows = torch.randn(37, cfg.kv_lora_rank + cfg.qk_rope_dim, generator=g)
    keys, vals = model._expand(lw, rows)
    want = F.scaled_dot_product_attention(q[0][None, :, None], keys[None], vals[None], scale=model.attn_scale)
    one = absorbed_attention(lw, q[0], rows, cfg, heads, model.attn_scale)
    torch.testing.assert_close(one, want[0, :, 0].reshape(-1), atol=2e-5, rtol=1e-5)
    # three sequences of 37, 5 and 20 keys, decoding a row each, their blocks out of order in a NaN pool
    pool = new_pool(model, 16, 8)[:, 1]  # layer 1's view: [blocks, 1, 1, 8, r + rd]
    tables = [(9, 2, 14, 0, 5), (7,), (3, 11, 6)]
    lens = (37, 5, 20)
    g2 = torch.Generator().manual_seed(1)
    for table, n in zip(tables, lens):
        for p in range(n):
            pool[table[p // 8], 0, 0, p % 8] = torch.randn(rows.shape[1], generator=g2)
    plan = plan_step([SeqWork(i, (0,), n - 1, t) for i, (t, n) in enumerate(zip(tables, lens))], 8, 1)
    meta = StepTensors.upload(plan, torch.device("cpu"))
    attn = torch.zeros(3, heads * cfg.head_dim)
    model.batched._mla_decode_rows(lw, q, pool, meta, attn)
    for i, (table, n) in enumerate(zip(tables, lens)):
        seq_rows = torch.cat([pool[b, 0, 0] for b in table])[:n]
        torch.testing.assert_close(attn[i], absorbed_attention(lw, q[i], seq_rows, cfg, heads, model.attn_scale),
                                   atol=2e-5, rtol=1e-5)


def test_a_bf16_model_keeps_v3s_correction_bias_in_float32(case):
    """The bias decides near ties between experts; bf16 would round it (DeepSeek and vLLM keep it in float32)."""
    name, path, _, _ = case
    model = build_model(model_config_from_hf(path, dtype="bfloat16"))
    moe = [lw for lw in model.w.layers if lw.router is not None]
    assert moe and all(lw.gate_up.dtype == torch.bfloat16 for lw in moe)
    if name.startswith("v3"):
        assert all(lw.router_bias.dtype == torch.float32 for lw in moe)
    else:
        assert all(lw.router_bias is None for lw in moe)
