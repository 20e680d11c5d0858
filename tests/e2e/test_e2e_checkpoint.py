"""A local Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json)
served through P/D: `pushkv up --model DIR` takes the geometry and the
tokenizer from it, and push gives the same greedy tokens as local mode."""
import shutil

import pytest

from pushkv.config import preset
from tests.model.test_model import write_checkpoint
from tests.support.deploy import deployment, wait_pools_free

pytestmark = pytest.mark.timeout(300)


def test_checkpoint_push_equals_local(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), preset("tiny", seed=5, qk_norm=False, vocab_size=300), "LlamaForCausalLM", False)
    prompts = ["hello world", "the quick brown fox jumps", [5, 17, 42, 99, 3, 250]]
    got = {}
    for mode in ("local", "push"):
        d = tmp_path / mode
        d.mkdir()
        with deployment(d, "--mode", mode, "--model", str(ckpt), "--num-blocks", "64") as dep:
            got[mode] = [dep.complete(p, 8)["choices"][0] for p in prompts]
            wait_pools_free(dep)
    assert [c["token_ids"] for c in got["push"]] == [c["token_ids"] for c in got["local"]]
    assert [c["text"] for c in got["push"]] == [c["text"] for c in got["local"]]
    assert all(len(c["token_ids"]) >= 1 for c in got["push"])


def test_hub_id_moe_push_tp2_to_1_equals_transformers(tmp_path, monkeypatch):
    """`pushkv up --model ORG/NAME` from an offline Hub cache: a Qwen3-MoE checkpoint served in push
    mode, P on two TP ranks (each expert's columns split) and D on one, gives transformers' tokens."""
    from tests.config.test_model_flags import REPO
    from tests.model.test_hf_reference import PROMPTS, hf_reference, save_hf_checkpoint

    src = save_hf_checkpoint(str(tmp_path / "src"), "qwen3_moe", seed=4, num_local_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    want = hf_reference(src, PROMPTS)
    repo = tmp_path / "hf" / "hub" / ("models--" + REPO.replace("/", "--"))
    commit = "0" * 40
    shutil.copytree(src, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    push_tp2_to_1_gives(tmp_path, REPO, want, model=REPO)


def test_fp8_moe_push_tp2_to_1_equals_transformers(tmp_path):
    """A block-scaled FP8 Qwen3-MoE checkpoint (as Qwen ships its -FP8 models), served in push mode with P on two
    TP ranks and D on one, gives the tokens transformers gives loading the same FP8 checkpoint. Its blocks are 16
    rows by 32 columns, so each P rank's half of every expert's down projection starts mid-block."""
    pytest.importorskip("accelerate")
    from tests.model.test_fp8_checkpoint import quantize_checkpoint
    from tests.model.test_hf_reference import PROMPTS, hf_reference, save_hf_checkpoint

    ckpt = save_hf_checkpoint(str(tmp_path / "ckpt"), "qwen3_moe", seed=6, num_local_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    assert quantize_checkpoint(ckpt, (16, 32)) > 0
    want = hf_reference(ckpt, PROMPTS)
    push_tp2_to_1_gives(tmp_path, ckpt, want)


@pytest.mark.parametrize("engine", ["auto", "batched"])
def test_deepseek_v3_push_tp2_to_1_equals_transformers(tmp_path, engine):
    """A DeepSeek-V3 checkpoint (multi-head latent attention with a query LoRA, grouped sigmoid routing with its
    correction bias, a shared expert, a dense first layer) served in push mode, P on two TP ranks (each its heads,
    the latent whole) and D on one: the latent rows move as MLA's one replicated head, and the tokens are
    transformers', on the per-sequence engine and on the batched one."""
    from tests.model.test_deepseek import MLA
    from tests.model.test_hf_reference import PROMPTS, hf_reference, save_hf_checkpoint

    ckpt = save_hf_checkpoint(str(tmp_path / "ckpt"), "deepseek_v3", seed=7, **dict(MLA, q_lora_rank=24, n_group=2,
                                                                                    topk_group=1))
    want = hf_reference(ckpt, PROMPTS)
    push_tp2_to_1_gives(tmp_path, ckpt, want, up=("--engine", engine))


def push_tp2_to_1_gives(tmp_path, served: str, want, up: tuple[str, ...] = (), **complete) -> None:
    """``--model served`` in push mode, P on two TP ranks and D on one: each prompt's token count and greedy tokens
    are ``want``'s (transformers'), its KV moved by push, and every block is free after."""
    from tests.model.test_hf_reference import FLOAT32, NEW_TOKENS, PROMPTS

    (tmp_path / "dep").mkdir()
    with deployment(tmp_path / "dep", "--mode", "push", "--model", served, "--prefill-tp", "2", "--decode-tp", "1",
                    "--num-blocks", "64", *FLOAT32, *up) as dep:
        for prompt, (ids, new) in zip(PROMPTS, want):
            body = dep.complete(prompt, NEW_TOKENS, **complete)
            assert body["usage"]["prompt_tokens"] == len(ids), prompt
            assert body["choices"][0]["token_ids"] == new, prompt
            assert body["pushkv"]["path"] == "push" and body["pushkv"]["kv"]["prefill"]["bytes"] > 0, prompt
        wait_pools_free(dep)
