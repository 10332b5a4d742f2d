#!/usr/bin/env bash
# Lever 53 on the GPU machine: each LayerNorm requesting the weights of the two GEMMs after it
# into L2 (bulk prefetches issued by the kernel's first warps) against none, one binary
# (CANDLE_FASTPATH_L2_PREFETCH=0 vs 1 (bulk prefetches) vs 2 (one prefetch per 128-byte line):
# ARMS="0 1 2"). Not kept: the code is docs/benchmarks/history/lever53-l2-prefetch.patch, to apply
# before building. Needs .gpu/{bench,test-norm,test-paths_agreement}.xz; repo root.
# STAGES (default "checks ab ncu"):
#   checks  test-norm with the switch off and on, memcheck of test-norm, paths at DeiT-S (batch 32)
#           and DeiT-B (batch 8)
#   ab      bench T/S/B, batch AB_BATCH (default 1,8), f16, PRUNERS (default dense, Threshold-L2
#           and EViT fixed), ragged path, arms interleaved, twice; per-row 0/1 ratios
#   ncu     per-kernel times of a DeiT-B and a DeiT-S dense forward at batch 1, warm caches and
#           boost clocks (as a replay runs them), off vs on
set -u
stages=${STAGES:-checks ab ncu}
. scripts/gpu/lib.sh
unpack bench test-norm test-paths_agreement
start_log l2-prefetch.txt
if has checks; then
  for a in 0 1; do
    echo "== test-norm (CANDLE_FASTPATH_L2_PREFETCH=$a)" >> "$C"
    CANDLE_FASTPATH_L2_PREFETCH=$a $B/test-norm --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  done
  echo "== memcheck test-norm" >> "$C"
  compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-norm --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  paths_check deit-small 32 200
  paths_check deit-base 8 200
fi
pf_run() { CANDLE_FASTPATH_L2_PREFETCH=$1 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch "${AB_BATCH:-1,8}" --pruners "${PRUNERS:-none,threshold-l2-fixed,evit-fixed}" --paths ragged --reps 10 --out "$2"; }
ARMS=${ARMS:-0 1}
has ab && ab_rounds pf pf_run
if has ncu; then
  for a in $ARMS; do
    for m in deit-base deit-small; do
      ncu_forward "CANDLE_FASTPATH_L2_PREFETCH=$a" "CANDLE_FASTPATH_L2_PREFETCH=$a $m dense batch 1 f16, warm, boost clocks" \
        --models $m --dtype f16 --batch 1 --pruners none
    done
  done
fi
pack pf-json.tgz 'pf-*.json'
cat "$C"
