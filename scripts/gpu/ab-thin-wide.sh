#!/usr/bin/env bash
# Lever 130 on the GPU machine, from the repo root: the thin GEMM at K = 768 (DeiT-B's batch-1
# qkv and fc1 + GELU, and every model's batch-1 patch embedding; 64 × 128 tiles, two warpgroups,
# eight slots of K) against cuBLASLt (and the GELU pass); one binary:
# CANDLE_FASTPATH_THIN_GEMM_WIDE=0 and the default. SWITCH=CANDLE_FASTPATH_THIN_WIDE_MULTICAST
# runs lever 131's A/B the same way (that kernel in clusters of four row tiles with W's tiles
# multicast, against lever 130's unclustered form; not kept: the switch exists only with
# docs/benchmarks/history/lever131-thin-wide-multicast.patch applied), and
# SWITCH=CANDLE_FASTPATH_THIN_WIDE_N96 lever 132's (64 × 96 tiles for one warpgroup; not kept
# either: docs/benchmarks/history/lever132-thin-wide-n96.patch), and
# SWITCH=CANDLE_FASTPATH_THIN_SPLIT lever 133's (DeiT-B's batch-1 attention projection and fc2,
# residual epilogue, on the thin GEMM with K split four ways over a cluster, against cuBLASLt's
# GEMM with its residual epilogue; not kept either: the switch, with `fc2` for K = 3072 alone,
# exists only with docs/benchmarks/history/lever133-thin-split-residual.patch applied), and
# SWITCH=CANDLE_FASTPATH_THIN_NORM lever 134's (DeiT-B's batch-1 norm1 → qkv, norm2 → fc1 + GELU
# and final norm → head with the LayerNorm inside the K = 768 thin GEMM, against the LayerNorm
# kernel and then that GEMM; not kept: the switch exists only with
# docs/benchmarks/history/lever134-thin-norm-gemm.patch applied, whose test-norm_linear checks it).
# The LayerNorm kernel lets a kernel with a programmatic edge from it start early (lever 130: the
# thin GEMM after norm1 / norm2 then asks for its weights during the LayerNorm); that part has no
# switch (with the switch at 0 no such edge exists at DeiT-B).
# Needs .gpu/test-linear.xz (or test-programmatic.xz, test-norm_linear.xz) for checks, .gpu/test-paths_agreement.xz
# for graphs, .gpu/bench.xz for e2e, b8, anatomy and ncu.
# STAGES (default "checks"; run in the order checks, graphs, e2e, b8, anatomy, ncu):
#   checks   test-linear, then test-norm_linear, each in both arms, then under memcheck
#            (default arm); test-programmatic in both arms (whichever the bundle has)
#   graphs   the one-image graphs at DeiT-T, DeiT-S and DeiT-B, paths at DeiT-B batch 1 (default arm)
#   e2e      bench at batch 1, DTYPES (default f16), every pruner and mode, ragged path, MODELS
#            (default deit-tiny,deit-small,deit-base), arms interleaved, two rounds; per-row ratios
#   b8       the same at batch 8, DeiT-T and DeiT-S, dense and the fixed pruners (their patch
#            embeddings take the kernel there too)
#   anatomy  bench --graph-anatomy at batch 1, f16, MODELS, dense and the fixed pruners, both
#            arms, two rounds
#   ncu      per-kernel times of an eager DeiT-B batch-1 f16 forward with the graph's kernels, both arms
set -u
stages=${STAGES:-checks}
. scripts/gpu/lib.sh
unpack
start_log thin-wide.txt
ARMS=${ARMS:-0 default}
MODELS=${MODELS:-deit-tiny,deit-small,deit-base}
V=${SWITCH:-CANDLE_FASTPATH_THIN_GEMM_WIDE}
if has checks; then
  for t in linear norm_linear; do
    if [ -f "$B/test-$t" ]; then
      test_arms $V "$ARMS" $t
      tests_memcheck $t
    fi
  done
  [ -f "$B/test-programmatic" ] && test_arms $V "$ARMS" programmatic
fi
if has graphs; then
  graphs_check 200
  GRAPHS_MODELS=deit-small graphs_check 200
  GRAPHS_MODELS=deit-base graphs_check 300
  paths_check deit-base 1 300
fi
VAR=$V
DTYPES=${DTYPES:-f16}
has e2e && batch1_e2e thin-wide
b8_run() {
  env "$V=${1#default}" timeout 250 "$B/bench" --device cuda --models deit-tiny,deit-small --dtype f16 --batch 8 \
    --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$2"
}
has b8 && ab_rounds thin-wide-b8 b8_run
has anatomy && batch1_anatomy $V "$ARMS" "$MODELS"
has ncu && batch1_ncu $V "$ARMS" deit-base
pack thin-wide-json.tgz 'thin-wide-*.json'
cat "$C"
