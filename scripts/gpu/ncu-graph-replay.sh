#!/usr/bin/env bash
# Per-kernel GPU time of one CUDA-graph replay of `bench`'s forwards (ncu --graph-profiling node,
# caches and clocks left alone: warm, boost), in launch order and by kernel name: where a replay's
# time goes, without the eager rows' extra work (cuBLASLt plan timing, host decisions). Needs
# .gpu/bench.xz; repo root.
#   FORWARDS="deit-tiny:64:none deit-tiny:64:threshold-l2-fixed" scripts/gpu/ncu-graph-replay.sh
# Each entry is model:batch:pruner (a pruned one: the ragged path, decisions on the device). For
# each, `bench --graph-anatomy` first gives the graph's kernel count K and its replay events; then
# under ncu the last K profiled launches are the last replay (scripts/gpu/ncu_last_replay.py).
# DRAM=1: also each launch's DRAM bytes read and L2 hit rate (scripts/gpu/ncu_replay_metrics.py):
# whether a replay's weights come from HBM or stay in L2 between replays. NCU_REPS: timed forwards
# of the profiled run (default 1; stop 48's DRAM log used 2).
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
# (Until stop 48 K came from the last anatomy line but the head-only one, which for a dense forward
# is its "12 blocks only" part: dense lists lacked the replay's first kernels. Every part's line
# ("... only") is skipped now.)
metrics=gpu__time_duration.sum
[ "${DRAM:-0}" = 1 ] && metrics=$metrics,dram__bytes_read.sum,lts__t_sector_hit_rate.pct
for spec in ${FORWARDS:-deit-tiny:64:none deit-tiny:64:threshold-l2-fixed}; do
  IFS=: read -r m b p <<< "$spec"
  args=(--device cuda --models "$m" --dtype "${DTYPE:-f16}" --batch "$b" --pruners "$p" --paths ragged)
  line=$($B/bench "${args[@]}" --reps 50 --graph-anatomy --out /tmp/anat.json 2>&1 | grep "^graph" | grep -v " only:" | tail -1)
  echo "$line" >> "$C"
  k=$(sed -E 's/.*: ([0-9]+) kernel,.*/\1/' <<< "$line")
  ncu --graph-profiling node --cache-control none --clock-control none --metrics "$metrics" --csv --print-units base \
    $B/bench "${args[@]}" --reps "${NCU_REPS:-1}" --warmup 1 --out /tmp/x.json > /tmp/ncu.csv 2>/tmp/ncu.err
  label="$m batch $b ${DTYPE:-f16} $p"
  if [ "${DRAM:-0}" = 1 ]; then
    python3 scripts/gpu/ncu_replay_metrics.py /tmp/ncu.csv "$k" "$label" >> "$C" 2>&1 || tail -5 /tmp/ncu.err >> "$C"
  else
    python3 scripts/gpu/ncu_last_replay.py /tmp/ncu.csv "$k" "$label" >> "$C"
  fi
done
cat "$C"
