#!/usr/bin/env bash
# Experiment (a throwaway build with docs/benchmarks/history/lever91-select-skip-experiment.patch
# applied; lever 91's question): what the batch-1 step kernels' selection phases cost under ncu,
# by skipping them (CANDLE_FASTPATH_SELECT_SKIP bit mask: 1 the fused row, 2 the ranking and
# placement (the first tokens kept), 4 the scores' loads). Outputs are wrong with a mask; times
# only. Needs .gpu/bench.xz built with the patch.
set -u
. scripts/gpu/lib.sh
unpack bench
C="$out/select-skip.txt"
nvidia-smi --query-gpu=name --format=csv,noheader >> "$C"
for pr in evit-fixed threshold-l2-fixed; do
  for skip in 0 1 2 4 6 7; do
    CANDLE_FASTPATH_SELECT_SKIP=$skip CANDLE_FASTPATH_SMALL_BLOCK=0 ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
      $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 --pruners $pr --paths ragged --reps 2 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
    python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "$pr skip=$skip" | grep -E "==|select|attention_block|mlp_block|attention_residual_f16" >> "$C"
  done
done
cat "$C"
