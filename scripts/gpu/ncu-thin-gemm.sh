#!/usr/bin/env bash
# Where FusedLinear's thin GEMM (lever 100) spends a launch, next to cuBLASLt's kernel for the
# same GEMM: ncu on one launch of each inside a DeiT-S batch-1 dense f16 forward (eager, the
# graph's kernels), caches and clocks left alone (warm, boost clocks): duration, memory, warp
# states, issue activity; then the thin GEMM's per-SASS-instruction stall samples.
# Needs .gpu/bench.xz; repo root. KERNEL (default thin_gemm_f16_k384_gelu) picks the kernel;
# the cuBLASLt side runs with CANDLE_FASTPATH_THIN_GEMM=0 and NVJET (default the fc1 tile
# 64x40_64x16_4x1) as its name.
set -u
. scripts/gpu/lib.sh
unpack bench
start_log ncu-thin-gemm.txt
K=${KERNEL:-thin_gemm_f16_k384_gelu}
NV=${NVJET:-nvjet_sm90_hsh_64x40_64x16_4x1}
run() { env CANDLE_FASTPATH_SMALL_BLOCK=0 "$@" $B/bench --device cuda --models deit-small --dtype f16 --batch 1 --pruners none --paths ragged --reps 2 --warmup 1 --cuda-graph false --out /tmp/x.json; }
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy --section SchedulerStats --print-details all"
keep="Duration|Elapsed Cycles|SM Active|Throughput|Registers|Shared Memory|Grid Size|Block Size|Warp Cycles|Issue|Eligible|Active Warps|Stall|Achieved|Hit Rate|L2|DRAM|Mem Busy|Max Bandwidth"
for side in "$K CANDLE_FASTPATH_THIN_GEMM=" "$NV CANDLE_FASTPATH_THIN_GEMM=0"; do
  set -- $side
  echo "== $1 ($2)" >> "$C"
  run "$2" ncu --cache-control none --clock-control none --kernel-name regex:$1 --launch-skip 14 --launch-count 1 $sections 2>&1 \
    | grep -v "^==PROF==" | grep -E "$keep" >> "$C"
done
run CANDLE_FASTPATH_THIN_GEMM= ncu --cache-control none --clock-control none --kernel-name regex:$K --launch-skip 14 --launch-count 1 \
  --warp-sampling-interval 0 --section SourceCounters --page source --print-source sass --csv > /tmp/src.csv 2>/dev/null
echo "== $K source page: $(wc -l < /tmp/src.csv) lines" >> "$C"
python3 scripts/gpu/ncu_source.py /tmp/src.csv >> "$C"
cat "$C"
