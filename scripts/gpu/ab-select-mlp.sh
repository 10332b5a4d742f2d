#!/usr/bin/env bash
# Levers 86 and 87 on the GPU machine, from the repo root: a DeiT-T batch-1 pruning step after
# the attention (EViT's, ATS's) with the attention kernel stopping at x1 (86,
# candle_fastpath::attention_residual, instead of attention_residual_norm_linear whose fc1 output
# was dropped) and the selection run at the head of the MLP half's kernel (87,
# candle_fastpath::select_mlp_block, instead of candle-ragged's select_top_k launch and then
# mlp_block), and (88, candle_fastpath::attention_residual_with_cls_probs) the step's
# class-attention scores computed by the attention kernel's idle warps instead of candle-ragged's
# cls_probs launch. One binary, four arms: `off` (all three switched off:
# CANDLE_FASTPATH_ATTENTION_RESIDUAL=0 CANDLE_FASTPATH_SELECT_MLP_BLOCK=0
# CANDLE_FASTPATH_ATTENTION_CLS_PROBS=0), `x1` (86 only), `sel` (86 and 87), `default` (all).
# Needs .gpu/{bench,test-attention_norm_linear,test-select,test-step_scores,test-select_bounded,
# test-select_rule,test-paths_agreement}.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   the kernels' tests (x1 and the select + MLP bit for bit against the launches they
#            replace; step_scores; the fused row's batch invariance; the selection tests after
#            select_common.cuh), the new kernels under memcheck and racecheck (quick cases),
#            step_scores under memcheck, paths at DeiT-T batch 1, the one-image graphs
#   anatomy  bench --graph-anatomy, DeiT-T batch 1, f16, dense and the fixed pruners, each arm
#   ncu      per-kernel times of DeiT-T batch-1 EViT fixed forwards (eager, the graph's kernels), each arm
#   source   where fastpath_select_mlp_block waits (ncu's SASS stall samples), default arm
#   e2e      bench DeiT-T batch 1, f16 and bf16, dense and every pruner and mode, ragged path,
#            arms interleaved, two rounds; per-row ratios against `off`
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-attention_norm_linear test-select test-step_scores test-select_bounded test-select_rule test-paths_agreement
start_log select-mlp.txt
PRUNERS_ALL=none,threshold-l2-fixed,threshold-l2-adaptive,dynamicvit-fixed,dynamicvit-adaptive,evit-fixed,evit-adaptive,ats-fixed,ats-adaptive
# arm_env ARM: the switches of an arm, as env assignments.
arm_env() {
  case $1 in
    off) echo "CANDLE_FASTPATH_ATTENTION_RESIDUAL=0 CANDLE_FASTPATH_SELECT_MLP_BLOCK=0 CANDLE_FASTPATH_ATTENTION_CLS_PROBS=0" ;;
    x1) echo "CANDLE_FASTPATH_SELECT_MLP_BLOCK=0 CANDLE_FASTPATH_ATTENTION_CLS_PROBS=0" ;;
    sel) echo "CANDLE_FASTPATH_ATTENTION_CLS_PROBS=0" ;;
    *) echo "" ;;
  esac
}
ARMS=${ARMS:-off x1 sel default}
if has checks; then
  tests_results 200 attention_norm_linear select step_scores select_bounded select_rule
  export ATTENTION_RNL_TEST_QUICK=1
  sanitize attention_norm_linear select_mlp_block
  sanitize attention_norm_linear attention_residual_is
  sanitize attention_norm_linear attention_cls_probs
  unset ATTENTION_RNL_TEST_QUICK
  echo "== test-step_scores under memcheck" >> "$C"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-step_scores --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  paths_check deit-tiny 1 300
  graphs_check 200
fi
if has anatomy; then
  for a in $ARMS; do
    echo "== graph anatomy, arm $a" >> "$C"
    env $(arm_env "$a") timeout 200 $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 \
      --pruners none,threshold-l2-fixed,evit-fixed,ats-fixed,dynamicvit-fixed --paths ragged --reps 100 --graph-anatomy --out /tmp/anat.json 2>&1 \
      | grep -E "^graph|rror" | grep -v "only:" >> "$C"
  done
fi
if has ncu; then
  for a in $ARMS; do
    env $(arm_env "$a") CANDLE_FASTPATH_SMALL_BLOCK=0 ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
      $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 --pruners evit-fixed --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
    python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "deit-tiny batch 1 f16 evit-fixed ragged, arm $a (eager forwards with the graph's kernels), warm, boost clocks" | head -24 >> "$C"
  done
fi
if has source; then
  echo "== fastpath_select_mlp_block (evit-fixed): top SASS lines by stall samples" >> "$C"
  ncu --cache-control none --clock-control none --kernel-name regex:select_mlp_block --launch-skip 3 --launch-count 1 \
    --warp-sampling-interval 0 --section SourceCounters --page source --print-source sass --csv \
    $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 --pruners evit-fixed --paths ragged --reps 5 --warmup 1 --out /tmp/x.json > /tmp/src.csv 2>/dev/null
  python3 scripts/gpu/ncu_source.py /tmp/src.csv --top 30 --context 3 >> "$C"
fi
e2e_run() { env $(arm_env "$1") timeout 250 $B/bench --device cuda --models deit-tiny --dtype f16,bf16 --batch 1 --pruners $PRUNERS_ALL --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds selmlp e2e_run
pack selmlp-json.tgz 'selmlp-*.json'
cat "$C"
