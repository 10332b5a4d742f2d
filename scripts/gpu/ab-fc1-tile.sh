#!/usr/bin/env bash
# Lever 26 on the GPU machine: fc1's CUTLASS kernel (Φ GELU) in other shapes, against the kept
# 128 x 256 cooperative kernel, one bundle (scripts/gpu/bundle.sh; needs .gpu/{bench,test-linear}.xz).
# From the repo root. Arms (CANDLE_FASTPATH_CUTLASS_TILE): base / epi64 (128 x 64 epilogue
# subtiles) / pingpong (64 x 256 ping-pong tiles) / pingpong-epi64.
# As run (stop 18) on the bundle of the A/B candidates. epi64 won and is now the default; the
# ping-pong kernels are gone and lever 18's subtiles are CANDLE_FASTPATH_CUTLASS_TILE=epi32, so on
# a newer bundle run it with ARMS="epi32 default" (any other value selects the default kernel).
# STAGES (default "ncu e2e checks"):
#   ncu     fc1's kernel time per arm, one dense forward, DeiT-B and DeiT-S, batch 256, f16
#   e2e     bench dense / Threshold-L2 fixed, DeiT-S and DeiT-B, batch 64/256, f16, arms
#           interleaved, twice; per-row base/arm latency ratios
#   checks  test-linear with every eligible fc1 forced through CUTLASS, per arm
set -u
stages=${STAGES:-ncu e2e checks}
. scripts/gpu/lib.sh
unpack
start_log fc1-tile.txt
ARMS=${ARMS:-base epi64 pingpong pingpong-epi64}
if has ncu; then
  for a in $ARMS; do
    for m in deit-base deit-small; do
      echo "== ncu fc1 $a $m batch 256 f16" >> "$C"
      CANDLE_FASTPATH_CUTLASS_TILE=$a ncu -k regex:device_kernel --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,launch__block_size --csv --print-units base \
        $B/bench --device cuda --models $m --dtype f16 --batch 256 --pruners none --paths ragged --reps 1 --warmup 0 --cuda-graph false --out /tmp/x.json 2>/dev/null \
        | python3 -c '
import csv, sys, collections
rows = [r for r in csv.reader(sys.stdin) if len(r) > 10]
hdr, data = rows[0], rows[1:]
ni, vi = hdr.index("Metric Name"), hdr.index("Metric Value")
agg = collections.defaultdict(list)
for r in data:
    agg[r[ni]].append(float(r[vi].replace(",", "")))
t = agg["gpu__time_duration.sum"]
regs, grid, block = (agg[k][0] for k in ("launch__registers_per_thread", "launch__grid_size", "launch__block_size"))
print(f"  {len(t)} launches, mean {sum(t) / len(t) / 1000:.1f} us; registers {regs:.0f}, grid {grid:.0f}, block {block:.0f}")' >> "$C" 2>&1
    done
  done
fi
e2e_run() { CANDLE_FASTPATH_CUTLASS_TILE=$1 $B/bench --device cuda --models deit-small,deit-base --dtype f16 --batch 64,256 --pruners none,threshold-l2-fixed --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds e2e e2e_run && pack fc1-tile-e2e-json.tgz 'e2e-*.json'
if has checks; then
  for a in $ARMS; do
    [ "$a" = base ] && continue
    echo "== test-linear (CUTLASS forced, $a)" >> "$C"
    CANDLE_FASTPATH_CUTLASS=1 CANDLE_FASTPATH_CUTLASS_TILE=$a $B/test-linear --test-threads=1 matches_reference column_slices 2>&1 | grep -E "test result|panicked|got" | head -5 >> "$C"
  done
fi
cat "$C"
