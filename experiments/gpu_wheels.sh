#!/usr/bin/env bash
# Fill .whl/ with the wheels experiments/gpu_run.sh installs on the GPU machine, whose image
# has torch (CUDA 13), aiohttp, prometheus-client, tokenizers, safetensors and numpy on
# Python 3.12 but no nixl, pyzmq, msgspec or setproctitle, and no network.
# Run here (where pip reaches an index); ~60 MB, nixl-cu13 most of it.
set -euo pipefail
cd "$(dirname "$0")/.."
EXCLUDE=$(git rev-parse --git-path info/exclude)  # keep the wheels out of git (they travel as a carried path)
grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"
PY=${PYTHON:-python3}
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64)
args=(--no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" --implementation cp -d .whl)
for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
"$PY" -m pip download -q "${args[@]}" \
  "nixl==${NIXL_VERSION:-1.5.1}" "nixl-cu13==${NIXL_VERSION:-1.5.1}" \
  "pyzmq==27.3.0" "msgspec==0.23.0" "setproctitle==1.3.8"
ls -1 .whl
