#!/usr/bin/env bash
# Where select_by_rule's decide kernel spends its time at batch 1: one launch per pruner under
# ncu --set full with source counters, then the SASS instructions with the most stall samples.
# Needs .gpu/bench.xz; repo root.   RUNS="deit-small:1:evit-adaptive ..." scripts/gpu/ncu-decide-detail.sh
set -u
. scripts/gpu/lib.sh
unpack bench
start_log ncu-decide-detail.txt
for run in ${RUNS:-deit-small:1:threshold-l2-adaptive deit-small:1:evit-adaptive deit-small:1:ats-fixed}; do
  IFS=: read -r m b p <<< "$run"
  rep=/tmp/decide-$p
  ncu --set full --import-source yes --warp-sampling-interval 0 --kernel-name regex:ragged_select_decide --launch-skip 3 --launch-count 1 -f -o $rep \
    $B/bench --device cuda --models $m --dtype f16 --batch $b --pruners $p --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /dev/null 2>&1
  echo "=== $m batch $b $p" >> "$C"
  ncu -i $rep.ncu-rep --page details --section SpeedOfLight --section LaunchStats --section WarpStateStats --section Occupancy 2>&1 \
    | grep -E "Duration|Elapsed Cycles|SM Frequency|Registers|Threads|Block Size|Stall|Warp Cycles|Achieved|Theoretical Occ|Issued" | head -30 >> "$C"
  ncu -i $rep.ncu-rep --page source --print-source sass --csv 2>/dev/null > /tmp/src.csv
  cp /tmp/src.csv "$out/sass-$p.csv"
  python3 - /tmp/src.csv >> "$C" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
for i, r in enumerate(rows):
    if any("Source" == c for c in r) or any("Warp Stall Sampling (All Samples)" in c for c in r):
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
top = sorted(range(len(data)), key=lambda i: -num(data[i][si]) if len(data[i]) > si else 0)[:30]
for i in sorted(top):
    r = data[i]
    print(f"{100*num(r[si])/max(tot,1):5.1f}%  {i:5d}  {r[src][:110]}")
# Stall samples by instruction-index windows of 100 (which phase of the kernel).
win = {}
for i, r in enumerate(data):
    if len(r) > si:
        win[i // 100] = win.get(i // 100, 0) + num(r[si])
print("by window of 100 instructions:", ", ".join(f"{k*100}:{100*v/max(tot,1):.0f}%" for k, v in sorted(win.items()) if v / max(tot, 1) >= 0.02))
# SASS opcode mix of the sampled stalls.
ops = {}
for r in data:
    if len(r) > si and num(r[si]) > 0:
        t = r[src].split()
        op = next((x for x in t if not x.startswith("@")), "?").split(".")[0]
        ops[op] = ops.get(op, 0) + num(r[si])
print("by opcode:", ", ".join(f"{k}:{100*v/max(tot,1):.0f}%" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:12]))
PY
done

pack decide-sass.tgz "sass-*.csv"
cat "$C"
