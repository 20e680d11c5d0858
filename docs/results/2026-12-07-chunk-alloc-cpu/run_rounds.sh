#!/bin/bash
# Three rounds of experiments.chunk_alloc for each argument set given, alternating two checkouts of pushkv.
# Usage: BEFORE=TREE AFTER=TREE bash run_rounds.sh "ARGS" ["ARGS" ...]   (PYTHON: the interpreter, default python3)
#   small chunks:        "local 24 6 160 16" "local 48 8 320 32" "pull 24 6 160 16" "push 24 6 160 16"
#   budget = the chunk:  "local 48 8 320 32 8 32" "local 48 8 320 64 8 64"
set -u
PY=${PYTHON:-python3}
for args in "$@"; do
  for rep in 1 2 3; do
    for tag in before after; do
      if [ "$tag" = before ]; then tree=$BEFORE; else tree=$AFTER; fi
      out=$(cd "$tree" && timeout 300 "$PY" -m experiments.chunk_alloc $args 2>&1 | tail -1)
      echo "$tag $out"
    done
  done
done
