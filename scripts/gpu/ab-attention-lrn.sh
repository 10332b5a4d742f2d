#!/usr/bin/env bash
# Lever 119 on the GPU machine, from the repo root: candle_fastpath::attention_linear_residual_norm
# (the attention folded into lever 98's projection + residual + norm2 cluster kernel at DeiT-S's
# width, one sequence: batch 1) against candle-ragged's attention kernel followed by lever 98's
# kernel, one binary: CANDLE_FASTPATH_ATTENTION_LRN=0 (off) and the default.
# Needs .gpu/{bench,test-attention_lrn,test-attention_norm_linear,test-paths_agreement}.xz.
# STAGES (default "checks anatomy ncu"; "e2e" separately):
#   checks   test-attention_lrn under memcheck, racecheck of its matching test (quick cases),
#            test-attention_norm_linear (DeiT-T's kernels share the attention's helpers now);
#            paths at DeiT-S batch 1 (f32 / f16 / bf16, every pruner) and batch 8 (without it);
#            the one-image graphs at DeiT-T and DeiT-S
#   anatomy  bench --graph-anatomy, DeiT-S batch 1 (MODELS), f16, dense and the fixed pruners,
#            both arms, two rounds: kernel nodes per graph and replay event times
#   ncu      per-kernel times of a DeiT-S batch-1 dense forward, both arms
#   e2e      bench DeiT-S batch 1, f16 and bf16, every pruner and mode, ragged path, arms
#            interleaved, two rounds; per-row ratios
set -u
stages=${STAGES:-checks anatomy ncu}
. scripts/gpu/lib.sh
unpack bench test-attention_lrn test-attention_norm_linear test-paths_agreement
start_log attention-lrn.txt
ARMS=${ARMS:-0 default}
MODELS=${MODELS:-deit-small}
V=CANDLE_FASTPATH_ATTENTION_LRN
if has checks; then
  tests_memcheck attention_lrn
  ATTENTION_RNL_TEST_QUICK=1 racecheck_ours attention_lrn matches fastpath_attention_linear
  tests_results 200 attention_norm_linear
  batch1_paths_graphs
fi
has anatomy && batch1_anatomy $V "$ARMS" "$MODELS"
has ncu && batch1_ncu $V "$ARMS" "$MODELS"
VAR=$V
has e2e && batch1_e2e alrn
pack alrn-json.tgz 'alrn-*.json'
cat "$C"
