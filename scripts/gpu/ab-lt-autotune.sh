#!/usr/bin/env bash
# Lever 79 on the GPU machine, from the repo root: FusedLinear's cuBLASLt plans timed over the
# heuristic's first eight picks (split-K ones left out) on their first eager call, the fastest
# kept, against the first pick (CANDLE_FASTPATH_LT_AUTOTUNE=0). One binary.
# Needs .gpu/{bench,test-linear,test-graph,test-paths_agreement}.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   test-linear (FusedLinear against plain steps), test-graph, paths at DeiT-S and DeiT-B
#            batch 32 and DeiT-B batch 1 (padded vs ragged, every pruner, three dtypes)
#   anatomy  bench --graph-anatomy, DeiT-S and DeiT-B batch 1, f16, dense and Threshold-L2 fixed,
#            both arms, two rounds
#   e2e      bench DeiT-T/S/B, batch 1/8/64/256, f16, dense, Threshold-L2 / EViT fixed, ragged
#            path, arms interleaved, two rounds; per-row 0 / default ratios
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-linear test-graph test-paths_agreement
start_log lt-autotune.txt
if has checks; then
  for arm in 0 default; do
    echo "== test-linear, CANDLE_FASTPATH_LT_AUTOTUNE=${arm#default}" >> "$C"
    CANDLE_FASTPATH_LT_AUTOTUNE=${arm#default} timeout 200 $B/test-linear --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  done
  echo "== test-graph" >> "$C"
  timeout 120 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  paths_check deit-small,deit-base 32 300
  paths_check deit-base 1 200
fi
if has anatomy; then
  for r in 1 2; do
    for arm in 0 default; do
      echo "== graph anatomy, CANDLE_FASTPATH_LT_AUTOTUNE=${arm#default}, round $r" >> "$C"
      CANDLE_FASTPATH_LT_AUTOTUNE=${arm#default} timeout 200 $B/bench --device cuda --models deit-small,deit-base --dtype f16 --batch 1 \
        --pruners none,threshold-l2-fixed --paths ragged --reps 100 --graph-anatomy --out /tmp/anat.json 2>&1 \
        | grep -E "^graph|rror" | grep -v "only:" >> "$C"
    done
  done
fi
e2e_run() { CANDLE_FASTPATH_LT_AUTOTUNE=${1#default} timeout 280 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 1,8,64,256 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$2"; }
ARMS="0 default"
has e2e && ab_rounds lt e2e_run
pack lt-json.tgz 'lt-*.json'
cat "$C"
