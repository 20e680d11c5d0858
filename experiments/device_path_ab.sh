#!/usr/bin/env bash
# The device path's A/B (issue 27's "does not regress" goal): the same load, 8k x QPS 2 (24 prompts, 128 output
# tokens, qwen3-8b on cuda:0, P and D sharing it), push-layer, run by this tree (B) and by an older one (A:
# `git archive REV pushkv processes tools | tar x -C .old`), interleaved A B A B ... in one lease, so both see the
# same machine. Prints each run's TTFT and TPOT p50 and the ratio B / A.
#   OLD=.old ROUNDS=2 OUT=out bash experiments/device_path_ab.sh
# UP_A / UP_B give A and B their own `pushkv up` flags (both default to UP).
set -uo pipefail
cd "$(dirname "$0")/.."
[ -n "${NO_WHL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
OUT=$(realpath -m "${OUT:-out}"); mkdir -p "$OUT"; OLD=$(realpath "${OLD:-.old}")
UP=${UP:-"--model qwen3-8b --device cuda:0 --num-blocks 16384 --max-num-seqs 64 --max-batch-tokens 16384 --push-stream-groups 4"}
UP_A=${UP_A:-$UP}; UP_B=${UP_B:-$UP}  # each tree's own flags (e.g. its default layer groups: leave the flag out)
run() {  # label, tree, up args
  (cd "$2" && PYTHONPATH=/tmp/site:$PWD PUSHKV_THREADS=4 timeout 300 python3 -m tools.sweep --modes push-layer \
    --inputs ${INPUT:-8192} --qps 2 --num-prompts ${N:-24} --output-len ${OUTPUT_LEN:-128} --warmup 1 --up-args "$3" \
    --result-dir "$OUT/$1" > "$OUT/$1.log" 2>&1)
  python3 - "$OUT/$1" "$1" <<'PY'
import glob, json, statistics, sys
rows = [json.load(open(p)) for p in glob.glob(sys.argv[1] + "/*.json")]
r = [x for x in rows if "median_ttft_ms" in x]
print(sys.argv[2], *(f"ttft_p50={x['median_ttft_ms']:.1f} tpot_p50={x['median_tpot_ms']:.2f} failed={x.get('failed', 0)}" for x in r))
PY
  rm -f "$OUT/$1"/*deployment.log
}
for i in $(seq ${ROUNDS:-2}); do run A$i "$OLD" "$UP_A"; run B$i "$PWD" "$UP_B"; done 2>&1 | tee "$OUT/ab.txt"
python3 - "$OUT/ab.txt" <<'PY'
import re, statistics, sys
v = {"A": [], "B": []}
for line in open(sys.argv[1]):
    m = re.match(r"([AB])\d+ ttft_p50=([\d.]+) tpot_p50=([\d.]+)", line)
    if m: v[m[1]].append((float(m[2]), float(m[3])))
if v["A"] and v["B"]:
    a = [statistics.median(x[k] for x in v["A"]) for k in (0, 1)]; b = [statistics.median(x[k] for x in v["B"]) for k in (0, 1)]
    print(f"B / A: TTFT p50 {b[0] / a[0]:.3f} ({b[0]:.1f} / {a[0]:.1f} ms), TPOT p50 {b[1] / a[1]:.3f} ({b[1]:.2f} / {a[1]:.2f} ms)")
PY
