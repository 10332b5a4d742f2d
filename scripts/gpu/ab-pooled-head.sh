#!/usr/bin/env bash
# Lever 80 on the GPU machine, from the repo root: DynamicViT's score head (out_conv and its
# log-softmax over packed rows) as PooledMlpHead's two kernels, against the eight composed ops
# (CANDLE_FASTPATH_POOLED_HEAD=0). One binary.
# Needs .gpu/{bench,test-pooled_head,test-paths_agreement}.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   test-pooled_head (the kernels against an f64 reference and the composed ops) and
#            under compute-sanitizer memcheck and racecheck, paths at DeiT-T/S batch 8, DeiT-B batch 32 and
#            DeiT-T batch 1 (padded vs ragged, every pruner, three dtypes), the one-image graphs
#   ncu      per-kernel times of DeiT-T batch-8 DynamicViT fixed forwards (eager), both arms
#   anatomy  bench --graph-anatomy, DeiT-T batch 1 and 8, f16, dense and DynamicViT, both arms
#   e2e      bench DeiT-T/S/B, batch 1/8/64, f16 and bf16, dense and DynamicViT fixed /
#            adaptive, ragged path, arms interleaved, two rounds; per-row 0 / default ratios
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-pooled_head test-paths_agreement
start_log pooled-head.txt
if has checks; then
  echo "== test-pooled_head" >> "$C"
  timeout 200 $B/test-pooled_head --test-threads=1 --nocapture 2>&1 | grep -E "test result|panicked|worst|rror" >> "$C"
  sanitize pooled_head
  paths_check deit-tiny,deit-small 8 300
  paths_check deit-base 32 300
  paths_check deit-tiny 1 200
  graphs_check 200
fi
has anatomy && anatomy CANDLE_FASTPATH_POOLED_HEAD "0 default" --models deit-tiny --dtype f16 --batch 1,8 \
  --pruners none,dynamicvit-fixed,dynamicvit-adaptive
if has ncu; then
  for arm in 0 default; do
    CANDLE_FASTPATH_POOLED_HEAD=${arm#default} ncu --metrics gpu__time_duration.sum --csv --print-units base $B/bench --device cuda --models deit-tiny --dtype f16 --batch 8 \
      --pruners dynamicvit-fixed --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
    python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "deit-tiny batch 8 f16 dynamicvit-fixed, CANDLE_FASTPATH_POOLED_HEAD=${arm#default}" | head -40 >> "$C"
  done
fi
e2e_run() { CANDLE_FASTPATH_POOLED_HEAD=${1#default} timeout 280 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16,bf16 --batch 1,8,64 --pruners none,dynamicvit-fixed,dynamicvit-adaptive --paths ragged --reps 10 --out "$2"; }
ARMS="0 default"
has e2e && ab_rounds ph e2e_run
pack ph-json.tgz 'ph-*.json'
cat "$C"
