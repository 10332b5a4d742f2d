#!/usr/bin/env bash
# Lever 40 on the GPU machine, from the repo root: a whole ViT block in one cooperative launch
# for small token counts (candle_fastpath::small_block) against the block's ~8 kernels; one
# binary, CANDLE_FASTPATH_SMALL_BLOCK_ROWS=0 (off) vs the default (on up to 256 rows: batch 1).
# Needs .gpu/{bench,test-small_block,test-paths_agreement,test-graph}.xz (scripts/gpu/bundle.sh).
# STAGES (default "checks e2e"):
#   checks  test-small_block, its memcheck and racecheck, test-graph, paths T/S/B at batch 1
#           (the fused block on the ragged and dense paths against the padded path's layers),
#           paths DeiT-S at batch 8 with the fused block forced on (2048 rows: 8 sequences)
#   e2e     bench dense and every pruner's default modes, ragged, T/S/B, batch 1, f16, the two
#           arms interleaved, twice; then batch 8 with the block forced on (=2048) vs off
#   bf16    the batch-1 A/B in bf16, one round
set -u
stages=${STAGES:-checks e2e}
. scripts/gpu/lib.sh
unpack bench test-small_block test-graph test-paths_agreement
C="$out/small-block.txt"
L="$C"
nvidia-smi --query-gpu=name --format=csv,noheader >> "$C"
if has checks; then
  echo "== test-small_block" >> "$C"
  timeout 120 $B/test-small_block --test-threads=1 --nocapture > "$out/test-small-block.log" 2>&1
  echo "rc=$?" >> "$C"
  grep -E "worst|test result|panicked" "$out/test-small-block.log" >> "$C"
  echo "== memcheck / racecheck test-small_block" >> "$C"
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-small_block --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result|rror" | head -20 >> "$C"
  timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-small_block --test-threads=1 repeated 2>&1 | grep -E "RACECHECK SUMMARY|test result|azard" | head -20 >> "$C"
  echo "== test-graph" >> "$C"
  timeout 120 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "== paths (cuda, T/S/B, batch 1)" >> "$C"
  PATHS_DEVICE=cuda PATHS_MODELS=deit-tiny,deit-small,deit-base PATHS_BATCH=1 timeout 200 $B/test-paths_agreement --ignored --test-threads=1 > "$out/paths-b1.log" 2>&1
  echo "paths b1 rc=$?" >> "$C"
  grep -E "test result|panicked" "$out/paths-b1.log" >> "$C"
  echo "== paths (cuda, DeiT-S, batch 8, CANDLE_FASTPATH_SMALL_BLOCK_ROWS=2048)" >> "$C"
  CANDLE_FASTPATH_SMALL_BLOCK_ROWS=2048 PATHS_DEVICE=cuda PATHS_MODELS=deit-small PATHS_BATCH=8 timeout 150 $B/test-paths_agreement --ignored --test-threads=1 > "$out/paths-b8.log" 2>&1
  echo "paths b8 rc=$?" >> "$C"
  grep -E "test result|panicked" "$out/paths-b8.log" >> "$C"
fi
e2e_run() {
  local rows=$1; [ "$rows" = default ] && rows=256
  CANDLE_FASTPATH_SMALL_BLOCK_ROWS=$rows $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype ${DT:-f16} --batch ${BATCHES:-1} --paths ragged --reps 10 --out "$2"
}
if has e2e; then
  ARMS="0 default" ab_rounds e2e e2e_run
  BATCHES=8 ARMS="0 2048" ab_rounds e2e8 e2e_run
fi
if has bf16; then
  for a in 0 default; do DT=bf16 e2e_run $a "$out/e2ebf-$a-1.json" > /dev/null 2>&1; echo "bf16 $a rc=$?" >> "$C"; done
  python3 scripts/gpu/ab_ratios.py "$out/e2ebf" 0 default >> "$C"
fi
pack small-block-json.tgz 'e2e*.json' 'paths-*.log' 'test-small-block.log'
cat "$C"
