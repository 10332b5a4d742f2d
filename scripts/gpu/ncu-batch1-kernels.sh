#!/usr/bin/env bash
# Where the DeiT-T batch-1 graphs' kernels spend a launch after levers 68-74: ncu on one launch of
# each kernel family inside bench's CUDA-graph replays (f16, ragged path), caches and clocks left
# alone (warm, boost clocks, like a replay): duration, SM active cycles, issue activity, warp
# states (the stall reasons per issued instruction). KERNELS (default below) are
# "regex:pruner:launch-skip" triples: which kernel, in which forward, which of its launches.
# Needs .gpu/bench.xz; repo root.
set -u
. scripts/gpu/lib.sh
unpack bench
start_log ncu-batch1-kernels.txt
for spec in ${KERNELS:-attention_block:none:22 ragged_select_top_k:threshold-l2-fixed:4 attention_residual_norm_linear:evit-fixed:4 ragged_cls_probs:evit-fixed:4 ragged_select_top_k:evit-fixed:4 mlp_block:evit-fixed:4 fastpath_residual_norm_linear:none:4}; do
  IFS=: read -r name pruner skip <<< "$spec"
  echo "== $name ($pruner, launch-skip $skip)" >> "$C"
  timeout 120 ncu --cache-control none --clock-control none --kernel-name regex:"$name" --launch-skip "$skip" --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section LaunchStats --print-details all \
    $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 --pruners "$pruner" --paths ragged --reps 5 --warmup 1 --out /tmp/x.json 2>&1 \
    | grep -v "^==PROF==" | grep -E "^  [a-z_]+.*\(|Duration|SM Active Cycles|Elapsed Cycles|Issue Active|Grid Size|Block Size|Registers Per|Warp Cycles Per Issued|Stall [A-Z]" \
    | awk '/Stall/ { if ($(NF) + 0 < 0.3) next } { print }' >> "$C"
done
cat "$C"
