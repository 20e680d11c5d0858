#!/usr/bin/env bash
# P and D on one GPU (both cuda:0), each in its own network namespace, joined by a veth capped with tc (issue 27,
# item 5): UCX over TCP from GPU memory (UCX_TLS=tcp,cuda_copy, its TCP lanes bound to the veth), qwen3-8b,
# --num-blocks 3072, modes push-layer (pushkv's staging: auto's choice there), push-layer-ucx-staging (UCX's
# cuda_copy staging) and pull-inline, at 1k and 4k tokens, lone and at load. `pushkv link-bench` does the work
# (tools/link_bench.py: namespaces, tc, etcd, one deployment at a time, every rate given on each): each argument
# is a tc rate, run in that order by every mode. Needs root, iproute2 (ip, tc) and etcd; where the image lacks
# them, experiments/netbin.sh fills .netbin/ with this machine's, carried beside .whl. The namespaces, qdiscs,
# etcd and every process are removed however it ends (link-bench's cleanup, then a sweep on exit).
#   OUT=out bash experiments/capped_link_gpu.sh 10gbit 25gbit none
# Time (measured on an H200, 2026-12-03): a mode's start of P and D (qwen3-8b, dummy weights) with the link probe is
# about 45-50 s; four modes at one rate with one lone run and one load of 12 at 8k took 228 s, five at 4k over
# 10 Gbit/s about 250 s. Split the modes and rates over calls to stay under 9 minutes a call; BENCH_S (520) stops
# link-bench with what it has (its JSON, kept as it goes, and the planner's check then cover the cells that ran).
# Knobs: MODES, LENGTHS (lone), LOAD_LENGTHS, REPS, LOAD (share of a capped link's capacity the load asks for),
# QPS (uncapped link's load), LOAD_N (prompts per loaded run), BENCH_S (link-bench's time limit), DEVICE,
# BENCH_EXTRA (more link-bench flags), UP_EXTRA (more `pushkv up` flags). Smoke test on a CPU (tiny model):
#   DEVICE=cpu MODEL=small GEOMETRY="--num-kv-heads 8 --head-dim 64" TLS=tcp BLOCKS=1024 LENGTHS=256 \
#     LOAD_LENGTHS=256 REPS=1 LOAD_N=6 OUT=/tmp/capped bash experiments/capped_link_gpu.sh 300mbit
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .netbin ]; then  # carried iproute2 / etcd (experiments/netbin.sh): only where the image has none
  export PATH=$PATH:$PWD/.netbin/bin
  command -v etcd >/dev/null || [ ! -f .netbin/etcd.gz ] || { gunzip -c .netbin/etcd.gz > .netbin/bin/etcd && chmod +x .netbin/bin/etcd; }
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PUSHKV_THREADS=${PUSHKV_THREADS:-4} PYTHONUNBUFFERED=1
OUT=$(realpath -m "${OUT:-out}"); mkdir -p "$OUT"
RUN=$(mktemp -d /tmp/capped-link-XXXX)  # link-bench's folder; $OUT gets its tables, JSON and two archives
DEVICE=${DEVICE:-cuda:0}
[ $# -gt 0 ] || { echo "give the tc rates to run, e.g. 10gbit 25gbit none"; exit 2; }

cleanup() {  # what a killed link-bench left: namespaces of dead runs (tools/netns.py names them by pid)
  python3 -c "from tools import netns; netns.sweep_stale()" 2>/dev/null
  ip link del pkpf$$ 2>/dev/null; ip netns del pushkv-preflight-$$ 2>/dev/null
}
trap cleanup EXIT; trap "exit 130" INT; trap "exit 143" TERM

# preflight, in seconds: root, ip, tc, etcd, a namespace, a veth and a tbf qdisc (needs sch_tbf), and on a GPU
# torch's CUDA and NIXL from inside a namespace
preflight() {
  [ "$(id -u)" = 0 ] || { echo "preflight: not root"; return 1; }
  for b in ip tc etcd; do command -v $b >/dev/null || { echo "preflight: no $b (carry .netbin: experiments/netbin.sh)"; return 1; }; done
  local ns=pushkv-preflight-$$
  ip netns add $ns || { echo "preflight: ip netns add failed (no CAP_SYS_ADMIN?)"; return 1; }
  local ok=0
  ip link add pkpf$$ type veth peer name eth0 netns $ns \
    && ip -n $ns link set eth0 up \
    && tc -n $ns qdisc replace dev eth0 root tbf rate 10gbit burst 1250000 latency 20ms \
    && ip netns exec $ns true && ok=1
  if [ $ok = 1 ] && [ "${DEVICE%%:*}" = cuda ]; then  # the GPU and NIXL as a process inside a namespace sees them
    ip netns exec $ns timeout 120 python3 -c "import torch, nixl._api; torch.zeros(1, device='$DEVICE'); print('preflight: $DEVICE and NIXL inside a namespace')" || ok=0
  fi
  ip link del pkpf$$ 2>/dev/null; ip netns del $ns
  [ $ok = 1 ] || { echo "preflight: veth, tbf qdisc, ip netns exec or the GPU inside a namespace failed"; return 1; }
}
preflight || exit 1
{ [ "${DEVICE%%:*}" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, nixl; print('torch', torch.__version__)"; ip -V; tc -V; etcd --version | head -1
  nproc; } 2>&1 | tee "$OUT/hardware.txt"

echo "=== link-bench $* $(date -u +%H:%M:%S)"
# link-bench takes SIGTERM as Ctrl-C: it removes its hosts and processes before it exits
timeout -s TERM ${BENCH_S:-520} python3 -m tools.link_bench --rates "$@" --one-at-a-time \
  --modes ${MODES:-push-layer push-layer-ucx-staging pull-inline} \
  --model ${MODEL:-qwen3-8b} --geometry "${GEOMETRY:-}" --prefill-chunk 0 \
  --lengths ${LENGTHS:-1024 4096} --load-lengths ${LOAD_LENGTHS:-1024 4096} --reps ${REPS:-2} \
  --link-load ${LOAD:-0.9} --qps ${QPS:-2} --num-prompts ${LOAD_N:-16} --output-len ${OUTPUT_LEN:-32} \
  --ucx-tls ${TLS:-tcp,cuda_copy} --ucx-net-devices eth0 \
  --up-args "--device $DEVICE --num-blocks ${BLOCKS:-3072} --max-num-seqs 64 --max-batch-tokens 16384 ${UP_EXTRA:-}" \
  --out "$RUN" ${BENCH_EXTRA:-} 2>&1 | grep -v "^20" | tee "$OUT/link_bench.txt" | grep -v "link-bench:" | tail -60
rc=${PIPESTATUS[0]}
echo "=== done rc=$rc $(date -u +%H:%M:%S)"
# what comes back from the GPU machine (at most 8 files): the tables, the run's JSON, the planner's check, and two
# archives: every run's bench JSON with the plots, and the deployments' logs
cp "$RUN"/tables.md "$RUN"/link_bench.json "$OUT"/ 2>/dev/null
# the planner against the loaded runs, with the link's rate this sitting's probe measured (link-bench probes every
# capped rate before its runs)
python3 -m tools.link_plan "$RUN" > "$OUT/plan_check.txt" 2>&1
(cd "$RUN" && tar czf "$OUT/runs.tgz" --exclude=logs . && tar czf "$OUT/logs.tgz" logs) 2>/dev/null
rm -rf "$RUN"
exit $rc
