#!/usr/bin/env bash
# Levers 91 and 92 on the GPU machine, from the repo root: the batch-1 step kernels' selection
# made cheaper (91: select_common.cuh's ranking as two loops of one comparison each, the
# placement's warp counts scanned by shuffles, EViT's fused row read 16 bytes at a time with each
# thread's loads in flight together (fused_columns8), and the fused row's CTAs issuing W2's and
# the next qkv's loads before computing it; 92: select_mlp_block staging each tile's window of
# input rows at its start, and the fused weights' total summed by an idle warp). Two binaries:
# .gpu/bench.xz (new) against .gpu-prev/bench-prev.xz (prev, the commit before the change).
# SANITIZE_SELECT=0 leaves test-select out of the sanitizer runs (its racecheck takes ~200 s).
# Needs .gpu/{bench,test-attention_norm_linear,test-select,test-step_scores,test-select_bounded,
# test-select_rule,test-paths_agreement}.xz (tests: those the bundle has) and .gpu-prev/bench-prev.xz.
# STAGES (default "checks anatomy ncu e2e"):
#   checks   the selection tests of both crates (select_top_k's tokens and fused row, the fused
#            kernels bit for bit against select_top_k then the kernel), the fused kernels' step
#            tests under memcheck and racecheck (quick cases), paths at DeiT-T batch 1, the
#            one-image graphs
#   anatomy  bench --graph-anatomy, DeiT-T batch 1, f16, dense and the fixed pruners, both
#            binaries, two rounds interleaved
#   ncu      per-kernel times of DeiT-T batch-1 EViT and Threshold-L2 fixed forwards (eager, the
#            graph's kernels), both binaries
#   e2e      bench DeiT-T batch 1, f16 and bf16, dense and every pruner and mode, ragged path,
#            arms interleaved, two rounds; per-row ratios prev / new
set -u
stages=${STAGES:-checks anatomy ncu e2e}
. scripts/gpu/lib.sh
unpack bench test-attention_norm_linear test-select test-step_scores test-select_bounded test-select_rule test-paths_agreement
unpack_prev bench
start_log select-fast.txt
PRUNERS_ALL=none,threshold-l2-fixed,threshold-l2-adaptive,dynamicvit-fixed,dynamicvit-adaptive,evit-fixed,evit-adaptive,ats-fixed,ats-adaptive
ARMS=${ARMS:-prev new}
if has checks; then
  tests_results 300 attention_norm_linear select step_scores select_bounded select_rule
  export ATTENTION_RNL_TEST_QUICK=1
  sanitize attention_norm_linear select_
  unset ATTENTION_RNL_TEST_QUICK
  [ -f "$B/test-select" ] && [ "${SANITIZE_SELECT:-1}" != 0 ] && sanitize select
  [ -f "$B/test-paths_agreement" ] && { paths_check deit-tiny 1 300; graphs_check 200; }
fi
if has anatomy; then
  for r in 1 2; do
    for a in $ARMS; do
      echo "== graph anatomy, $a, round $r" >> "$C"
      timeout 200 $(prev_or_new "$a" bench) --device cuda --models deit-tiny --dtype f16 --batch 1 \
        --pruners none,threshold-l2-fixed,evit-fixed,dynamicvit-fixed,ats-fixed --paths ragged --reps 100 \
        --graph-anatomy --out /tmp/anat.json 2>&1 | grep -E "^graph|rror" | grep -v "only:" >> "$C"
    done
  done
fi
if has ncu; then
  for pr in evit-fixed threshold-l2-fixed; do
    for a in $ARMS; do
      CANDLE_FASTPATH_SMALL_BLOCK=0 ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
        $(prev_or_new "$a" bench) --device cuda --models deit-tiny --dtype f16 --batch 1 --pruners $pr --paths ragged --reps 2 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
      python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "deit-tiny batch 1 f16 $pr ragged, $a (eager forwards with the graph's kernels), warm, boost clocks" \
        | grep -E "==|select|attention_block|mlp_block|attention_residual_f16" >> "$C"
    done
  done
fi
e2e_run() { timeout 250 $(prev_or_new "$1" bench) --device cuda --models deit-tiny --dtype f16,bf16 --batch 1 --pruners $PRUNERS_ALL --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds selfast e2e_run
pack selfast-json.tgz 'selfast-*.json'
cat "$C"
