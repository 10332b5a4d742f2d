#!/usr/bin/env bash
# Lever 81 on the GPU machine, from the repo root: norm_linear's 64-row tiles (LayerNorm → GEMM
# (→ GELU) as one kernel for a few thousand rows: DeiT-T at batch 8) against the rule before it
# (CANDLE_FASTPATH_NORM_LINEAR=narrow: 16-row tiles within one wave only, else the LayerNorm
# kernel and cuBLASLt). One binary.
# Needs .gpu/{bench,test-norm_linear,test-paths_agreement}.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   test-norm_linear (the kernel against the two steps; 1,100 and 1,576 rows take the
#            64-row tiles) and under compute-sanitizer memcheck and racecheck, paths at DeiT-T
#            batch 8 and 16 (padded vs ragged, every pruner, three dtypes), the one-image graphs
#   ncu      per-kernel times of DeiT-T batch-8 forwards (eager, dense and DynamicViT fixed), both arms
#   anatomy  bench --graph-anatomy, DeiT-T batch 8, f16, dense and the fixed pruners, both arms
#   e2e      bench DeiT-T, batch 8 and 16, f16 and bf16, dense and every pruner and mode, ragged
#            path, arms interleaved, two rounds; per-row narrow / default ratios
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-norm_linear test-paths_agreement
start_log norm-linear-wide.txt
PRUNERS_ALL=none,threshold-l2-fixed,threshold-l2-adaptive,dynamicvit-fixed,dynamicvit-adaptive,evit-fixed,evit-adaptive,ats-fixed,ats-adaptive
if has checks; then
  echo "== test-norm_linear" >> "$C"
  timeout 200 $B/test-norm_linear --test-threads=1 2>&1 | grep -E "test result|panicked|rror" >> "$C"
  sanitize norm_linear matches_the_two_steps
  paths_check deit-tiny 8 300
  paths_check deit-tiny 16 300
  graphs_check 200
fi
has anatomy && anatomy CANDLE_FASTPATH_NORM_LINEAR "narrow default" --models deit-tiny --dtype f16 --batch 8 \
  --pruners none,threshold-l2-fixed,dynamicvit-fixed,evit-fixed
if has ncu; then
  for arm in narrow default; do
    CANDLE_FASTPATH_NORM_LINEAR=${arm#default} ncu --metrics gpu__time_duration.sum --csv --print-units base $B/bench --device cuda --models deit-tiny --dtype f16 --batch 8 \
      --pruners none,dynamicvit-fixed --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
    python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "deit-tiny batch 8 f16 dense + dynamicvit-fixed, CANDLE_FASTPATH_NORM_LINEAR=${arm#default}" | head -30 >> "$C"
  done
fi
e2e_run() { CANDLE_FASTPATH_NORM_LINEAR=${1#default} timeout 200 $B/bench --device cuda --models deit-tiny --dtype f16,bf16 --batch 8,16 --pruners $PRUNERS_ALL --paths ragged --reps 10 --out "$2"; }
ARMS=${ARMS:-narrow default}
has e2e && ab_rounds nlw e2e_run
pack nlw-json.tgz 'nlw-*.json'
cat "$C"
