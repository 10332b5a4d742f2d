#!/usr/bin/env bash
# Where the resident attention kernel spends its time at large batches: one launch per shape
# under ncu --set full with source counters (bench-attention, f16), then the warp-state summary,
# the SASS instructions with the most stall samples, and the stall reasons of those samples.
# Needs .gpu/bench-attention.xz; repo root.
#   SHAPES="12:256:1.0 3:64:0.7" BENCH=bench-attention scripts/gpu/ncu-attention-detail.sh
set -u
. scripts/gpu/lib.sh
bench=${BENCH:-bench-attention}
unpack "$bench"
start_log "ncu-attention-detail-$bench.txt"
for shape in ${SHAPES:-12:256:1.0 12:256:0.7 3:64:0.7}; do
  IFS=: read -r h b k <<< "$shape"
  rep=/tmp/attn-$h-$b-$k
  ncu --set full --import-source yes --warp-sampling-interval 0 --kernel-name regex:ragged_attn --launch-skip 20 --launch-count 1 -f -o "$rep" \
    "$B/$bench" --device cuda --heads "$h" --batch "$b" --keep "$k" --dtype f16 --host-calls 10 --gpu-reps 30 --out /tmp/x.json > /dev/null 2>&1
  echo "=== heads $h batch $b keep $k" >> "$C"
  ncu -i "$rep.ncu-rep" --page details --section SpeedOfLight --section LaunchStats --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis 2>&1 \
    | grep -E "Function Name|attn|Duration|Elapsed Cycles|SM Frequency|Registers|Block Size|Grid Size|Shared Memory Config|Dynamic Shared|Stall|Warp Cycles|Achieved|Theoretical Occ|Issued|Issue Slots|DRAM Throughput|Memory Throughput|L2 Hit|Executed Ipc|Pipe|Compute \(SM\)" | head -40 >> "$C"
  ncu -i "$rep.ncu-rep" --page raw --csv 2>/dev/null | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
if len(rows) < 3: sys.exit()
hdr, vals = rows[0], rows[2]
pairs = [(h, v) for h, v in zip(hdr, vals) if h.startswith("smsp__average_warp_latency_issue_stalled_") or h.startswith("smsp__average_warps_issue_stalled_")]
def num(x):
    try: return float(x.replace(",", ""))
    except ValueError: return 0.0
pairs = sorted(((h, num(v)) for h, v in pairs if h.endswith("_per_issue_active.ratio")), key=lambda p: -p[1])[:12]
print("stall reasons (warps per issue-active cycle):", ", ".join(f"{h.split(\"stalled_\")[1].split(\"_per\")[0]}={v:.2f}" for h, v in pairs))
' >> "$C"
  ncu -i "$rep.ncu-rep" --page source --print-source sass --csv 2>/dev/null > /tmp/src.csv
  cp /tmp/src.csv "$out/sass-attn-$h-$b-$k.csv"
  python3 - /tmp/src.csv >> "$C" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
for i, r in enumerate(rows):
    if any("Warp Stall Sampling (All Samples)" in c for c in r):
        hdr, data = r, rows[i + 1:]
        break
if hdr is None:
    print("no source page"); sys.exit()
si = next(i for i, c in enumerate(hdr) if c.startswith("Warp Stall Sampling (All"))
src = hdr.index("Source") if "Source" in hdr else 1
def num(x):
    try: return float(x.replace(",", ""))
    except ValueError: return 0.0
tot = sum(num(r[si]) for r in data if len(r) > si)
print(f"stall samples {tot:.0f}; top instructions (share, index, sass):")
top = sorted(range(len(data)), key=lambda i: -num(data[i][si]) if len(data[i]) > si else 0)[:40]
for i in sorted(top):
    r = data[i]
    print(f"{100*num(r[si])/max(tot,1):5.1f}%  {i:5d}  {r[src][:110]}")
ops = {}
for r in data:
    if len(r) > si and num(r[si]) > 0:
        t = r[src].split()
        op = next((x for x in t if not x.startswith("@")), "?").split(".")[0]
        ops[op] = ops.get(op, 0) + num(r[si])
print("by opcode:", ", ".join(f"{k}:{100*v/max(tot,1):.0f}%" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:14]))
PY
done
pack attn-sass-$bench.tgz "sass-attn-*.csv"
cat "$C"
