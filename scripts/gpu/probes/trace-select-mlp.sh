#!/usr/bin/env bash
# Experiment (a throwaway build with docs/benchmarks/history/stop41-select-trace.patch applied):
# per-CTA phase clocks of DeiT-T batch-1 EViT fixed's select_mlp_block (FASTPATH_TRACE=1: each
# CTA's thread 0 records clock64 after each phase; medians / maxima over the CTAs, µs at 1.98
# GHz), with fc1's weights issued before the ranking (the kernel's order) or after the placement
# (FASTPATH_RANK_MODE=4), and mlp_block's after select_top_k for comparison. Needs .gpu/bench.xz
# built with the patch.
. scripts/gpu/lib.sh
unpack bench
for arm in "1 0" "1 4" "0 0"; do
  set -- $arm
  echo "== CANDLE_FASTPATH_SELECT_MLP_BLOCK=$1 FASTPATH_RANK_MODE=$2"
  FASTPATH_TRACE=1 FASTPATH_RANK_MODE=$2 CANDLE_FASTPATH_SELECT_MLP_BLOCK=$1 CANDLE_FASTPATH_SMALL_BLOCK=0 $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 --pruners evit-fixed --paths ragged --reps 3 --warmup 1 --cuda-graph false --out /tmp/x.json 2>&1 | grep TRACE | tail -3
done
