#!/usr/bin/env bash
# Streaming push in each regime on one GPU (P and D share it): what docs/results/stream_regimes reports.
# Steps (any order): e2e (GPU end-to-end tests: layer-streamed push, the default, equals local), probe (a WRITE
# posted from a second thread over UCX's TCP transport: does the loop stay free?), device (lone TTFT per mode
# on the device path, 1k-16k), devload (8k x QPS 2 per mode), tcp (lone per mode over UCX TCP), tcpload (1k x
# QPS 2 over UCX TCP), tcpposter (that load with P's poster thread off and on), tcplink (that load per link window), tcpstaging (pushkv's staging against UCX's, lone and at that load), tcpstaginglone (pushkv's staging lone, unstreamed and layer-streamed: the lone goal). Needs the wheels of tools/gpu_wheels.sh in .whl/.
#   bash experiments/stream_regimes_gpu.sh e2e probe device devload
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PUSHKV_THREADS=${PUSHKV_THREADS:-4}
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/hardware.txt"
python3 -c "import torch, nixl; print('torch', torch.__version__)" | tee -a "$OUT/hardware.txt"
UP="--model qwen3-8b --device cuda:0 --num-blocks 16384 --max-num-seqs 64 --max-batch-tokens 16384 ${UP_EXTRA:-}"
MODES=${MODES:-push-off push-layer pull-inline pull-background local}
TCP="UCX_TLS=tcp,cuda_copy"
lone() {  # name, lengths, reps, env...
  local name=$1 lengths=$2 reps=$3; shift 3
  env "$@" timeout ${LONE_S:-300} python3 -m tools.stream_bench --modes $MODES --lengths $lengths --reps $reps --vocab 150000 \
    --up-args "$UP --push-stream-groups ${GROUPS_N:-4}" --title "qwen3-8b, one H200 (P and D share it) $*" --out "$OUT/$name" \
    2>&1 | grep -v "^20" | tee "$OUT/$name.txt" | tail -14
  rm -f "$OUT/$name"/*.log
}
load() {  # name, length, env...
  local name=$1 length=$2; shift 2
  env "$@" timeout ${LOAD_S:-330} python3 -m tools.sweep --modes $MODES --inputs $length --qps 2 --num-prompts ${LOAD_N:-24} \
    --output-len 128 --warmup 1 --up-args "$UP --push-stream-groups ${GROUPS_N:-4}" --result-dir "$OUT/$name" \
    > "$OUT/$name.log" 2>&1; tail -2 "$OUT/$name.log"
  python3 -m tools.stages "$OUT/$name" | tee "$OUT/$name.stages.txt" | tail -12
  python3 -m tools.plot "$OUT/$name" --out "$OUT/$name.png" 2>&1 | tee "$OUT/$name.table.txt" | tail -8
  rm -f "$OUT/$name"/*deployment.log
}
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case "$step" in
    e2e) timeout 300 python3 -m pytest -q -p no:cacheprovider -x tests/e2e/test_gpu_e2e.py 2>&1 | tail -4 | tee "$OUT/gpu_e2e.txt" ;;
    probe) for s in 64 256; do env $TCP timeout 150 python3 experiments/post_thread_probe.py --device cuda:0 --size-mib $s \
             2>&1 | grep "'mode'" | tee -a "$OUT/post_thread_probe.txt"; done ;;
    device) lone device_lone "${LENGTHS:-1024 4096 8192 16384}" ${REPS:-2} PUSHKV_NOP=1 ;;
    devload) load device_load_8k 8192 PUSHKV_NOP=1 ;;
    tcp) GROUPS_N=9 lone tcp_lone "${LENGTHS:-1024 4096 8192 16384}" ${REPS:-2} $TCP ;;
    tcpload) GROUPS_N=9 load tcp_load_1k 1024 $TCP ;;
    tcpposter) # the same load, P's WRITEs posted on the loop (off) and by a poster thread (on; auto's choice here)
           for v in off on; do UP_EXTRA="--writer-post-thread $v" GROUPS_N=9 load tcp_load_1k_poster_$v 1024 $TCP; done ;;
    tcplink) # that load with P's link queue at each window (--link-window: 1 = auto's choice over TCP; 64 = every
             # WRITE at once, as before the queue)
           for w in ${WINDOWS:-1 64}; do UP_EXTRA="--link-window $w ${UP_EXTRA:-}" GROUPS_N=9 load tcp_load_1k_window_$w 1024 $TCP; done ;;
    tcpstaging) # UCX TCP from GPU memory, pushkv's staging (push-layer: auto's choice there) against UCX's own
             # (push-layer-ucx-staging) and pull inline, lone and at the 1k load
           MODES="push-layer push-layer-ucx-staging pull-inline" GROUPS_N=9 lone tcp_staging_lone "${LENGTHS:-1024 4096 16384}" ${REPS:-2} $TCP
           MODES="push-layer push-layer-ucx-staging pull-inline" GROUPS_N=9 load tcp_staging_load_1k 1024 $TCP ;;
    tcpstaginglone) # lone over UCX TCP with pushkv's staging (auto's choice there): push-off (one WRITE at prefill
             # end, D copies it all in after) and push-layer (D copies each group in as its part lands); read
             # TTFT, prefill, tail (prefill end -> kv_received), copy (D's last WRITE landed -> kv_received)
             # and lone<= (1.15x max(prefill, push-off's tail less its copy)) in tcp_staging_lone.txt
           MODES="push-off push-layer" GROUPS_N=9 lone tcp_staging_lone "${LENGTHS:-1024 16384}" ${REPS:-2} $TCP ;;
    *) echo "unknown step $step" ;;
  esac
done
