#!/usr/bin/env bash
# The chat workload on one GPU (P and D share it): the prefix cache on and off, conditional disaggregation
# off and on, the planner checked against each run (docs/results/chat_gpu). Needs the wheels of
# experiments/gpu_wheels.sh in .whl/. Env: NAME (the runs' folder and files), COND (conditional settings, default "off on"), CACHE, LAYOUTS, REPS, CONVS, RATE, SYSTEM, BLOCKS.
#   OUT=out COND="off on" bash experiments/chat_gpu.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PUSHKV_THREADS=${PUSHKV_THREADS:-4}
OUT=${OUT:-out}; NAME=${NAME:-runs}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/hardware.txt"
python3 -c "import torch, nixl; print('torch', torch.__version__)" | tee -a "$OUT/hardware.txt"
UP="--model qwen3-8b --device cuda:0 --num-blocks ${BLOCKS:-8192} --max-num-seqs 64 --max-batch-tokens 16384"
BENCH="--conversations ${CONVS:-32} --rate ${RATE:-4} --turns 2 8 --system-len ${SYSTEM:-4096} --user-len 64 256 \
  --output-len 64 --think-s 0.5 --vocab 150000"
timeout ${SWEEP_S:-560} python3 -m tools.cli chat-sweep --layouts ${LAYOUTS:-1p1d} --cache ${CACHE:-on off} \
  --conditional ${COND:-off on} --reps ${REPS:-1} --up-args "$UP" --bench-args "$BENCH" --start-timeout 240 \
  --result-dir "$OUT/$NAME" 2> >(grep -v " INFO " > "$OUT/$NAME.err") | tee "$OUT/$NAME.txt"
gzip -f "$OUT/$NAME"/*.log 2>/dev/null
tar czf "$OUT/$NAME.tgz" -C "$OUT" "$NAME" && rm -rf "${OUT:?}/$NAME"
tail -30 "$OUT/$NAME.err"
