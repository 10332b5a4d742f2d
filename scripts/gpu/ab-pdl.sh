#!/usr/bin/env bash
# Lever 124 on the GPU machine, from the repo root: programmatic edges into the DeiT-S batch-1
# kernels (thin GEMM, attention_linear_residual_norm, the fc2 cluster kernel) inside CUDA graphs,
# each asking for its weights before griddepcontrol.wait, against ordinary edges; one binary:
# CANDLE_FASTPATH_PDL=0 and the default.
# Needs .gpu/{bench,test-programmatic}.xz (checks also take test-linear, test-attention_lrn,
# test-attention_norm_linear, test-graph and test-paths_agreement where the bundle has them).
# STAGES (default "checks anatomy e2e"; run in the order checks, e2e, anatomy):
#   checks   test-programmatic in both arms and with CANDLE_FASTPATH_PDL=debug (refused edges
#            reported), then under memcheck and (unless RACECHECK=0) racecheck; the kernels' own
#            tests where the bundle has them; the one-image graphs at DeiT-T and DeiT-S; paths at
#            batch 1 (MODELS)
#   anatomy  bench --graph-anatomy at batch 1, f16, DeiT-T / DeiT-S (MODELS), dense and the fixed
#            pruners, both arms, two rounds (programmatic edges counted)
#   e2e      bench at batch 1, DTYPES (default f16,bf16), every pruner and mode, ragged path
#            (MODELS), arms interleaved, two rounds; per-row ratios
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack
start_log pdl.txt
ARMS=${ARMS:-0 default}
MODELS=${MODELS:-deit-tiny,deit-small}
V=CANDLE_FASTPATH_PDL
if has checks; then
  test_arms $V "$ARMS debug" programmatic
  tests_memcheck programmatic
  [ "${RACECHECK:-1}" = 1 ] && sanitize programmatic
  tests_results 300 linear attention_lrn attention_norm_linear graph
  [ -f "$B/test-paths_agreement" ] && { graphs_check 200; GRAPHS_MODELS=deit-small graphs_check 200; paths_check "$MODELS" 1 300; }
fi
VAR=$V
has e2e && batch1_e2e pdl
has anatomy && batch1_anatomy $V "$ARMS" "$MODELS"
pack pdl-json.tgz 'pdl-*.json'
cat "$C"
