#!/usr/bin/env bash
# Lever 63 on the GPU machine, from the repo root: the last block's projection, residuals and MLP
# over the prefix rows only (Block::forward_prefix; dense forward and the on-device pruned
# forwards, batches of more than one image) against every row, one binary
# (CANDLE_DEIT_LAST_BLOCK=all vs the default).
# Needs .gpu/{bench,test-graph,test-paths_agreement}.xz.
# STAGES (default "checks e2e"):
#   checks   test-graph, paths at DeiT-T batch 8 and 32, DeiT-S batch 8, DeiT-B batch 4, DeiT-T
#            distilled batch 8 (dense against padded / ragged, the prefix path in the dense and
#            on-device forwards)
#   e2e      bench DeiT-T/S/B, batch 8/64/256, f16, dense, Threshold-L2 / EViT fixed, ragged
#            path, arms interleaved, two rounds; per-row all / default ratios
set -u
stages=${STAGES:-checks e2e}
. scripts/gpu/lib.sh
unpack bench test-graph test-paths_agreement
start_log last-block.txt
if has checks; then
  echo "== test-graph" >> "$C"
  timeout 120 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "(paths: DeiT-T batch 8 and 32, DeiT-S batch 8, DeiT-B batch 4, DeiT-T distilled batch 8)" >> "$C"
  paths_check deit-tiny 8 200
  paths_check deit-tiny 32 200
  paths_check deit-small 8 200
  paths_check deit-base 4 200
  paths_check deit-tiny-distilled 8 200
fi
e2e_run() { CANDLE_DEIT_LAST_BLOCK=${1#default} timeout 280 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 8,64,256 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$2"; }
ARMS="all default"
has e2e && ab_rounds lb e2e_run
pack lb-json.tgz 'lb-*.json'
cat "$C"
