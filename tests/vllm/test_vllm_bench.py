"""vLLM's own benchmark client (`vllm bench serve`, random dataset) against a push
deployment of a tiny Llama checkpoint, through /v1/completions (`--backend openai`)
and /v1/chat/completions (`--backend openai-chat`): every request completes.

Runs where vLLM is importable: in this interpreter, or in the one named by
PUSHKV_VLLM_PYTHON (e.g. a separate venv with the vLLM CPU build). Skipped otherwise.
The benchmark is driven through vllm.benchmarks.serve (what `vllm bench serve` calls),
so a vLLM build without package metadata under the name "vllm" runs it too.
"""
import json
import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

from pushkv.config import preset
from tests.model.test_model import write_checkpoint
from tests.support.deploy import deployment, wait_pools_free

pytestmark = pytest.mark.timeout(900)

VLLM_PYTHON = os.environ.get("PUSHKV_VLLM_PYTHON") or (sys.executable if find_spec("vllm") else "")
NUM_PROMPTS = 20
BENCH = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
res = main(p.parse_args(sys.argv[1:]))
print("PUSHKV_RESULT " + json.dumps({k: v for k, v in res.items() if isinstance(v, (int, float, str))}))
"""
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def bench(url: str, ckpt: str, backend: str, endpoint: str, out_dir) -> tuple[dict, str]:
    argv = [VLLM_PYTHON, "-c", BENCH, "--backend", backend, "--base-url", url, "--endpoint", endpoint,
            "--model", ckpt, "--tokenizer", ckpt, "--dataset-name", "random", "--random-input-len", "64",
            "--random-output-len", "16", "--num-prompts", str(NUM_PROMPTS), "--request-rate", "4",
            "--ignore-eos", "--seed", "0", "--disable-tqdm", "--ready-check-timeout-sec", "60"]
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)  # vLLM's own interpreter and packages
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=str(out_dir))
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-4000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("PUSHKV_RESULT ")][-1]
    return json.loads(line[len("PUSHKV_RESULT "):]), done.stdout


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
