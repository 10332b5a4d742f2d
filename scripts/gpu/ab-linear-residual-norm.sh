#!/usr/bin/env bash
# Lever 98 on the GPU machine, from the repo root: candle_fastpath::linear_residual_norm (the
# attention projection + the residual add + the LayerNorm after it as one cluster kernel at
# DeiT-S's width, one wave: batch 1) against cuBLASLt's GEMM with its residual epilogue + the LayerNorm kernel, one
# binary (CANDLE_FASTPATH_LINEAR_RESIDUAL_NORM=0 vs the default).
# Needs .gpu/{bench,test-norm_linear,test-paths_agreement}.xz.
# STAGES (default "checks anatomy ncu e2e"):
#   checks   test-norm_linear, memcheck of it, racecheck of the new kernel's test (quick cases),
#            paths at DeiT-S batch 1 (f32 / f16 / bf16, every pruner: padded against ragged, with
#            the kernel) and batch 8 (without it), DeiT-T batch 1 (unchanged), the one-image graphs
#   anatomy  bench --graph-anatomy, DeiT-S batch 1, f16, dense and the fixed pruners, both arms,
#            two rounds: kernel nodes per graph and replay event times
#   ncu      per-kernel times of a DeiT-S batch-1 dense forward (eager, the graph's kernels: the
#            one-kernel block off), warm caches, boost clocks, both arms
#   e2e      bench DeiT-S batch 1, f16 and bf16, dense and every pruner and mode, ragged path,
#            arms interleaved, two rounds; per-row 0 / default ratios
set -u
stages=${STAGES:-checks anatomy ncu e2e}
. scripts/gpu/lib.sh
unpack bench test-norm_linear test-paths_agreement
start_log linear-residual-norm.txt
ARMS=${ARMS:-0 default}
V=CANDLE_FASTPATH_LINEAR_RESIDUAL_NORM
if has checks; then
  tests_memcheck norm_linear
  # 28 hazard reports in lever 98's calls, all in nvjet_* (the reference steps).
  NORM_LINEAR_TEST_QUICK=1 racecheck_ours norm_linear linear_residual_norm fastpath_linear_residual_norm 400
  paths_check deit-small 1 300
  paths_check deit-small 8 300
  paths_check deit-tiny 1 200
  graphs_check 200
fi
if has anatomy; then
  for r in 1 2; do
    anatomy $V "$ARMS" --models deit-small --dtype f16 --batch 1 --pruners none,threshold-l2-fixed,evit-fixed,dynamicvit-fixed
  done
fi
if has ncu; then
  for a in $ARMS; do
    ncu_forward "$V=${a#default}" "deit-small batch 1 f16 dense, $V=${a#default} (eager forwards with the graph's kernels), warm, boost clocks" \
      --models deit-small --dtype f16 --batch 1 --pruners none
  done
fi
e2e_run() { env $V=${1#default} timeout 250 $B/bench --device cuda --models deit-small --dtype f16,bf16 --batch 1 \
  --pruners none,threshold-l2,dynamicvit,evit,ats --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds lrn e2e_run
pack lrn-json.tgz 'lrn-*.json'
cat "$C"
