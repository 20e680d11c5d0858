#!/usr/bin/env bash
# Install pushkv and everything it needs into ./.venv, from nothing.
# torch is pinned to the CPU wheel first so that nixl's own torch requirement
# does not pull a multi-GB CUDA build onto a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==${PUSHKV_TORCH:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[test,bench]"
.venv/bin/python -c "import torch, nixl._api, zmq, msgspec, aiohttp; print('pushkv deps ok: torch', torch.__version__)"
