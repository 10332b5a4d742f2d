#!/usr/bin/env bash
# Where a batch-1 forward's time goes, kernel by kernel, as a CUDA-graph replay runs it: ncu over
# an eager DeiT forward with the one-kernel block off (CANDLE_FASTPATH_SMALL_BLOCK=0, so the
# kernels are the graph's), caches and clocks left alone (--cache-control none --clock-control
# none: warm, boost clocks, like a replay); then the per-SASS-instruction stall samples of the
# attention kernel at that shape. Needs .gpu/{bench,bench-attention}.xz; repo root.
#   MODELS="deit-small" scripts/gpu/ncu-batch1.sh
# STAGES (default "forward source"); SOURCE_LAUNCHES (default 1): attention launches sampled (one
# 7-us launch gives only ~250 samples).
set -u
stages=${STAGES:-forward source}
. scripts/gpu/lib.sh
unpack bench bench-attention
start_log ncu-batch1.txt
has forward && for m in ${MODELS:-deit-small}; do
  ncu_forward "" "$m dense batch 1 f16, separate kernels, warm, boost clocks" --models $m --dtype f16 --batch 1 --pruners none
done
heads=${ATTN_HEADS:-6}
has source || { cat "$C"; exit 0; }
ncu --cache-control none --clock-control none --kernel-name regex:ragged_attn --launch-skip 20 --launch-count ${SOURCE_LAUNCHES:-1} \
  --section SourceCounters --section WarpStateStats --section LaunchStats --section SpeedOfLight --page source --print-source sass --csv \
  $B/bench-attention --heads $heads --batch 1 --keep 1.0 --dtype f16 --host-calls 100 --gpu-reps 3 --out /tmp/y.json > "$out/source-attn-b1.csv" 2> "$out/source-attn-b1.err"
echo "== ncu source page, attention heads $heads batch 1 keep 1.0 f16: rc=$? $(wc -l < "$out/source-attn-b1.csv") lines" >> "$C"
ncu --cache-control none --clock-control none --kernel-name regex:ragged_attn --launch-skip 20 --launch-count 1 \
  --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_active.avg,gpc__cycles_elapsed.max \
  $B/bench-attention --heads $heads --batch 1 --keep 1.0 --dtype f16 --host-calls 10 --gpu-reps 3 --out /tmp/y.json 2>/dev/null | grep -E "gpu__time|launch__|warps_active|issue_active|cycles" >> "$C"
pack ncu-batch1.tgz 'source-attn-b1.*'
cat "$C"
