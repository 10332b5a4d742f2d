#!/usr/bin/env bash
# Lever 39 on the GPU machine, from the repo root: select_top_k's class-attention scores (EViT
# fixed) in their own (sequence, head) blocks first (`cls_probs` with a null cu_seqlens), against
# every select block of a sequence computing them itself; one binary, CANDLE_RAGGED_SPLIT_SCORES=0
# vs the default (split below one sequence per SM). Needs .gpu/{bench,test-select,test-graph,
# test-paths_agreement}.xz (scripts/gpu/bundle.sh).
# STAGES (default "checks e2e"):
#   checks  test-select with =0 and =1 (its computed-score test decides as given scores do),
#           memcheck and racecheck of test-select with =1, test-graph, paths T/S/B batch 32
#   e2e     bench dense / Threshold-L2 fixed / EViT fixed, ragged, T/S/B, batch 1/8/64, f16, the
#           two arms interleaved, twice
set -u
stages=${STAGES:-checks e2e}
. scripts/gpu/lib.sh
unpack bench test-select test-graph test-paths_agreement
start_log split-topk.txt
if has checks; then
  for a in 0 1; do
    echo "== test-select (CANDLE_RAGGED_SPLIT_SCORES=$a)" >> "$C"
    CANDLE_RAGGED_SPLIT_SCORES=$a timeout 120 $B/test-select --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  done
  echo "== memcheck / racecheck test-select (CANDLE_RAGGED_SPLIT_SCORES=1)" >> "$C"
  CANDLE_RAGGED_SPLIT_SCORES=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-select --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  CANDLE_RAGGED_SPLIT_SCORES=1 timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-select --test-threads=1 computed 2>&1 | grep -E "RACECHECK SUMMARY|test result" >> "$C"
  echo "== test-graph" >> "$C"
  timeout 120 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "== paths (cuda, T/S/B, batch 32)" >> "$C"
  PATHS_DEVICE=cuda PATHS_MODELS=deit-tiny,deit-small,deit-base PATHS_BATCH=32 timeout 200 $B/test-paths_agreement --ignored --test-threads=1 > "$out/paths.log" 2>&1
  echo "paths rc=$?" >> "$C"
  grep -E "test result|panicked" "$out/paths.log" >> "$C"
fi
e2e_run() { CANDLE_RAGGED_SPLIT_SCORES=$1 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 1,8,64 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$2"; }
has e2e && ARMS="0 default" ab_rounds e2e e2e_run
pack split-topk-json.tgz 'e2e-*.json' 'paths.log'
cat "$C"
