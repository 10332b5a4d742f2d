#!/usr/bin/env bash
# Per-kernel GPU time of one CUDA-graph replay of `bench`'s forwards (ncu --graph-profiling node,
# caches and clocks left alone: warm, boost), in launch order and by kernel name: where a replay's
# time goes, without the eager rows' extra work (cuBLASLt plan timing, host decisions). Needs
# .gpu/bench.xz; repo root.
#   FORWARDS="deit-tiny:64:none deit-tiny:64:threshold-l2-fixed" scripts/gpu/ncu-graph-replay.sh
# Each entry is model:batch:pruner (a pruned one: the ragged path, decisions on the device). For
# each, `bench --graph-anatomy` first gives the graph's kernel count K and its replay events; then
# under ncu the last K profiled launches are the last replay (scripts/gpu/ncu_last_replay.py).
set -u
. scripts/gpu/lib.sh
unpack bench
start_log "${LOG:-ncu-graph-replay.txt}"
# (Until stop 47 the ncu line lacked --cache-control / --clock-control none: its times were at
# base clocks with caches flushed before each kernel, lever 109's list among them.)
# (Stop 48: under ncu the eager rows' GEMM plan timing (lever 79) sees every launch slowed past
# its 20 µs cut-off, so the profiled replay runs cuBLASLt's first picks, not the bench's tuned
# ones: its nvjet rows can be slower than the bench's (DeiT-T batch 64 qkv: 17.1 µs listed, the
# tuned pick 11.4 µs). CANDLE_FASTPATH_LT_LOG=1 on a plain bench run prints the picks and times.)
for spec in ${FORWARDS:-deit-tiny:64:none deit-tiny:64:threshold-l2-fixed}; do
  IFS=: read -r m b p <<< "$spec"
  args=(--device cuda --models "$m" --dtype "${DTYPE:-f16}" --batch "$b" --pruners "$p" --paths ragged)
  line=$($B/bench "${args[@]}" --reps 50 --graph-anatomy --out /tmp/anat.json 2>&1 | grep "^graph" | grep -v "head only" | tail -1)
  echo "$line" >> "$C"
  k=$(sed -E 's/.*: ([0-9]+) kernel,.*/\1/' <<< "$line")
  ncu --graph-profiling node --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    $B/bench "${args[@]}" --reps 1 --warmup 1 --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
  python3 scripts/gpu/ncu_last_replay.py /tmp/ncu.csv "$k" "$m batch $b ${DTYPE:-f16} $p" >> "$C"
done
cat "$C"
