#!/usr/bin/env bash
# Per-kernel time, DRAM bytes read and L2 hit rate of the last CUDA-graph replay of `bench`'s
# forwards under ncu (caches and clocks left alone): whether a replay's weights come from HBM or
# stay in L2 between replays. GEMM picks under ncu are cuBLASLt's first (its slowed eager calls
# skip lever 79's timing), so the GEMM rows are not the bench's. Needs .gpu/bench.xz; repo root.
#   FORWARDS="deit-small:1:none" scripts/gpu/ncu-replay-dram.sh
set -u
. scripts/gpu/lib.sh
unpack bench
start_log "${LOG:-ncu-replay-dram.txt}"
for spec in ${FORWARDS:-deit-small:1:none}; do
  IFS=: read -r m b p <<< "$spec"
  args=(--device cuda --models "$m" --dtype "${DTYPE:-f16}" --batch "$b" --pruners "$p" --paths ragged)
  line=$($B/bench "${args[@]}" --reps 20 --graph-anatomy --out /tmp/anat.json 2>&1 | grep "^graph" | grep -v "only" | tail -1)
  echo "$line" >> "$C"
  k=$(sed -E 's/.*: ([0-9]+) kernel,.*/\1/' <<< "$line")
  ncu --graph-profiling node --cache-control none --clock-control none \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct --csv --print-units base \
    $B/bench "${args[@]}" --reps 2 --warmup 1 --out /tmp/x.json > /tmp/ncu.csv 2>/tmp/ncu.err
  python3 scripts/gpu/ncu_replay_metrics.py /tmp/ncu.csv "$k" "$m batch $b ${DTYPE:-f16} $p" >> "$C" 2>&1 || tail -5 /tmp/ncu.err >> "$C"
done
cat "$C"
