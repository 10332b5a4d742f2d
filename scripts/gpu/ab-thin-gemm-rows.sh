#!/usr/bin/env bash
# Lever 108 on the GPU machine, from the repo root: the thin GEMM (lever 100: qkv and fc1 + GELU
# at DeiT-S's K = 384, 64 × 64 tiles, TMA + wgmma) past one wave of CTAs, at batch 8 and 64, in
# place of cuBLASLt's GEMM (and, for fc1, the GELU pass after it), one binary. Arms:
#   default  the rule: one wave at most (batch-1 row counts)
#   r2048    CANDLE_FASTPATH_THIN_GEMM_ROWS=2048: up to 2,048 rows (DeiT-S at batch 8)
#   r2048g   the same for fc1 + GELU only (CANDLE_FASTPATH_THIN_GEMM=gelu)
#   r16384   up to 16,384 rows (batch 64 too)
# Not kept: the code is docs/benchmarks/history/lever108-thin-gemm-rows.patch, to apply before
# building. Needs .gpu/{bench,test-linear,test-paths_agreement}.xz.
# STAGES (default "checks anatomy ncu e2e"):
#   checks   test-linear under r16384 (its values; its where-the-kernel-runs assertions expect
#            the rule) and paths at DeiT-S batch 8 under r2048
#   anatomy  bench --graph-anatomy, DeiT-S batch 8 and 64, f16, dense and the fixed pruners,
#            every arm, two rounds
#   ncu      per-kernel times of a DeiT-S batch-8 dense forward, default and r2048
#   e2e      bench DeiT-S batch 8 / 64, f16, dense and the fixed pruners, ragged path, arms
#            interleaved, two rounds; per-row ratios
set -u
stages=${STAGES:-checks anatomy ncu e2e}
. scripts/gpu/lib.sh
unpack bench test-linear test-paths_agreement
start_log thin-gemm-rows.txt
ARMS=${ARMS:-default r2048 r2048g r16384}
# envs ARM: the arm's assignments.
envs() { case $1 in
  default) echo "CANDLE_FASTPATH_THIN_GEMM_ROWS=0" ;;
  r2048) echo "CANDLE_FASTPATH_THIN_GEMM_ROWS=2048" ;;
  r2048g) echo "CANDLE_FASTPATH_THIN_GEMM_ROWS=2048 CANDLE_FASTPATH_THIN_GEMM=gelu" ;;
  r16384) echo "CANDLE_FASTPATH_THIN_GEMM_ROWS=16384" ;;
esac; }
if has checks; then
  echo "== test-linear, $(envs r16384)" >> "$C"
  # shellcheck disable=SC2046  # assignments split into words
  env $(envs r16384) timeout 300 $B/test-linear --test-threads=1 2>&1 | grep -E "test result|panicked|got" | head -8 >> "$C"
  export CANDLE_FASTPATH_THIN_GEMM_ROWS=2048
  paths_check deit-small 8 300
  unset CANDLE_FASTPATH_THIN_GEMM_ROWS
fi
if has anatomy; then
  for r in 1 2; do for a in $ARMS; do
    echo "== graph anatomy, $(envs $a)" >> "$C"
    # shellcheck disable=SC2046
    env $(envs $a) timeout 250 $B/bench --device cuda --models deit-small --dtype f16 --batch 8,64 \
      --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 50 --graph-anatomy --out /tmp/anat.json 2>&1 \
      | grep -E "^graph|rror" | grep -v "only:" | sed -E 's/ [0-9]+ mem-alloc.*replay:/ replay:/' >> "$C"
  done; done
fi
if has ncu; then
  for a in default r2048; do
    ncu_forward "$(envs $a)" "deit-small batch 8 f16 dense, $(envs $a) (eager forwards with the graph's kernels), warm, boost clocks" \
      --models deit-small --dtype f16 --batch 8 --pruners none
  done
fi
# shellcheck disable=SC2046
e2e_run() { env $(envs $1) timeout 250 "$B/bench" --device cuda --models deit-small --dtype f16 --batch 8,64 \
  --pruners none,threshold-l2-fixed,evit-fixed,ats-fixed --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds e2e e2e_run
pack thin-gemm-rows-json.tgz 'e2e-*.json'
cat "$C"
