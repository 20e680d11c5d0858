#!/usr/bin/env bash
# Fill .whl/ with the wheels experiments/gpu_run.sh installs on the GPU machine, whose image
# has torch (CUDA 13), aiohttp, prometheus-client, tokenizers, safetensors and numpy on
# Python 3.12 but no nixl, pyzmq, msgspec, setproctitle or peft, and no network.
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
# the LoRA GPU tests' reference (tests/model/test_lora_gpu.py): PEFT and what it needs beyond the image's transformers
"$PY" -m pip download -q --no-deps -d .whl "peft==0.21.2" "accelerate==1.16.0"
# the device tree travels capped at 64 MiB: keep of nixl-cu13 (58.8 MB) only what pushkv loads (its module,
# its libraries and UCX plugins: ~29 MB), not nixl_ep (expert-parallel builds per torch version), headers, examples
"$PY" - <<'PYEOF'
import glob, os, zipfile
for src in glob.glob(".whl/nixl_cu13-*.whl"):
    keep = ("nixl_cu13/", "nixl_cu13.libs/", ".nixl_cu13.mesonpy.libs/", "nixl_cu13-")
    tmp = src + ".slim"
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for info in z.infolist():
            if info.filename.startswith(keep) and "/headers/" not in info.filename and "/scripts/" not in info.filename:
                out.writestr(info, z.read(info.filename))
    os.replace(tmp, src)
    print(f"{src}: {os.path.getsize(src) / 1e6:.1f} MB after slimming")
PYEOF
ls -1 .whl
