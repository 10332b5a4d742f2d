#!/usr/bin/env bash
# select_top_k's ranking against the binary before a change to it, on the GPU machine: lever 51
# (each patch's comparisons split over the block's spare threads, the kept rows' slots from a
# block-wide exclusive sum; docs/benchmarks/history/lever51-select-rank.patch, not kept) and
# lever 76 (patches spread over key buckets first, only a bucket's members compared). Two
# binaries, one call, from the repo root:
#   .gpu/bench.xz            bench with the change
#   .gpu-prev/bench-prev.xz  bench built from the commit before the change
# plus .gpu/{test-select,test-paths_agreement}.xz.
# STAGES (default "checks ncu ab"; lever 76 ran "checks anatomy ncu ab"):
#   checks   test-select (lever 51 also ran test-select_rule and test-select_bounded, whose
#            kernels neither lever changes); memcheck and racecheck of test-select; paths at DeiT-S (batch 32, every pruner, three dtypes), DeiT-T batch 1
#            and 8; graphs_check (the one-image graphs against the padded path)
#   anatomy  bench --graph-anatomy, DeiT-T batch 1, f16, Threshold-L2 / EViT / DynamicViT
#            fixed, prev and new interleaved, two rounds
#   ncu      the selection kernels alone, prev vs new: DeiT-S f16 batch 1 and 8, Threshold-L2 and
#            EViT fixed, device decisions, caches and clocks left alone
#   ab       bench T/S/B, batch 1/8, f16, dense, Threshold-L2 and EViT fixed, ragged path, prev /
#            new interleaved, twice; per-row prev/new ratios
set -u
stages=${STAGES:-checks ncu ab}
. scripts/gpu/lib.sh
unpack bench test-select test-paths_agreement
unpack_prev bench || exit 1
start_log select-rank.txt
if has checks; then
  for t in select; do
    echo "== test-$t" >> "$C"; timeout 300 $B/test-$t --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  done
  echo "== memcheck / racecheck test-select" >> "$C"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-select --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-select --test-threads=1 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" >> "$C"
  paths_check deit-small 32 300
  paths_check deit-tiny 1 200
  paths_check deit-tiny 8 200
  graphs_check 200
fi
if has anatomy; then
  for r in 1 2; do
    for a in prev new; do
      echo "== graph anatomy, $a, round $r" >> "$C"
      timeout 200 $(prev_or_new "$a" bench) --device cuda --models deit-tiny --dtype f16 --batch 1 \
        --pruners threshold-l2-fixed,evit-fixed,dynamicvit-fixed --paths ragged --reps 100 \
        --graph-anatomy --out /tmp/anat.json 2>&1 | grep -E "^graph|rror" | grep -v "only:" >> "$C"
    done
  done
fi
if has ncu; then
  for a in prev new; do
    bin=$(prev_or_new $a bench)
    for b in 1 8; do
      for p in threshold-l2-fixed evit-fixed; do
        CANDLE_FASTPATH_SMALL_BLOCK=0 ncu --cache-control none --clock-control none -k 'regex:select|cls_probs' --metrics gpu__time_duration.sum --csv --print-units base \
          $bin --device cuda --models deit-small --dtype f16 --batch $b --pruners $p --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
        python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "$a $p DeiT-S batch $b f16 (selection kernels)" >> "$C"
      done
    done
  done
fi
sel_run() { $(prev_or_new "$1" bench) --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 1,8 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$2"; }
ARMS="prev new"
has ab && ab_rounds sel sel_run
pack sel-json.tgz 'sel-*.json'
cat "$C"
