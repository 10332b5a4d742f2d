#!/usr/bin/env bash
# The selection kernels' checks on the GPU machine, from the repo root, with .gpu/ carried (bundle.sh):
# their GPU tests (select_rule with CANDLE_RAGGED_SPLIT_SCORES=0 and =1), memcheck and racecheck over
# them with the split scores, and full-size paths (T/S/B, batch 32). Summary in $OUT/selection-checks.txt.
set -u
. scripts/gpu/lib.sh
unpack
C=$out/selection-checks.txt
for t in attention graph pack sequence_mean select select_bounded; do echo "== test-$t" >> $C; timeout 120 $B/test-$t --test-threads=1 2>&1 | grep -E "test result|panicked" >> $C; done
for a in 0 1; do echo "== test-select_rule SPLIT=$a" >> $C; CANDLE_RAGGED_SPLIT_SCORES=$a timeout 120 $B/test-select_rule --test-threads=1 2>&1 | grep -E "test result|panicked" >> $C; done
for t in select_rule select_bounded pack select; do echo "== memcheck $t (SPLIT=1)" >> $C; CANDLE_RAGGED_SPLIT_SCORES=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-$t --test-threads=1 2>&1 | grep -E "ERROR SUMMARY" >> $C; done
for a in 1 0; do echo "== racecheck select_rule computed (SPLIT=$a)" >> $C; CANDLE_RAGGED_SPLIT_SCORES=$a timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-select_rule --test-threads=1 computed 2>&1 | grep -E "RACECHECK SUMMARY|test result" >> $C; done
echo "== racecheck select_rule every_rule_once, select_bounded (SPLIT=1)" >> $C
CANDLE_RAGGED_SPLIT_SCORES=1 timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-select_rule --test-threads=1 every_rule_once 2>&1 | grep -E "RACECHECK SUMMARY|test result" >> $C
CANDLE_RAGGED_SPLIT_SCORES=1 timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-select_bounded --test-threads=1 2>&1 | grep -E "RACECHECK SUMMARY|test result" >> $C
echo "== paths T/S/B batch 32" >> $C
PATHS_DEVICE=cuda PATHS_MODELS=deit-tiny,deit-small,deit-base PATHS_BATCH=32 timeout 200 $B/test-paths_agreement --ignored --test-threads=1 2>&1 | grep -E "test result|panicked" >> $C
cat $C
