#!/bin/bash
PY=/work/main/.venv/bin/python
for args in "local 24 6 160 16" "local 48 8 320 32" "pull 24 6 160 16" "push 24 6 160 16"; do
  for rep in 1 2 3; do
    for tree in /tmp/before /work/w_sched; do
      if [ "$tree" = /tmp/before ]; then tag=before; else tag=after; fi
      out=$(cd $tree && timeout 300 $PY -m experiments.chunk_alloc $args 2>&1 | tail -1)
      echo "$tag $out"
    done
  done
done
