#!/usr/bin/env bash
# Where candle-ragged's select_top_k kernel waits at DeiT-T batch 1 (a Threshold-L2 / EViT fixed
# step inside bench's graph replays, f16): ncu's per-SASS-instruction warp stall samples (every
# 2^5 cycles), the 40 lines with the most samples and the code around the four hottest. PRUNERS
# (default "threshold-l2-fixed evit-fixed"). Needs .gpu/bench.xz; repo root.
set -u
. scripts/gpu/lib.sh
unpack bench
C="$out/ncu-select-source.txt"
for spec in ${PRUNERS:-threshold-l2-fixed evit-fixed}; do
echo "== ragged_select_top_k ($spec): top SASS lines by stall samples" >> "$C"
ncu --cache-control none --clock-control none --kernel-name regex:ragged_select_top_k --launch-skip 4 --launch-count 1 \
  --warp-sampling-interval 0 --section SourceCounters --page source --print-source sass --csv \
  $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 --pruners $spec --paths ragged --reps 5 --warmup 1 --out /tmp/x.json > /tmp/src.csv 2>/dev/null
python3 - /tmp/src.csv >> "$C" <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr_i = next((i for i, r in enumerate(rows) if "Source" in r and any("Warp Stall Sampling (All" in c for c in r)), None)
if hdr_i is None:
    print("no source table"); sys.exit()
hdr = rows[hdr_i]
src = hdr.index("Source")
allc = next(i for i, c in enumerate(hdr) if c.startswith("Warp Stall Sampling (All"))
body = [r for r in rows[hdr_i + 1:] if len(r) == len(hdr)]
num = lambda v: float(v.replace(",", "")) if v.replace(",", "").replace(".", "").isdigit() else 0.0
total = sum(num(r[allc]) for r in body)
print(f"samples {total:.0f} over {len(body)} SASS lines")
# cumulative by line index so the code region shows
top = sorted(enumerate(body), key=lambda t: -num(t[1][allc]))[:40]
for idx, r in top:
    print(f"{idx:5d} {num(r[allc]):7.0f} {100*num(r[allc])/max(total,1):5.1f}%  {r[src][:100]}")
# The code around the four hottest lines (the instructions just before a stall are what it waits on).
for idx, _ in top[:4]:
    print(f"-- around line {idx}")
    for k in range(max(0, idx - 14), min(len(body), idx + 3)):
        print(f"{k:5d} {num(body[k][allc]):7.0f}  {body[k][src][:100]}")
PY
done
cat "$C"
