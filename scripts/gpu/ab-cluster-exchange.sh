#!/usr/bin/env bash
# Lever 68 on the GPU machine, from the repo root: the residual_norm_linear family's cluster
# exchanges (levers 61-65: x1, the attention tile, the fc1 tile, x2) pushed with st.async onto
# each receiver's transaction barrier instead of remote stores and cluster barriers (whose release
# compiles to MEMBAR.ALL.GPU). Two binaries: .gpu/bench.xz (new) against .gpu-prev/bench-prev.xz
# (prev, the commit before).
# Needs .gpu/{bench,test-norm_linear,test-attention_norm_linear,test-graph,test-paths_agreement}.xz
# and .gpu-prev/bench-prev.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   test-norm_linear and test-attention_norm_linear (each kernel against the separate
#            launches, bit-equal where they were; lengths 1-352, NaN tails), both under memcheck,
#            the quick attention test under racecheck; test-graph; paths at DeiT-T batch 1 / 8,
#            DeiT-T distilled batch 1, DeiT-S batch 1; graphs_check (one-image CUDA graphs
#            against the padded path)
#   anatomy  bench --graph-anatomy, DeiT-T batch 1, f16, dense and Threshold-L2 fixed, both
#            binaries, two rounds interleaved
#   e2e      bench DeiT-T, batch 1/8, f16 and bf16, dense, Threshold-L2 / EViT fixed,
#            Threshold-L2 adaptive, ragged path, arms interleaved, two rounds; per-row ratios
#   late     the new binary's graph anatomy with CANDLE_FASTPATH_ARNL_LATE_ROWS (from how many rows
#            the attention kernels issue their first weights' loads once K / V have landed) at
#            LATE_ROWS (default "128 0 100000": the default, always, never), two rounds
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-norm_linear test-attention_norm_linear test-graph test-paths_agreement
unpack_prev bench
start_log cluster-exchange.txt
if has checks; then
  tests_memcheck norm_linear attention_norm_linear
  echo "== racecheck test-attention_norm_linear (quick)" >> "$C"
  ATTENTION_RNL_TEST_QUICK=1 timeout 240 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-attention_norm_linear --test-threads=1 2>&1 | grep -E "RACECHECK SUMMARY|test result" >> "$C"
  echo "racecheck rc=$?" >> "$C"
  echo "== test-graph" >> "$C"
  timeout 120 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  paths_check deit-tiny 1 200
  paths_check deit-tiny 8 200
  paths_check deit-tiny-distilled 1 200
  paths_check deit-small 1 200
  graphs_check 200
fi
ARMS=${ARMS:-prev new}
if has anatomy; then
  for r in 1 2; do
    for a in $ARMS; do
      echo "== graph anatomy, $a, round $r" >> "$C"
      timeout 200 $(prev_or_new "$a" bench) --device cuda --models deit-tiny --dtype f16 --batch 1 \
        --pruners none,threshold-l2-fixed --paths ragged --reps 100 \
        --graph-anatomy --out /tmp/anat.json 2>&1 | grep -E "^graph|rror" | grep -v "only:" >> "$C"
    done
  done
fi
if has late; then
  for r in 1 2; do
    for rows in ${LATE_ROWS:-128 0 100000}; do
      echo "== graph anatomy, new, CANDLE_FASTPATH_ARNL_LATE_ROWS=$rows, round $r" >> "$C"
      CANDLE_FASTPATH_ARNL_LATE_ROWS=$rows timeout 200 $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 \
        --pruners none,threshold-l2-fixed --paths ragged --reps 100 \
        --graph-anatomy --out /tmp/anat.json 2>&1 | grep -E "^graph|rror" | grep -v "only:" >> "$C"
    done
  done
fi
e2e_run() { timeout 280 $(prev_or_new "$1" bench) --device cuda --models deit-tiny --dtype f16,bf16 --batch 1,8 --pruners none,threshold-l2-fixed,evit-fixed,threshold-l2-adaptive --paths ragged --reps 20 --out "$2"; }
has e2e && ab_rounds exch e2e_run
pack exch-json.tgz 'exch-*.json'
cat "$C"
