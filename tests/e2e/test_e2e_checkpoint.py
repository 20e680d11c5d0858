"""A local Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json)
served through P/D: `pushkv up --checkpoint DIR` takes the geometry and the
tokenizer from it, and push gives the same greedy tokens as local mode."""
import pytest

from pushkv.config import preset
from tests.support.deploy import deployment, wait_pools_free
from tests.model.test_model import write_checkpoint

pytestmark = pytest.mark.timeout(300)


def test_checkpoint_push_equals_local(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_checkpoint(str(ckpt), preset("tiny", seed=5, qk_norm=False, vocab_size=300), "LlamaForCausalLM", False)
    prompts = ["hello world", "the quick brown fox jumps", [5, 17, 42, 99, 3, 250]]
    got = {}
    for mode in ("local", "push"):
        d = tmp_path / mode
        d.mkdir()
        with deployment(d, "--mode", mode, "--checkpoint", str(ckpt), "--num-blocks", "64") as dep:
            got[mode] = [dep.complete(p, 8)["choices"][0] for p in prompts]
            wait_pools_free(dep)
    assert [c["token_ids"] for c in got["push"]] == [c["token_ids"] for c in got["local"]]
    assert [c["text"] for c in got["push"]] == [c["text"] for c in got["local"]]
    assert all(len(c["token_ids"]) >= 1 for c in got["push"])
