#!/usr/bin/env bash
# What bounds the ragged-attention issue's dispatch target (host ≤ 5 µs per call), on the GPU
# machine, from the repo root, in one call: the driver's own per-call costs on this host
# (scripts/gpu/probes/dispatch_floor.cu: cuLaunchKernel, stream-ordered alloc + free, cudarc's
# event bookkeeping), then bench-attention's host loop for ragged attention and candle_affine
# with event tracking on and off, then the probe again (the host drifts). Needs
# .gpu/bench-attention.xz.
set -u
. scripts/gpu/lib.sh
unpack bench-attention
C="$out/dispatch-floor.txt"
build_probe dispatch_floor
echo "== probe" >> "$C"
/tmp/dispatch_floor >> "$C" 2>&1
for tracking in true false; do
  echo "== bench-attention host loop, event tracking $tracking" >> "$C"
  timeout 200 $B/bench-attention --heads 3,12 --batch 1,8 --keep 1.0,0.7 --dtype f16 --host-calls 2000 \
    --gpu-reps 20 --event-tracking $tracking --out "$out/dispatch-attn-$tracking.json" > /dev/null 2>&1
  python3 - "$out/dispatch-attn-$tracking.json" >> "$C" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f'candle_affine: host {d["candle_affine"]["host_us"]:.2f} us')
for r in d["rows"]:
    if r["method"] == "ragged":
        print(f'ragged heads {r["heads"]:>2} batch {r["batch"]} keep {r["keep"]}: host {r["host_us"]:.2f} us ({r["host_vs_affine"]:.2f}x affine)')
PY
done
echo "== probe, again" >> "$C"
/tmp/dispatch_floor >> "$C" 2>&1
cat "$C"
