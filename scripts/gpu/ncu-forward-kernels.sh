#!/usr/bin/env bash
# Per-kernel GPU time of whole dense forwards under ncu (gpu__time_duration per launch, summed by
# kernel name), for "what bounds it" in docs/BENCHMARKS.md. Needs .gpu/bench.xz; repo root.
#   FORWARDS="deit-base:256 deit-small:1" scripts/gpu/ncu-forward-kernels.sh
# bench runs one warm-up and one timed forward (--cuda-graph false), so counts and sums cover two
# forwards; the summary halves them.
set -u
. scripts/gpu/lib.sh
unpack bench
C="$out/ncu-forward-kernels.txt"
nvidia-smi --query-gpu=name --format=csv,noheader >> "$C"
for mb in ${FORWARDS:-deit-base:256 deit-small:1}; do
  m=${mb%:*}; b=${mb#*:}
  ncu --metrics gpu__time_duration.sum --csv --print-units base $B/bench --device cuda --models $m --dtype ${DTYPE:-f16} --batch $b --pruners none --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
  python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "$m batch $b ${DTYPE:-f16}" >> "$C"
done
cat "$C"
