#!/usr/bin/env bash
# Lever 77 on the GPU machine, from the repo root: the block before a Threshold-L2 step computes
# its output rows' L2 norms on the way (candle_fastpath::attention_block_with_norms, rank 0 of
# each row tile's cluster, candle-ragged's row-norm arithmetic) and the step's select kernel ranks
# them as given scores instead of reading the rows back to score them. Two binaries, one call:
#   .gpu/bench.xz            bench with the change
#   .gpu-prev/bench-prev.xz  bench built from the commit before the change
# plus .gpu/{test-attention_norm_linear,test-graph,test-paths_agreement}.xz.
# STAGES (default "checks anatomy ab"):
#   checks   test-attention_norm_linear (block_matches_the_two_kernels now checks the norms: bit
#            for bit the select kernel's, through a weighted-sum fused row), under memcheck and
#            (quick cases) racecheck; test-graph; paths at DeiT-T batch 1 and 8; graphs_check
#            (the one-image graphs against the padded path)
#   anatomy  bench --graph-anatomy, DeiT-T batch 1, f16 and bf16, PRUNERS (default dense and
#            Threshold-L2 fixed; the second call: Threshold-L2 fixed and adaptive), prev and new
#            interleaved, ROUNDS (default 3) rounds
#   ab       bench DeiT-T, batch 1, f16 and bf16, PRUNERS, ragged path, prev / new interleaved,
#            two rounds; per-row prev/new ratios
set -u
stages=${STAGES:-checks anatomy ab}
pruners=${PRUNERS:-none,threshold-l2-fixed}
. scripts/gpu/lib.sh
unpack bench test-attention_norm_linear test-graph test-paths_agreement
unpack_prev bench || exit 1
start_log step-norms.txt
if has checks; then
  echo "== test-attention_norm_linear" >> "$C"
  timeout 200 $B/test-attention_norm_linear --test-threads=1 2>&1 | grep -E "test result|panicked|norm" >> "$C"
  echo "== memcheck test-attention_norm_linear" >> "$C"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-attention_norm_linear --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  echo "== racecheck test-attention_norm_linear (quick cases)" >> "$C"
  ATTENTION_RNL_TEST_QUICK=1 timeout 400 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-attention_norm_linear --test-threads=1 block_matches 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" >> "$C"
  echo "== test-graph" >> "$C"
  timeout 120 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  paths_check deit-tiny 1 200
  paths_check deit-tiny 8 200
  graphs_check 200
fi
if has anatomy; then
  for r in $(seq 1 "${ROUNDS:-3}"); do
    for a in prev new; do
      echo "== graph anatomy, $a, round $r" >> "$C"
      timeout 200 $(prev_or_new "$a" bench) --device cuda --models deit-tiny --dtype f16,bf16 --batch 1 \
        --pruners "$pruners" --paths ragged --reps 200 \
        --graph-anatomy --out /tmp/anat.json 2>&1 | grep -E "^graph|rror" | grep -v "only:" >> "$C"
    done
  done
fi
norms_run() { $(prev_or_new "$1" bench) --device cuda --models deit-tiny --dtype f16,bf16 --batch 1 --pruners "$pruners" --paths ragged --reps 50 --out "$2"; }
ARMS="prev new"
has ab && ab_rounds norms norms_run
pack norms-json.tgz 'norms-*.json'
cat "$C"
