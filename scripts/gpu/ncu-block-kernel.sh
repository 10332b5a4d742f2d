#!/usr/bin/env bash
# Where DeiT-T's chained block kernel (candle_fastpath::attention_block, lever 65) spends a
# launch: ncu on one of its launches inside bench's batch-1 CUDA-graph replays (f16, dense),
# caches and clocks left alone (warm, boost clocks, like a replay): duration, warp states,
# issue activity; then its per-SASS-instruction stall samples (sampling every 2^5 cycles),
# summarised as the instructions with the most samples and the samples by stall reason.
# Needs .gpu/bench.xz; repo root. LAUNCH_SKIP (default 22) picks which launch.
set -u
. scripts/gpu/lib.sh
unpack bench
start_log ncu-block-kernel.txt
ncu --cache-control none --clock-control none --kernel-name regex:attention_block --launch-skip ${LAUNCH_SKIP:-22} --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy --section SchedulerStats --print-details all \
  $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 --pruners none --paths ragged --reps 5 --warmup 1 --out /tmp/x.json 2>&1 \
  | grep -v "^==PROF==" | grep -E "attention_block|Duration|Elapsed Cycles|SM Active|Throughput|Registers|Shared Memory|Grid Size|Block Size|Cluster|Warp Cycles|Issue|Eligible|Active Warps|Stall|Theoretical|Achieved" >> "$C"
ncu --cache-control none --clock-control none --kernel-name regex:attention_block --launch-skip ${LAUNCH_SKIP:-22} --launch-count 1 \
  --warp-sampling-interval 0 --section SourceCounters --page source --print-source sass --csv \
  $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 --pruners none --paths ragged --reps 5 --warmup 1 --out /tmp/x.json > /tmp/src.csv 2>/dev/null
echo "== source page: $(wc -l < /tmp/src.csv) lines" >> "$C"
python3 scripts/gpu/ncu_source.py /tmp/src.csv >> "$C"
cat "$C"
