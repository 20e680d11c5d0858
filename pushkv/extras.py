"""Optional dependencies: which of pushkv's pip extras brings each optional module, and the error
that says so. The base install serves (CPU or CUDA torch); the extras add what only some commands
need (pyproject.toml declares them; tests/tools/test_dependencies.py holds this table to it)."""
from __future__ import annotations

EXTRA_OF = {
    "triton": "gpu",                    # the CUDA kernels (pushkv/model/kernels/triton_*.py)
    "matplotlib": "bench",              # pushkv plot, sweep, roofline, stream-bench, link-bench: figures
    "tqdm": "bench",                    # pushkv bench, sweep, link-bench: progress
    "kubernetes_validate": "deploy",    # pushkv check-deploy
    "xgrammar": "structured",           # structured output's grammars (router/structured.py, scheduler/grammar.py)
    "vllm": "vllm",                     # pushkv.vllm, the vLLM connector
    "transformers": "vllm",             # pushkv.vllm's tiny test model
    "psutil": "vllm",                   # pushkv vllm-bench: the servers' CPU seconds (vLLM depends on it)
    "opentelemetry": "otlp",            # --otlp-traces-endpoint: the SDK and its OTLP exporters (pushkv/otlp.py)
}


def missing(module: str, what: str) -> ModuleNotFoundError:
    """The error for ``what`` (a command or a part) when ``module`` is not installed."""
    top = module.split(".")[0]
    extra = EXTRA_OF[top]
    return ModuleNotFoundError(f"{what} needs {top}, which pushkv's {extra!r} extra installs: "
                               f"pip install 'pushkv[{extra}]'", name=top)
