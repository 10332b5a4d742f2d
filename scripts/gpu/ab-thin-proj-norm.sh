#!/usr/bin/env bash
# Lever 107 on the GPU machine, from the repo root: linear_residual_norm's TMA + wgmma cluster
# kernel (lever 103's, built for C = K = 768: eight 96-column tiles × two slices of K, clusters
# of 16) for DeiT-B's attention projection, its residual add and norm2 at batch 1, against the
# two steps (cuBLASLt's GEMM with its residual epilogue, then the LayerNorm kernel), one binary:
# CANDLE_FASTPATH_THIN_PROJ_NORM=0 (off) and the default (on). Not kept: the code is
# docs/benchmarks/history/lever107-thin-proj-norm-c768.patch, to apply before building.
# Needs .gpu/{bench,test-linear,test-norm_linear,test-paths_agreement}.xz.
# STAGES (default "checks anatomy ncu"; "e2e" separately):
#   checks   test-norm_linear (linear_residual_norm_matches_the_steps asserts where the kernel
#            runs: up to one wave of clusters) under memcheck, then with the switch off;
#            racecheck of that test; test-linear; paths at DeiT-B batch 1 (f32 / f16 / bf16,
#            every pruner) and batch 8 (without it); the one-image graphs at DeiT-B
#   anatomy  bench --graph-anatomy, DeiT-B batch 1, f16, dense and the fixed pruners, every arm,
#            two rounds: kernel nodes per graph and replay event times
#   ncu      per-kernel times of a DeiT-B batch-1 dense forward, every arm
#   e2e      bench DeiT-B batch 1, f16 and bf16, every pruner and mode, ragged path, arms
#            interleaved, two rounds; per-row ratios
set -u
stages=${STAGES:-checks anatomy ncu}
. scripts/gpu/lib.sh
unpack bench test-linear test-norm_linear test-paths_agreement
start_log thin-proj-norm.txt
ARMS=${ARMS:-0 default}
MODELS=${MODELS:-deit-base}
V=CANDLE_FASTPATH_THIN_PROJ_NORM
if has checks; then
  tests_memcheck norm_linear
  test_arms $V 0 norm_linear
  NORM_LINEAR_TEST_QUICK=1 racecheck_ours norm_linear linear_residual_norm_matches_the_steps fastpath_thin_residual_norm
  tests_memcheck linear
  paths_check deit-base 1 300
  paths_check deit-base 8 300
  GRAPHS_MODELS=deit-base graphs_check 200
fi
has anatomy && batch1_anatomy $V "$ARMS" "$MODELS"
has ncu && batch1_ncu $V "$ARMS" "$MODELS"
VAR=$V
has e2e && batch1_e2e thinpn
pack thinpn-json.tgz 'thinpn-*.json'
cat "$C"
