#!/usr/bin/env bash
# Lever 40 on the GPU machine, from the repo root: a whole ViT block in one cooperative launch
# for small token counts (candle_fastpath::small_block) against the block's ~8 kernels; one
# binary, CANDLE_FASTPATH_SMALL_BLOCK=0 (off) vs the default (eager: DeiT-T/S up to 256 rows,
# not under graph capture) vs =always (every width, in graphs too).
# Needs .gpu/{bench,test-small_block,test-paths_agreement,test-graph}.xz (scripts/gpu/bundle.sh).
# STAGES (default "checks e2e"):
#   checks  test-small_block, its memcheck and racecheck, test-graph, paths T/S/B at batch 1
#           (the fused block on the ragged and dense paths against the padded path's layers;
#           default and =always), paths DeiT-S at batch 8 with the block forced on (=always,
#           ROWS=2048: 8 sequences)
#   e2e     bench dense and every pruner's default modes, ragged, T/S/B, batch 1, f16, the
#           three arms interleaved, twice
#   bf16    the batch-1 A/B in bf16, one round
#   ncu     the kernel's time per phase: ncu's gpu__time_duration of DeiT-S / DeiT-B batch-1
#           launches with CANDLE_FASTPATH_SMALL_BLOCK_SKIP leaving phases out (31: barriers only;
#           30: qkv only; 29: attention only; 27: proj only; 23: fc1 only; 15: fc2 only)
set -u
stages=${STAGES:-checks e2e}
. scripts/gpu/lib.sh
unpack bench test-small_block test-graph test-paths_agreement
start_log small-block.txt
L="$C"
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
  for mode in eager always; do
    echo "== paths (cuda, T/S/B, batch 1, CANDLE_FASTPATH_SMALL_BLOCK=$mode)" >> "$C"
    CANDLE_FASTPATH_SMALL_BLOCK=$mode PATHS_DEVICE=cuda PATHS_MODELS=deit-tiny,deit-small,deit-base PATHS_BATCH=1 timeout 200 $B/test-paths_agreement --ignored --test-threads=1 > "$out/paths-b1-$mode.log" 2>&1
    echo "paths b1 rc=$?" >> "$C"
    grep -E "test result|panicked" "$out/paths-b1-$mode.log" >> "$C"
  done
  echo "== paths (cuda, DeiT-S, batch 8, CANDLE_FASTPATH_SMALL_BLOCK=always, ROWS=2048)" >> "$C"
  CANDLE_FASTPATH_SMALL_BLOCK=always CANDLE_FASTPATH_SMALL_BLOCK_ROWS=2048 PATHS_DEVICE=cuda PATHS_MODELS=deit-small PATHS_BATCH=8 timeout 150 $B/test-paths_agreement --ignored --test-threads=1 > "$out/paths-b8.log" 2>&1
  echo "paths b8 rc=$?" >> "$C"
  grep -E "test result|panicked" "$out/paths-b8.log" >> "$C"
fi
e2e_run() {
  CANDLE_FASTPATH_SMALL_BLOCK=$1 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype ${DT:-f16} --batch 1 --paths ragged --reps 10 --out "$2"
}
has e2e && ARMS="0 eager always" ab_rounds e2e e2e_run
if has bf16; then
  for a in 0 eager; do DT=bf16 e2e_run $a "$out/e2ebf-$a-1.json" > /dev/null 2>&1; echo "bf16 $a rc=$?" >> "$C"; done
  python3 scripts/gpu/ab_ratios.py "$out/e2ebf" 0 eager >> "$C"
fi
if has ncu; then
  echo "== ncu: small_block launches (us, three launches each), phases left out by mask" >> "$C"
  for m in deit-small deit-base; do
    for k in 0 31 30 29 27 23 15; do
      CANDLE_FASTPATH_SMALL_BLOCK=always CANDLE_FASTPATH_SMALL_BLOCK_SKIP=$k timeout 60 ncu --kernel-name regex:small_block --launch-skip 14 --launch-count 3 --metrics gpu__time_duration.sum $B/bench --device cuda --models $m --dtype f16 --batch 1 --pruners none --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu-skip.txt 2>&1
      echo "$m skip=$k $(grep -E 'gpu__time_duration.sum' /tmp/ncu-skip.txt | awk '{print $NF}' | tr '\n' ' ')" >> "$C"
    done
  done
fi
pack small-block-json.tgz 'e2e*.json' 'paths-*.log' 'test-small-block.log'
cat "$C"
