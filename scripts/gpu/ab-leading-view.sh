#!/usr/bin/env bash
# Lever 116 was NOT kept: the code is docs/benchmarks/history/lever116-leading-view.patch.
# Lever 116 on the GPU machine, from the repo root: candle_ragged::leading_rows as a view of the
# packed tensor's first rows for a batch of one (the class rows a classifier's last block and head
# read: two `ragged_unpack` launches a batch-1 pruned forward before), against the kernel
# (`CANDLE_RAGGED_LEADING_VIEW=0`). One binary. Needs .gpu/{bench,test-pack,test-paths_agreement}.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   test-pack and its memcheck; the one-image graphs against the padded path (DeiT-T, and
#            DeiT-S); paths at DeiT-S batch 1
#   anatomy  graph replay events per arm, batch 1, T / S / B, f16, dense and the fixed pruners,
#            two rounds
#   e2e      bench T / S / B, batch 1, f16 and bf16, dense and the fixed pruners, ragged path,
#            arms interleaved, two rounds; per-row ratios
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-pack test-paths_agreement
start_log leading-view.txt
ARMS=${ARMS:-0 default}
V=CANDLE_RAGGED_LEADING_VIEW
if has checks; then
  tests_memcheck pack
  graphs_check 200
  GRAPHS_MODELS=deit-small graphs_check 200
  paths_check deit-small 1 300
fi
if has anatomy; then
  for r in 1 2; do
    anatomy "$V" "$ARMS" --models deit-tiny,deit-small,deit-base --dtype f16 --batch 1 --pruners none,threshold-l2-fixed,evit-fixed,dynamicvit-fixed
  done
fi
e2e_run() { env "$V=${1#default}" timeout 280 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16,bf16 \
  --batch 1 --pruners none,threshold-l2-fixed,evit-fixed,dynamicvit-fixed --paths ragged --reps 20 --out "$2"; }
has e2e && ab_rounds e2e e2e_run
pack leading-view-json.tgz 'e2e-*.json'
cat "$C"
