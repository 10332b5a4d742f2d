#!/usr/bin/env bash
# Per-kernel GPU time of whole forwards under ncu (gpu__time_duration per launch, summed by
# kernel name), for "what bounds it" in docs/BENCHMARKS.md. Needs .gpu/bench.xz; repo root.
#   FORWARDS="deit-base:256 deit-small:1 deit-tiny:8:threshold-l2-fixed" scripts/gpu/ncu-forward-kernels.sh
# Each entry is model:batch[:pruner] (pruner default none: the dense forward; a pruned one runs
# the ragged path with decisions on the device). bench runs one warm-up and one timed forward
# (--cuda-graph false), so counts and sums cover two forwards; the summary halves them.
# At batch 1 the eager forward takes candle_fastpath::small_block, which graph captures do not.
set -u
. scripts/gpu/lib.sh
unpack bench
start_log ncu-forward-kernels.txt
for spec in ${FORWARDS:-deit-base:256 deit-small:1}; do
  IFS=: read -r m b p <<< "$spec"
  p=${p:-none}
  ncu --metrics gpu__time_duration.sum --csv --print-units base $B/bench --device cuda --models $m --dtype ${DTYPE:-f16} --batch $b --pruners $p --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
  python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "$m batch $b ${DTYPE:-f16} $p" >> "$C"
done
cat "$C"
