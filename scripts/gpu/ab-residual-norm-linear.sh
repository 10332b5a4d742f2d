#!/usr/bin/env bash
# Levers 61 and 62 on the GPU machine, from the repo root: candle_fastpath::residual_norm_linear
# (the attention's proj + residual, norm2, fc1 and GELU as one clustered kernel; fc2 + residual,
# the next block's norm1 and qkv as another; C = 192, grids of one wave) against cuBLASLt's proj /
# fc2 followed by lever 58's norm_linear, one binary, arms ARMS (default "0 default":
# CANDLE_FASTPATH_RESIDUAL_NORM_LINEAR=0 vs the default; lever 62's A/B: ARMS="proj default").
# Needs .gpu/{bench,test-norm_linear,test-graph,test-paths_agreement}.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   test-norm_linear (default rule, and CANDLE_FASTPATH_NORM_LINEAR=always: the fused
#            kernels at every row count, several waves), memcheck of the new tests, racecheck of
#            the new test's quick form (NORM_LINEAR_TEST_QUICK: f16, fc1, 17 and 197 rows),
#            test-graph, paths at DeiT-T batch 1 and 8 (default) and 32 (`always`), DeiT-T
#            distilled batch 1, DeiT-S batch 1 (unchanged: C = 384)
#   anatomy  bench --graph-anatomy, DeiT-T batch 1, f16, dense and Threshold-L2 fixed, both arms
#   e2e      bench DeiT-T, batch 1/8, f16 and bf16, dense, Threshold-L2 / EViT fixed, Threshold-L2
#            adaptive, ragged path, arms interleaved, two rounds; per-row 0 / default ratios
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-norm_linear test-graph test-paths_agreement
start_log residual-norm-linear.txt
if has checks; then
  for mode in "" always; do
    echo "== test-norm_linear (CANDLE_FASTPATH_NORM_LINEAR='$mode')" >> "$C"
    CANDLE_FASTPATH_NORM_LINEAR=$mode timeout 200 $B/test-norm_linear --test-threads=1 2>&1 | grep -E "test result|panicked|element" | head -5 >> "$C"
  done
  echo "== memcheck / racecheck test-norm_linear residual_norm_linear" >> "$C"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-norm_linear --test-threads=1 residual 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  NORM_LINEAR_TEST_QUICK=1 timeout 240 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-norm_linear --test-threads=1 residual_norm_linear_matches 2>&1 | grep -E "RACECHECK SUMMARY|test result" >> "$C"
  echo "racecheck rc=$?" >> "$C"
  echo "== test-graph" >> "$C"
  timeout 120 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "(paths: DeiT-T batch 1, 8, then 32 with CANDLE_FASTPATH_NORM_LINEAR=always; DeiT-T distilled and DeiT-S batch 1)" >> "$C"
  paths_check deit-tiny 1 200
  paths_check deit-tiny 8 200
  export CANDLE_FASTPATH_NORM_LINEAR=always
  paths_check deit-tiny 32 300
  unset CANDLE_FASTPATH_NORM_LINEAR
  paths_check deit-tiny-distilled 1 200
  paths_check deit-small 1 200
fi
ARMS=${ARMS:-0 default}
if has anatomy; then
  for a in $ARMS; do
    echo "== graph anatomy, CANDLE_FASTPATH_RESIDUAL_NORM_LINEAR=$a" >> "$C"
    CANDLE_FASTPATH_RESIDUAL_NORM_LINEAR=${a#default} timeout 200 $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 \
      --pruners none,threshold-l2-fixed --paths ragged --reps 100 \
      --graph-anatomy --out /tmp/anat.json 2>&1 | grep -E "^graph|rror" | grep -v "only:" >> "$C"
  done
fi
e2e_run() { CANDLE_FASTPATH_RESIDUAL_NORM_LINEAR=${1#default} timeout 280 $B/bench --device cuda --models deit-tiny --dtype f16,bf16 --batch 1,8 --pruners none,threshold-l2-fixed,evit-fixed,threshold-l2-adaptive --paths ragged --reps 20 --out "$2"; }
has e2e && ab_rounds rnl e2e_run
pack rnl-json.tgz 'rnl-*.json'
cat "$C"
