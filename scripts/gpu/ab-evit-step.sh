#!/usr/bin/env bash
# Levers 71 and 72 on the GPU machine, from the repo root: a pruning step after the attention
# (EViT) at batch 1, one binary, arms ARMS (default "off chain both"):
#   off    CANDLE_DEIT_CHAIN_AFTER_ATTENTION=0 CANDLE_FASTPATH_MLP_BLOCK=0: the step's block
#          computes its own norm1 + qkv, runs its attention and projection as two kernels, and
#          its MLP half as norm_linear then residual_norm_linear;
#   chain  lever 71: the block before computes the step block's qkv with its fc2
#          (attention_block), and the attention + projection are one kernel;
#   both   and lever 72: the MLP half after the step, through the next block's qkv, one kernel
#          (mlp_block);
#   nochain  lever 72 without lever 71 (CANDLE_DEIT_CHAIN_AFTER_ATTENTION=0 alone; for lever 74,
#          which extends lever 71 to the rule-based path: ARMS="nochain both").
# Needs .gpu/{bench,test-norm_linear,test-attention_norm_linear,test-graph,test-paths_agreement}.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   test-attention_norm_linear (mlp_block bit-equal to norm_linear + residual_norm_linear,
#            rows 1-352), under memcheck, and racecheck in its quick form; test-norm_linear;
#            test-graph; paths at DeiT-T and DeiT-T distilled batch 1 and 8; graphs_check
#            (one-image graphs, every fixed pruner, against the padded path)
#   anatomy  bench --graph-anatomy, DeiT-T batch 1, f16, ANATOMY_PRUNERS (default dense,
#            Threshold-L2 / EViT fixed), every arm, two rounds
#   e2e      bench DeiT-T, batch 1, f16 and bf16, ragged path, pruners PRUNERS (default dense,
#            Threshold-L2 / EViT fixed, EViT adaptive), arms interleaved, two rounds; per-row
#            ratios of the first arm to each other
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-norm_linear test-attention_norm_linear test-graph test-paths_agreement
start_log evit-step.txt
if has checks; then
  tests_memcheck attention_norm_linear norm_linear
  echo "== test-attention_norm_linear under racecheck (quick)" >> "$C"
  ATTENTION_RNL_TEST_QUICK=1 timeout 400 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-attention_norm_linear --test-threads=1 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" >> "$C"
  echo "== test-graph" >> "$C"
  timeout 200 $B/test-graph --test-threads=1 2>&1 | grep -E -A3 "test result|panicked" | head -12 >> "$C"
  paths_check deit-tiny 1 200
  paths_check deit-tiny-distilled 1 200
  paths_check deit-tiny 8 200
  graphs_check 200
fi
ARMS=${ARMS:-off chain both}
# arm_env ARM: the environment assignments of an arm.
arm_env() {
  case $1 in
    off) echo "CANDLE_DEIT_CHAIN_AFTER_ATTENTION=0 CANDLE_FASTPATH_MLP_BLOCK=0" ;;
    chain) echo "CANDLE_FASTPATH_MLP_BLOCK=0" ;;
    nochain) echo "CANDLE_DEIT_CHAIN_AFTER_ATTENTION=0" ;;
    *) echo "CANDLE_FASTPATH_MLP_BLOCK=" ;;
  esac
}
if has anatomy; then
  for a in $ARMS $ARMS; do
    echo "== graph anatomy, $a" >> "$C"
    # shellcheck disable=SC2046  # the arm's assignments, one word each
    env $(arm_env "$a") timeout 200 $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 \
      --pruners ${ANATOMY_PRUNERS:-none,threshold-l2-fixed,evit-fixed} --paths ragged --reps 100 \
      --graph-anatomy --out /tmp/anat.json 2>&1 | grep -E "^graph|rror" | grep -v "only:" >> "$C"
  done
fi
# shellcheck disable=SC2046  # as above
e2e_run() { env $(arm_env "$1") timeout 280 $B/bench --device cuda --models deit-tiny --dtype f16,bf16 --batch 1 --pruners "${PRUNERS:-none,threshold-l2-fixed,evit-fixed,evit-adaptive}" --paths ragged --reps 20 --out "$2"; }
has e2e && ab_rounds evit e2e_run
pack evit-json.tgz 'evit-*.json'
cat "$C"
