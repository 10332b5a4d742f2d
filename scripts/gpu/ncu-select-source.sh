#!/usr/bin/env bash
# Where candle-ragged's select_top_k kernel waits at DeiT-T batch 1 (a Threshold-L2 / EViT fixed
# step inside bench's graph replays, f16): ncu's per-SASS-instruction warp stall samples (every
# 2^5 cycles), the 40 lines with the most samples and the code around the four hottest. PRUNERS
# (default "threshold-l2-fixed evit-fixed"). Needs .gpu/bench.xz; repo root.
set -u
. scripts/gpu/lib.sh
unpack bench
C="$out/ncu-select-source.txt"
for spec in ${PRUNERS:-threshold-l2-fixed evit-fixed}; do
  echo "== ragged_select_top_k ($spec): top SASS lines by stall samples" >> "$C"
  ncu --cache-control none --clock-control none --kernel-name regex:ragged_select_top_k --launch-skip 4 --launch-count 1 \
    --warp-sampling-interval 0 --section SourceCounters --page source --print-source sass --csv \
    $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 --pruners $spec --paths ragged --reps 5 --warmup 1 --out /tmp/x.json > /tmp/src.csv 2>/dev/null
  python3 scripts/gpu/ncu_source.py /tmp/src.csv --top 40 --context 4 >> "$C"
done
cat "$C"
