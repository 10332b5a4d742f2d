#!/usr/bin/env bash
# Lever 100 on the GPU machine, from the repo root: FusedLinear's thin GEMM (x·Wᵀ + b, then the
# exact GELU, in one wave of 64 × 64 tiles over the whole K = 384, TMA + wgmma: DeiT-S's fc1 and qkv at batch 1)
# against cuBLASLt's GEMM (+ the GELU pass), one binary: CANDLE_FASTPATH_THIN_GEMM=0 (off),
# =gelu (fc1 + GELU only) and the default (fc1 + GELU and the plain qkv).
# Needs .gpu/{bench,test-linear,test-norm_linear,test-paths_agreement}.xz.
# STAGES (default "checks anatomy ncu"; "e2e" separately, it takes ~4 min):
#   checks   test-linear (the thin kernel's own test asserts where it runs) and test-norm_linear
#            (residual_norm_linear at C = 384: lever 98's kernel, then fc1 + GELU here), both under
#            memcheck; racecheck of the thin kernel's test; paths at DeiT-S batch 1 (f32 / f16 /
#            bf16, every pruner: padded against ragged, both through the kernel) and batch 8
#            (without it), the one-image graphs (DeiT-T: unchanged; DeiT-S: the kernel captured)
#   anatomy  bench --graph-anatomy, DeiT-S batch 1, f16, dense and the fixed pruners, every arm,
#            two rounds: kernel nodes per graph and replay event times
#   ncu      per-kernel times of a DeiT-S batch-1 dense forward (eager, the graph's kernels: the
#            one-kernel block off), warm caches, boost clocks, every arm
#   e2e      bench DeiT-S batch 1, f16 and bf16, dense and every pruner and mode, ragged path,
#            arms interleaved, two rounds; per-row 0 / arm ratios
set -u
stages=${STAGES:-checks anatomy ncu}
. scripts/gpu/lib.sh
unpack bench test-linear test-norm_linear test-paths_agreement
start_log thin-gemm.txt
ARMS=${ARMS:-0 gelu default}
# The models of the anatomy, ncu and e2e stages (lever 100: deit-small; lever 101 ran deit-base
# with the K = 768 kernel of its patch).
MODELS=${MODELS:-deit-small}
# e2e: fewer arms unless asked (STAGES=e2e E2E_ARMS=...)
E2E_ARMS=${E2E_ARMS:-0 default}
V=CANDLE_FASTPATH_THIN_GEMM
if has checks; then
  tests_memcheck linear norm_linear
  racecheck_ours linear thin_gemm fastpath_thin_gemm
  batch1_paths_graphs
fi
has anatomy && batch1_anatomy $V "$ARMS" "$MODELS"
has ncu && batch1_ncu $V "$ARMS" "$MODELS"
VAR=$V
has e2e && ARMS="$E2E_ARMS" batch1_e2e thin
pack thin-json.tgz 'thin-*.json'
cat "$C"
