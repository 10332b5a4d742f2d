#!/usr/bin/env bash
# Lever 90 on the GPU machine, from the repo root: a DeiT-T batch-1 fixed-count pruning step
# before a block (Threshold-L2's, DynamicViT's) ranked at the head of the block's kernel
# (candle_fastpath::select_attention_block: every CTA ranks the step's scores and reads its kept
# rows of the qkv projection and of the residual in place) instead of candle-ragged's
# select_top_k_gathering launch and then attention_block on the gathered rows. One binary, two
# arms: `off` (CANDLE_FASTPATH_SELECT_ATTENTION_BLOCK=0) and `default`.
# Needs .gpu/{bench,test-attention_norm_linear,test-paths_agreement}.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   test-attention_norm_linear (the new kernel bit for bit against the select and
#            attention_block launches, the other fused kernels), its new test under memcheck and
#            racecheck (quick cases), paths at DeiT-T batch 1, the one-image graphs
#   anatomy  bench --graph-anatomy, DeiT-T batch 1, f16, dense and the fixed pruners, each arm
#   ncu      per-kernel times of DeiT-T batch-1 Threshold-L2 fixed forwards (eager, the graph's
#            kernels), each arm
#   e2e      bench DeiT-T batch 1, f16 and bf16, dense and every pruner and mode, ragged path,
#            arms interleaved, two rounds; per-row ratios against `off`
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-attention_norm_linear test-paths_agreement
start_log select-attention.txt
PRUNERS_ALL=none,threshold-l2-fixed,threshold-l2-adaptive,dynamicvit-fixed,dynamicvit-adaptive,evit-fixed,evit-adaptive,ats-fixed,ats-adaptive
# arm_env ARM: the switches of an arm, as env assignments.
arm_env() {
  case $1 in
    off) echo "CANDLE_FASTPATH_SELECT_ATTENTION_BLOCK=0" ;;
    *) echo "" ;;
  esac
}
ARMS=${ARMS:-off default}
if has checks; then
  tests_results 300 attention_norm_linear
  export ATTENTION_RNL_TEST_QUICK=1
  sanitize attention_norm_linear select_attention_block
  unset ATTENTION_RNL_TEST_QUICK
  paths_check deit-tiny 1 300
  graphs_check 200
fi
if has anatomy; then
  for a in $ARMS; do
    echo "== graph anatomy, arm $a" >> "$C"
    env $(arm_env "$a") timeout 200 $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 \
      --pruners none,threshold-l2-fixed,dynamicvit-fixed,evit-fixed --paths ragged --reps 100 --graph-anatomy --out /tmp/anat.json 2>&1 \
      | grep -E "^graph|rror" | grep -v "only:" >> "$C"
  done
fi
if has ncu; then
  for a in $ARMS; do
    env $(arm_env "$a") CANDLE_FASTPATH_SMALL_BLOCK=0 ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
      $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 --pruners threshold-l2-fixed --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
    python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "deit-tiny batch 1 f16 threshold-l2-fixed ragged, arm $a (eager forwards with the graph's kernels), warm, boost clocks" | head -24 >> "$C"
  done
fi
e2e_run() { env $(arm_env "$1") timeout 250 $B/bench --device cuda --models deit-tiny --dtype f16,bf16 --batch 1 --pruners $PRUNERS_ALL --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds selattn e2e_run
pack selattn-json.tgz 'selattn-*.json'
cat "$C"
