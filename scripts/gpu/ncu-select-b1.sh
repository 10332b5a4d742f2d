#!/usr/bin/env bash
# The pruning steps' kernels of a batch-1 forward, as a replay runs them: ncu (caches and clocks
# left alone) over DeiT-S f16 batch 1, device decisions, the one-kernel block off; per-kernel
# times of the selection kernels for each pruner of $PRUNERS, then the per-SASS-instruction stall
# samples of select_top_k over several launches. Needs .gpu/bench.xz; repo root.
set -u
. scripts/gpu/lib.sh
unpack bench
start_log ncu-select-b1.txt
run() { CANDLE_FASTPATH_SMALL_BLOCK=0 "$@" $B/bench --device cuda --models ${MODEL:-deit-small} --dtype f16 --batch ${BATCH:-1} --pruners "$p" --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json; }
for p in ${PRUNERS:-threshold-l2-fixed evit-fixed}; do
  run ncu --cache-control none --clock-control none -k 'regex:select|cls_probs|gather|decide|offsets' --metrics gpu__time_duration.sum --csv --print-units base > /tmp/ncu.csv 2>/dev/null
  python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "$p ${MODEL:-deit-small} batch ${BATCH:-1} f16, selection kernels (host- and device-decided rows)" >> "$C"
done
p=threshold-l2-fixed
run ncu --cache-control none --clock-control none -k regex:select_top_k --launch-count 12 --section SourceCounters --section WarpStateStats --page source --print-source sass --csv > "$out/source-select.csv" 2> "$out/source-select.err"
echo "== ncu source page, select_top_k ($p, 12 launches): rc=$? $(wc -l < "$out/source-select.csv") lines" >> "$C"
pack ncu-select.tgz 'source-select.*'
cat "$C"
