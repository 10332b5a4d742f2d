#!/usr/bin/env bash
# Where DeiT-T's chained block kernel (candle_fastpath::attention_block, lever 65) spends a
# launch: ncu on one of its launches inside bench's batch-1 CUDA-graph replays (f16, dense),
# caches and clocks left alone (warm, boost clocks, like a replay): duration, warp states,
# issue activity; then its per-SASS-instruction stall samples (sampling every 2^5 cycles),
# summarised as the instructions with the most samples and the samples by stall reason.
# Needs .gpu/bench.xz; repo root. LAUNCH_SKIP (default 22) picks which launch.
set -u
. scripts/gpu/lib.sh
unpack bench
C="$out/ncu-block-kernel.txt"
nvidia-smi --query-gpu=name --format=csv,noheader >> "$C"
ncu --cache-control none --clock-control none --kernel-name regex:attention_block --launch-skip ${LAUNCH_SKIP:-22} --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy --section SchedulerStats --print-details all \
  $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 --pruners none --paths ragged --reps 5 --warmup 1 --out /tmp/x.json 2>&1 \
  | grep -v "^==PROF==" | grep -E "attention_block|Duration|Elapsed Cycles|SM Active|Throughput|Registers|Shared Memory|Grid Size|Block Size|Cluster|Warp Cycles|Issue|Eligible|Active Warps|Stall|Theoretical|Achieved" >> "$C"
ncu --cache-control none --clock-control none --kernel-name regex:attention_block --launch-skip ${LAUNCH_SKIP:-22} --launch-count 1 \
  --warp-sampling-interval 0 --section SourceCounters --page source --print-source sass --csv \
  $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 --pruners none --paths ragged --reps 5 --warmup 1 --out /tmp/x.json > /tmp/src.csv 2>/dev/null
echo "== source page: $(wc -l < /tmp/src.csv) lines" >> "$C"
python3 - /tmp/src.csv >> "$C" <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr_i = next((i for i, r in enumerate(rows) if "Source" in r and any("Warp Stall Sampling (All" in c for c in r)), None)
if hdr_i is None:
    print("no source table"); sys.exit()
hdr = rows[hdr_i]
src = hdr.index("Source")
allc = next(i for i, c in enumerate(hdr) if c.startswith("Warp Stall Sampling (All"))
stall_cols = [i for i, c in enumerate(hdr) if c.startswith("stall_") or c.startswith("smsp__pcsamp")]
body = [r for r in rows[hdr_i + 1:] if len(r) == len(hdr)]
num = lambda v: float(v.replace(",", "")) if v.replace(",", "").replace(".", "").isdigit() else 0.0
total = sum(num(r[allc]) for r in body)
print(f"samples {total:.0f} over {len(body)} SASS lines")
for r in sorted(body, key=lambda r: -num(r[allc]))[:30]:
    print(f"{num(r[allc]):7.0f} {100*num(r[allc])/max(total,1):5.1f}%  {r[src][:110]}")
if stall_cols:
    agg = collections.Counter()
    for r in body:
        for i in stall_cols: agg[hdr[i]] += num(r[i])
    print("by column:", ", ".join(f"{k} {v:.0f}" for k, v in agg.most_common(14)))
PY
cat "$C"
