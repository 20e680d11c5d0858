#!/usr/bin/env bash
# Issue 31's GPU check: `pushkv up` on a GPU with no --num-blocks sizes each pool from the device's memory
# (--gpu-memory-utilization, default 0.9), serves a request, and stops clean. Prints each KV pool line, the
# device's memory in use while serving (nvidia-smi), a completion, and the stop's exit status.
#   OUT=out bash experiments/gpu_sizing_check.sh [more `pushkv up` flags]
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
OUT=$(realpath -m "${OUT:-out}"); mkdir -p "$OUT"; LOG=$OUT/sizing_up.log; PORT=${PORT:-8123}
python3 -c "from tools.cli import main; import sys; sys.argv[0] = 'pushkv'; main()" up --model qwen3-8b \
  --load-format dummy --port $PORT "$@" > "$LOG" 2>&1 &
UP=$!
for _ in $(seq 600); do grep -q READY "$LOG" && break; kill -0 $UP 2>/dev/null || break; sleep 0.5; done
grep -E "KV pool|READY|error|Error" "$LOG" | head -20
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader | sed 's/^/device memory in use (serving): /'
curl -s -m 60 localhost:$PORT/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8}'; echo
kill -TERM $UP; wait $UP; echo "pushkv up stopped: rc=$?"
nvidia-smi --query-gpu=memory.used --format=csv,noheader | sed 's/^/device memory in use (after stop): /'
