"""pushkv roofline's bounds, on the CPU: a mixture of experts' decode step reads only the experts its
routing chose, and its tokens' FLOPs go through k experts each, not every expert; the chosen experts
are counted on a real step of a tiny random MoE model."""
from __future__ import annotations

import msgspec
import pytest
import torch

from pushkv.config import ModelConfig, preset
from pushkv.messages import SeqWork
from pushkv.model import build_model
from tests.model.test_model import new_pool
from tools import roofline as R

pytestmark = pytest.mark.timeout(120)

L, D, HEADS, KV, HD, I, E, K, V = 2, 64, 4, 2, 16, 32, 8, 2, 256
MOE = ModelConfig(name="tiny-moe", num_layers=L, hidden_size=D, num_heads=HEADS, num_kv_heads=KV, head_dim=HD,
                  intermediate_size=I, vocab_size=V, max_position=512, architecture="Qwen3MoeForCausalLM",
                  num_experts=E, experts_per_token=K, qk_norm=True)
ATTN = (HEADS + 2 * KV) * HD * D + D * HEADS * HD  # qkv and o of one layer
EXPERT = 3 * D * I  # gate, up and down of one expert
KV_TOKEN = L * 2 * KV * HD * 4  # float32


@pytest.fixture(scope="module")
def moe():
    return build_model(MOE)


def test_moe_counts_split_what_every_token_uses_from_one_expert(moe):
    c = R.model_counts(moe)
    assert c["matmul_params"] == L * (ATTN + E * D)  # attention and the router
    assert c["expert_params"] == EXPERT and c["moe_layers"] == L and c["experts_per_token"] == K
    tables = 1 if moe.w.embed is moe.w.lm_head else 2  # the lm_head, and an untied embedding
    assert c["weight_bytes"] == (L * (ATTN + E * D + E * EXPERT) + tables * V * D) * 4
    assert c["kv_bytes_per_token"] == KV_TOKEN


def test_dense_counts_have_no_experts():
    dense = build_model(msgspec.structs.replace(preset("tiny"), vocab_size=V))
    c = R.model_counts(dense)
    cfg = dense.cfg
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    attn = (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * cfg.hidden_size  # qkv and o
    assert (c["matmul_params"], c["expert_params"], c["moe_layers"]) == (cfg.num_layers * (attn + mlp), 0, 0)
    assert R.decode_bytes(c, 3, 10) == (c["matmul_params"] + c["head_params"] + (3 * cfg.hidden_size
                                        if c["embed_params"] else 0)) * 4 + 3 * 11 * c["kv_bytes_per_token"]


# (batch, context, experts read over the layers): one token reads k a layer; a batch up to every one
@pytest.mark.parametrize("B, ctx, read", [(1, 0, L * K), (1, 100, L * K), (4, 37, L * 5), (8, 511, L * E)])
def test_moe_decode_bytes_count_the_chosen_experts_only(moe, B, ctx, read):
    c = R.model_counts(moe)
    head = V * D
    embed_rows = B * D if c["embed_params"] else 0  # an untied embedding: only the rows looked up
    want = (L * (ATTN + E * D) + head + embed_rows + read * EXPERT) * 4 + B * (ctx + 1) * KV_TOKEN
    assert R.decode_bytes(c, B, ctx, read) == want
    # the bound at a huge matmul rate is the bytes; at a huge bandwidth the FLOPs, k experts a token
    assert R.decode_bound(c, B, ctx, 1e9, 1e30, read) == pytest.approx(want / 1e9)
    flops = 2 * (L * (ATTN + E * D) + L * K * EXPERT + head) * B + 4 * B * (ctx + 1) * L * HEADS * HD
    assert R.decode_bound(c, B, ctx, 1e30, 1e12, read) == pytest.approx(flops / 1e12)


def test_moe_decode_bytes_refuse_fewer_than_k_experts_a_layer(moe):
    c = R.model_counts(moe)
    with pytest.raises(ValueError, match="at least k = 2 experts in each of its 2 layers"):
        R.decode_bytes(c, 1, 10, L * K - 1)
    with pytest.raises(ValueError, match="experts_read=0"):
        R.decode_bound(c, 1, 10, 1e9, 1e12)


def test_moe_prefill_flops_go_through_k_experts_a_token(moe):
    c = R.model_counts(moe)
    for tokens in (1, 16, 4096):
        want = 2 * (L * (ATTN + E * D) + L * K * EXPERT) * tokens + 2 * V * D + 2 * tokens * tokens * L * HEADS * HD
        assert R.prefill_flops(c, tokens) == want


def _step(moe, tokens: list[int], ctx: int = 5):
    pool = new_pool(moe, 4 * len(tokens), 16)
    prompt = [SeqWork(i, tuple(range(1, ctx + 1)), 0, (4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3), sample=False)
              for i in range(len(tokens))]
    moe.logits(prompt, pool)  # the context's K/V, so the step reads what it wrote
    seqs = [SeqWork(i, (t,), ctx, (4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3)) for i, t in enumerate(tokens)]
    return lambda: moe.logits(seqs, pool)


def test_chosen_experts_are_counted_on_a_real_step(moe):
    same = R.chosen_experts(moe, _step(moe, [7, 7, 7]))
    assert same == [K] * L  # three sequences alike route alike: k experts a layer
    run = _step(moe, [3, 50, 101, 200, 17, 90])
    before = run()
    apart = R.chosen_experts(moe, run)
    assert len(apart) == L and all(K <= n <= E for n in apart) and max(apart) > K
    assert "mlp_delta" not in vars(moe) and torch.equal(run(), before)  # the count left the model as it was
    assert R.decode_bytes(R.model_counts(moe), 6, 5, sum(apart)) < R.decode_bytes(R.model_counts(moe), 6, 5, L * E)


def test_a_held_setting_names_a_model_modules_attribute_and_refuses_one_it_lacks():
    from pushkv.model import batched
    from pushkv.model.kernels import paged, triton_moe

    assert R.model_setting("batched.SDPA_PROMPT_TOKENS") == (batched, "SDPA_PROMPT_TOKENS")
    assert R.model_setting("kernels.paged.FRESH_BACKEND") == (paged, "FRESH_BACKEND")
    assert R.model_setting("DOWN_COLS_FIRST_SLOTS") == (triton_moe, "DOWN_COLS_FIRST_SLOTS")
    with pytest.raises(SystemExit, match="pushkv.model.batched has no setting SDPA_TOKENS"):
        R.model_setting("batched.SDPA_TOKENS")
    assert (R.setting_value("0"), R.setting_value("-1"), R.setting_value("cudnn_attention")) == (0, -1,
                                                                                              "cudnn_attention")
