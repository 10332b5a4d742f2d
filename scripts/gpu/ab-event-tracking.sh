#!/usr/bin/env bash
# A/B on the GPU machine: cudarc's per-buffer events on vs off (candle_fastpath::track_buffer_events),
# for the dispatch cost of one ragged-attention call (issue 3's host target) and for eager forwards.
# Bundle from scripts/gpu/bundle.sh (needs .gpu/{bench,bench-attention}.xz); run from the repo root.
#   bench-attention: heads 3/6/12, batch 1/8, keep 1.0/0.7, f16 and bf16, on / off / on / off
#   bench: eager rows only (--cuda-graph false: a capture would turn tracking off in the "on" arm
#          too), batch 1/8, T/S/B, dense / Threshold-L2 fixed and adaptive / EViT fixed / ATS fixed
set -u
. scripts/gpu/lib.sh
unpack bench bench-attention
start_log summary.txt
for r in 1 2; do
  for t in true false; do
    $B/bench-attention --heads 3,6,12 --batch 1,8 --keep 1.0,0.7 --dtype f16,bf16 --event-tracking $t --out "$out/attn-$t-$r.json" > /tmp/attn.log 2>&1
    echo "bench-attention tracking=$t round $r rc=$?" >> "$C"
  done
done
for r in 1 2; do
  for t in true false; do
    $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 1,8 --pruners none,threshold-l2-fixed,threshold-l2-adaptive,evit-fixed,ats-fixed --paths ragged --reps 20 --cuda-graph false --event-tracking $t --out "$out/e2e-$t-$r.json" > /tmp/e2e.log 2>&1
    echo "bench tracking=$t round $r rc=$?" >> "$C"
  done
done
python3 - "$out" >> "$C" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
def mean(v): return sum(v) / len(v)
def attn(t):
    rows, aff = {}, []
    for p in glob.glob(os.path.join(out, f"attn-{t}-*.json")):
        j = json.load(open(p)); aff.append(j["candle_affine"]["host_us"])
        for r in j["rows"]:
            if r["method"] == "ragged":
                rows.setdefault((r["dtype"], r["heads"], r["batch"], r["keep"]), []).append(r["host_us"])
    return {k: mean(v) for k, v in rows.items()}, mean(aff)
on, aff_on = attn("true"); off, aff_off = attn("false")
print(f"candle_affine host us: tracking on {aff_on:.2f}, off {aff_off:.2f}")
print("dtype heads batch keep | ragged host us on off | on/off | off / affine(on)")
for k in sorted(on):
    print(*k, "|", f"{on[k]:.2f} {off[k]:.2f}", "|", f"{on[k] / off[k]:.2f}", "|", f"{off[k] / aff_on:.2f}")
PY
python3 scripts/gpu/ab_ratios.py "$out/e2e" true false >> "$C"
pack json.tgz 'attn-*.json' 'e2e-*.json'
cat "$C"
