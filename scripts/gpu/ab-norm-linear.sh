#!/usr/bin/env bash
# Lever 58 on the GPU machine, from the repo root: candle_fastpath::norm_linear (norm1 + qkv,
# norm2 + fc1 + GELU, and the final norm + head as one kernel each, C = 192, grids of one wave)
# against the LayerNorm kernel + cuBLASLt (+ the GELU kernel), one binary
# (CANDLE_FASTPATH_NORM_LINEAR=0 vs the default).
# Needs .gpu/{bench,test-norm_linear,test-graph,test-paths_agreement}.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   test-norm_linear (default rule, and `always`), memcheck and racecheck of it, test-graph,
#            paths at DeiT-T batch 1 and 8 (default) and batch 32 (`always`: the fused kernel on
#            every block, several waves), DeiT-S batch 1 (unchanged: C = 384), DeiT-T distilled
#            batch 1 (two heads)
#   anatomy  bench --graph-anatomy, DeiT-T batch 1, f16, dense and Threshold-L2 fixed, both arms:
#            kernel nodes per graph and replay event times
#   e2e      bench T/S, batch 1/8, f16 and bf16, dense, Threshold-L2 / EViT fixed, Threshold-L2
#            adaptive, ragged path, arms interleaved, two rounds; per-row 0 / default ratios; then
#            DeiT-T at batch 64/256, f16, dense and Threshold-L2 fixed (only the head is fused
#            there: its grid fits one wave up to 256 rows), the same way
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-norm_linear test-graph test-paths_agreement
start_log norm-linear.txt
if has checks; then
  for mode in "" always; do
    echo "== test-norm_linear (CANDLE_FASTPATH_NORM_LINEAR='$mode')" >> "$C"
    CANDLE_FASTPATH_NORM_LINEAR=$mode timeout 200 $B/test-norm_linear --test-threads=1 2>&1 | grep -E "test result|panicked|element" | head -5 >> "$C"
  done
  echo "== memcheck / racecheck test-norm_linear" >> "$C"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-norm_linear --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-norm_linear --test-threads=1 matches 2>&1 | grep -E "RACECHECK SUMMARY|test result" >> "$C"
  echo "== test-graph" >> "$C"
  timeout 120 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "(paths: batch 1, 8, then 32 with CANDLE_FASTPATH_NORM_LINEAR=always; then DeiT-S batch 1)" >> "$C"
  paths_check deit-tiny 1 200
  paths_check deit-tiny 8 200
  export CANDLE_FASTPATH_NORM_LINEAR=always
  paths_check deit-tiny 32 300
  unset CANDLE_FASTPATH_NORM_LINEAR
  paths_check deit-small 1 200
  paths_check deit-tiny-distilled 1 200
fi
if has anatomy; then
  for a in 0 default; do
    echo "== graph anatomy, CANDLE_FASTPATH_NORM_LINEAR=$a" >> "$C"
    CANDLE_FASTPATH_NORM_LINEAR=${a#default} timeout 200 $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 \
      --pruners none,threshold-l2-fixed --paths ragged --reps 100 \
      --graph-anatomy --out /tmp/anat.json 2>&1 | grep -E "^graph|rror" | grep -v "only:" >> "$C"
  done
fi
e2e_run() { CANDLE_FASTPATH_NORM_LINEAR=${1#default} timeout 280 $B/bench --device cuda --models deit-tiny,deit-small --dtype f16,bf16 --batch 1,8 --pruners none,threshold-l2-fixed,evit-fixed,threshold-l2-adaptive --paths ragged --reps 20 --out "$2"; }
ARMS="0 default"
has e2e && ab_rounds nl e2e_run
big_run() { CANDLE_FASTPATH_NORM_LINEAR=${1#default} timeout 280 $B/bench --device cuda --models deit-tiny --dtype f16 --batch 64,256 --pruners none,threshold-l2-fixed --paths ragged --reps 20 --out "$2"; }
has e2e && ab_rounds big big_run
pack nl-json.tgz 'nl-*.json' 'big-*.json'
cat "$C"
