#!/usr/bin/env bash
# Lever 33 on the GPU machine, from the repo root: select_by_rule's class-attention scores
# (EViT adaptive, ATS) in their own (sequence, head) blocks first, against the decide block
# computing them itself, one binary (CANDLE_RAGGED_SPLIT_SCORES=0 vs the default, which splits
# below one sequence per SM). Needs .gpu/{bench,test-select_rule,test-select_bounded,test-paths_agreement}.xz.
# STAGES (default "checks ncu e2e"):
#   checks  test-select_rule and test-select_bounded with =0 and =1 (the computed-score tests
#           decide as the tensor-op scores do), memcheck and racecheck with =1, paths T/S/B
#   ncu     decide / cls_probs / gather kernel times, DeiT-S batch 1 and 8, EViT adaptive and ATS
#   e2e     bench, every pruner, ragged path, T/S/B, batch 1/8, f16, arms interleaved, twice
set -u
stages=${STAGES:-checks ncu e2e}
. scripts/gpu/lib.sh
unpack bench test-select_rule test-select_bounded test-paths_agreement
start_log split-scores.txt
ARMS=${ARMS:-0 default}
if has checks; then
  for a in 0 1; do
    for t in select_rule select_bounded; do
      echo "== test-$t (CANDLE_RAGGED_SPLIT_SCORES=$a)" >> "$C"
      CANDLE_RAGGED_SPLIT_SCORES=$a timeout 120 $B/test-$t --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
    done
  done
  echo "== memcheck / racecheck (CANDLE_RAGGED_SPLIT_SCORES=1)" >> "$C"
  CANDLE_RAGGED_SPLIT_SCORES=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-select_rule --test-threads=1 2>&1 | grep -E "ERROR SUMMARY" >> "$C"
  CANDLE_RAGGED_SPLIT_SCORES=1 timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-select_rule --test-threads=1 computed 2>&1 | grep -E "RACECHECK SUMMARY|test result" >> "$C"
  echo "== paths (cuda, T/S/B, batch 32)" >> "$C"
  PATHS_DEVICE=cuda PATHS_MODELS=deit-tiny,deit-small,deit-base PATHS_BATCH=32 timeout 200 $B/test-paths_agreement --ignored --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
fi
if has ncu; then
  for a in $ARMS; do
    echo "== ncu, CANDLE_RAGGED_SPLIT_SCORES=$a" >> "$C"
    CANDLE_RAGGED_SPLIT_SCORES=$a OUT=$out/ncu-$a RUNS="deit-small:1:evit-adaptive deit-small:1:ats-fixed deit-small:8:evit-adaptive" \
      bash scripts/gpu/ncu-decide.sh 2>&1 | grep -E "^==|decide|cls_probs|gather" >> "$C"
  done
fi
e2e_run() { CANDLE_RAGGED_SPLIT_SCORES=$1 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 1,8 --pruners none,threshold-l2,dynamicvit,evit,ats --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds e2e e2e_run
pack split-scores-json.tgz 'e2e-*.json'
cat "$C"
