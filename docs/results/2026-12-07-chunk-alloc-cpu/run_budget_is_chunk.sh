#!/bin/bash
PY=/work/main/.venv/bin/python
for args in "local 48 8 320 32 8 32" "local 48 8 320 64 8 64"; do
  for rep in 1 2 3; do
    for tree in /tmp/before /work/w_sched; do
      if [ "$tree" = /tmp/before ]; then tag=before; else tag=after; fi
      out=$(cd $tree && timeout 300 $PY -m experiments.chunk_alloc $args 2>&1 | tail -1)
      echo "$tag $out"
    done
  done
done
