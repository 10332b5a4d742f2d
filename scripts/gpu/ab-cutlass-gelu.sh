#!/usr/bin/env bash
# Lever 18 on the GPU machine (bundle from scripts/gpu/bundle.sh on this branch; .gpu/ carried; run from the repo root).
#   CANDLE_FASTPATH_CUTLASS_ROWS=N  f16/bf16 fc1 (bias + exact GELU) of >= N rows on CUTLASS (unset: none)
#   CANDLE_FASTPATH_CUTLASS_ALL=1   also the bias and bias + residual Linears (qkv, proj, fc2)
#   CANDLE_PDL=1                    programmatic dependent launch for CUTLASS and our LN / GELU / attention
# Arms: off (cuBLASLt + GELU kernel, as main) / gelu (ROWS=1) / all (ROWS=1 ALL=1) / pdl (ROWS=1 ALL=1 PDL=1).
# STAGES (default "checks e2e"; one call each if 600 s is short):
#   checks  test-linear, test-norm, test-attention, test-graph with every arm's switches on, memcheck
#           over test-linear, paths at DeiT-S with everything on
#   e2e     bench, dense / Threshold-L2 fixed / EViT fixed, T/S/B, batch 1/8/64/256, f16, each arm once
#   e2e2    the same again (a second sample of each arm), then the per-row ratios over both
#   ncu     per-kernel times of one DeiT-S batch-256 and batch-1 dense forward, off vs all
# Needs .gpu/{bench,test-linear,test-norm,test-attention,test-graph,test-paths_agreement}.xz only: remove the
# other .gpu/*.xz so the carried tree stays under 64 MiB.
set -u
stages=${STAGES:-checks e2e}
has() { [[ " $stages " == *" $1 "* ]]; }
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
B=/tmp/gpu-bin; mkdir -p $B
for f in .gpu/*.xz; do xz -dc "$f" > $B/$(basename "$f" .xz); done; chmod +x $B/*
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=/usr/local/cuda/bin:$PATH
export CANDLE_RAGGED_REQUIRE_CUDA=1
C="$out/checks.txt"
nvidia-smi --query-gpu=name --format=csv,noheader >> "$C"
ON="CANDLE_FASTPATH_CUTLASS_ROWS=1 CANDLE_FASTPATH_CUTLASS_ALL=1 CANDLE_PDL=1"
if has checks; then
  for t in test-linear test-norm test-attention test-graph; do
    echo "== $t (all on)" >> "$C"
    env $ON $B/$t --test-threads=1 2>&1 | grep -E "test result|panicked|got" | head -10 >> "$C"
  done
  echo "== test-linear (CUTLASS, no PDL)" >> "$C"
  env CANDLE_FASTPATH_CUTLASS_ROWS=1 CANDLE_FASTPATH_CUTLASS_ALL=1 $B/test-linear --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "== memcheck test-linear (all on)" >> "$C"
  env $ON compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-linear --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  echo "== paths deit-small (all on)" >> "$C"
  env $ON PATHS_DEVICE=cuda PATHS_MODELS=deit-small PATHS_BATCH=32 $B/test-paths_agreement --ignored --test-threads=1 --nocapture > /tmp/paths.log 2>&1; echo "paths rc=$?" >> "$C"
  grep -E "F16|BF16|test result" /tmp/paths.log | tail -8 >> "$C"
fi
ARGS="--device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 1,8,64,256 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10"
arm() {
  case $1 in
    off) echo "CANDLE_FASTPATH_CUTLASS_ROWS=" ;;
    gelu) echo "CANDLE_FASTPATH_CUTLASS_ROWS=1" ;;
    all) echo "CANDLE_FASTPATH_CUTLASS_ROWS=1 CANDLE_FASTPATH_CUTLASS_ALL=1" ;;
    pdl) echo "$ON" ;;
  esac
}
round() {
  for a in off gelu all pdl; do
    env $(arm $a) $B/bench $ARGS --out "$out/e2e-$a-$1.json" > /tmp/e2e-$a-$1.log 2>&1
    echo "e2e $a round $1 rc=$?" >> "$C"
  done
}
has e2e && round 1
if has e2e2; then
  round 2
  python3 - "$out" >> "$C" <<'PY'
import json, sys, os, glob
out = sys.argv[1]
def load(a):
    rows = {}
    for p in sorted(glob.glob(os.path.join(out, f"e2e-{a}-*.json"))):
        for r in json.load(open(p))["rows"]:
            k = (r["model"], r["pruner"], r["batch"], r["decisions"], r["cuda_graph"])
            rows.setdefault(k, []).append(r["latency_ms"])
    return {k: sum(v) / len(v) for k, v in rows.items()}
arms = {a: load(a) for a in ("off", "gelu", "all", "pdl")}
print("model pruner batch decisions graph | mean latency ms off | off/gelu off/all off/pdl")
for k, base in arms["off"].items():
    print(*k, "|", f"{base:.3f}", "|", " ".join(f"{base / arms[a][k]:.3f}" if k in arms[a] else "-" for a in ("gelu", "all", "pdl")))
PY
fi
if has ncu; then
  for a in off all; do
    for b in 256 1; do
      env $(arm $a) ncu --metrics gpu__time_duration.sum --csv --print-units base $B/bench --device cuda --models deit-small --dtype f16 --batch $b --pruners none --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
      python3 - /tmp/ncu.csv "$a batch $b" >> "$C" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr, data = rows[0], rows[1:]
ki, vi = hdr.index("Kernel Name"), hdr.index("Metric Value")
agg = collections.OrderedDict()
for r in data:
    a = agg.setdefault(r[ki][:70], [0, 0.0]); a[0] += 1; a[1] += float(r[vi].replace(",", "")) / 1000
print("== ncu DeiT-S dense,", sys.argv[2], "kernels", len(data), "sum us", round(sum(v[1] for v in agg.values()), 1))
for k, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:10]:
    print(f"{n:5d} {t:9.1f} us {t/n:8.2f} avg  {k}")
PY
    done
  done
fi
cat "$C"
