#!/usr/bin/env bash
# Lever 115 was NOT kept: the code is in docs/benchmarks/history/lever115-select-normed.patch
# (git apply it on e3c409e, the commit after stop 47's levers 113 / 114, then bundle.sh bench select
# paths_agreement).
# Lever 115 on the GPU machine, from the repo root: a fixed-count pruning step before a block
# hands the block norm1 of its kept rows (candle_ragged::select_top_k_normed: the selection kernel
# normalises each kept row as it copies it) where the block would otherwise run norm1 as its own
# LayerNorm launch (batch 8 and up), against the step then the LayerNorm launch
# (`CANDLE_DEIT_SELECT_NORMED=0`). One binary. Needs .gpu/{bench,test-select,test-paths_agreement}.xz.
# STAGES (default "checks replay e2e"):
#   checks  test-select, its memcheck and racecheck; the normed rows bit for bit candle-fastpath's
#           LayerNorm (paths_agreement's select_normed_equals_the_layer_norm_bit_for_bit); paths
#           at DeiT-T batch 64 and DeiT-S batch 32
#   replay  one graph replay's kernels (ncu, warm, boost) per arm: DeiT-T batch 64 Threshold-L2 fixed
#   e2e     bench T / S / B, batch 8 / 64 / 256 (E2E_BATCH), f16, Threshold-L2 / DynamicViT fixed
#           (and dense, which the lever does not touch: the run's noise), ragged path, arms
#           interleaved, two rounds; per-row ratios
set -u
stages=${STAGES:-checks replay e2e}
. scripts/gpu/lib.sh
unpack bench test-select test-paths_agreement
start_log select-normed.txt
ARMS=${ARMS:-0 default}
V=CANDLE_DEIT_SELECT_NORMED
val() { [ "$1" = default ] && echo "" || echo "$1"; }
if has checks; then
  sanitize select
  echo "== normed rows against candle-fastpath's LayerNorm" >> "$C"
  PATHS_DEVICE=cuda timeout 200 $B/test-paths_agreement --ignored --test-threads=1 select_normed_equals_the_layer_norm_bit_for_bit 2>&1 | grep -E "test result|panicked|differ" >> "$C"
  paths_check deit-tiny 64 300
  paths_check deit-small 32 300
fi
has replay && replay_arms "$V" "$ARMS" "deit-tiny:64:threshold-l2-fixed" "layer_norm|select"
e2e_run() { env "$V=$(val $1)" timeout 280 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 \
  --batch "${E2E_BATCH:-8,64,256}" --pruners none,threshold-l2-fixed,dynamicvit-fixed --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds e2e e2e_run
pack select-normed-json.tgz 'e2e-*.json'
cat "$C"
