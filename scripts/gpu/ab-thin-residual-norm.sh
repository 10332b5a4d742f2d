#!/usr/bin/env bash
# Lever 103 on the GPU machine, from the repo root: linear_residual_norm's fc2 kernel (fc2, the
# residual add and the next block's norm1 as one launch of clusters over 64-row tiles, K split
# over each cluster: DeiT-S's fc2 → norm1 at batch 1) against the two steps (cuBLASLt's GEMM
# with its residual epilogue, then the LayerNorm kernel), one binary:
# CANDLE_FASTPATH_THIN_RESIDUAL_NORM=0 (off), =n64 (six 64-column tiles × two slices of K,
# clusters of 12) and the default (four 96-column tiles × four slices, clusters of 16).
# Needs .gpu/{bench,test-linear,test-norm_linear,test-paths_agreement}.xz.
# STAGES (default "checks anatomy ncu"; "e2e" separately):
#   checks   test-norm_linear (linear_residual_norm_matches_the_steps asserts where the kernel
#            runs: fc2 up to one wave of clusters) under memcheck, with each arm; racecheck of
#            that test; test-linear; paths at DeiT-S batch 1 (f32 / f16 / bf16, every pruner) and
#            batch 8 (without it); the one-image graphs at DeiT-T (unchanged) and DeiT-S (captured)
#   anatomy  bench --graph-anatomy, DeiT-S batch 1, f16, dense and the fixed pruners, every arm,
#            two rounds: kernel nodes per graph and replay event times
#   ncu      per-kernel times of a DeiT-S batch-1 dense forward, every arm
#   e2e      bench DeiT-S batch 1, f16 and bf16, every pruner and mode, ragged path, arms
#            interleaved, two rounds; per-row ratios
set -u
stages=${STAGES:-checks anatomy ncu}
. scripts/gpu/lib.sh
unpack bench test-linear test-norm_linear test-paths_agreement
start_log thin-residual-norm.txt
ARMS=${ARMS:-0 n64 default}
MODELS=${MODELS:-deit-small}
E2E_ARMS=${E2E_ARMS:-0 default}
V=CANDLE_FASTPATH_THIN_RESIDUAL_NORM
if has checks; then
  tests_memcheck norm_linear
  echo "== arm n64 (the next test-norm_linear run)" >> "$C"
  CANDLE_FASTPATH_THIN_RESIDUAL_NORM=n64 tests_memcheck norm_linear
  NORM_LINEAR_TEST_QUICK=1 racecheck_ours norm_linear linear_residual_norm_matches_the_steps fastpath_thin_residual_norm
  tests_memcheck linear
  batch1_paths_graphs
fi
has anatomy && batch1_anatomy $V "$ARMS" "$MODELS"
has ncu && batch1_ncu $V "$ARMS" "$MODELS"
VAR=$V
has e2e && ARMS="$E2E_ARMS" batch1_e2e thinrn
pack thinrn-json.tgz 'thinrn-*.json'
cat "$C"
