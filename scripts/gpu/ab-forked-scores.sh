#!/usr/bin/env bash
# Lever 84 on the GPU machine, from the repo root: EViT's class-attention scores on a forked
# stream beside the step block's attention (candle_ragged::class_attention_mean_forked, joined
# before the selection) against cls_probs on the forward's chain inside the selection op
# (CANDLE_RAGGED_FORKED_SCORES=0). One binary, built with
# docs/benchmarks/history/lever84-forked-scores.patch applied (not kept: no faster at batch 1,
# slower at batch 8; the code was reverted).
# Needs .gpu/{bench,test-forked_scores,test-select,test-paths_agreement}.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   test-forked_scores (the forked scores select what the op computes itself, bit for
#            bit) in both arms and under memcheck / racecheck, test-select, paths at DeiT-T/S
#            batch 8, DeiT-B batch 32 and DeiT-T batch 1, the one-image graphs
#   anatomy  bench --graph-anatomy, DeiT-T batch 1 and 8, f16, dense and EViT fixed, both arms
#   e2e      bench DeiT-T/S/B, batch 1 and 8, f16, dense and EViT fixed, ragged path, arms
#            interleaved, two rounds; per-row 0 / default ratios
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-forked_scores test-select test-paths_agreement
start_log forked-scores.txt
if has checks; then
  test_arms CANDLE_RAGGED_FORKED_SCORES "default 0" forked_scores
  test_arms CANDLE_RAGGED_FORKED_SCORES default select
  sanitize forked_scores
  paths_check deit-tiny,deit-small 8 300
  paths_check deit-base 32 300
  paths_check deit-tiny 1 200
  graphs_check 200
fi
has anatomy && anatomy CANDLE_RAGGED_FORKED_SCORES "0 default" --models deit-tiny --dtype f16 --batch 1,8 --pruners none,evit-fixed
e2e_run() { CANDLE_RAGGED_FORKED_SCORES=${1#default} timeout 200 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 1,8 --pruners none,evit-fixed --paths ragged --reps 20 --out "$2"; }
ARMS=${ARMS:-0 default}
has e2e && ab_rounds fs e2e_run
pack fs-json.tgz 'fs-*.json'
cat "$C"
