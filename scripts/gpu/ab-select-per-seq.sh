#!/usr/bin/env bash
# Lever 111 on the GPU machine, from the repo root: select_top_k's blocks per sequence (each block
# of a sequence scores and ranks it again and copies its share of the kept rows; the rule is
# 264 / batch, 4 at batch 64) forced by CANDLE_RAGGED_SELECT_PER_SEQ. Arms are its values
# (`default`: unset). One binary. Not kept: the knob is docs/benchmarks/history/lever111-select-per-seq.patch,
# to apply before building. Needs .gpu/bench.xz.
#   anatomy  bench --graph-anatomy (replay events), DeiT-T and DeiT-S at BATCH (default 64), f16,
#            Threshold-L2 / EViT / DynamicViT fixed, every arm, two rounds
set -u
. scripts/gpu/lib.sh
unpack bench
start_log select-per-seq.txt
ARMS=${ARMS:-default 1 2 8}
for r in 1 2; do
  anatomy CANDLE_RAGGED_SELECT_PER_SEQ "$ARMS" --models deit-tiny,deit-small --dtype f16 --batch "${BATCH:-64}" \
    --pruners threshold-l2-fixed,evit-fixed,dynamicvit-fixed
done
sed -i -E 's/ [0-9]+ mem-alloc.*replay:/ replay:/' "$C"
cat "$C"
