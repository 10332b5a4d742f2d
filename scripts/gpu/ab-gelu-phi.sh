#!/usr/bin/env bash
# Lever 19 on the GPU machine: the exact GELU as x·Φ(x) through the normal tail
# (kernels/gelu_phi.cuh, CANDLE_FASTPATH_GELU=phi) against 0.5·x·(1 + erff(x/√2)) (the default),
# in the GELU kernel after cuBLASLt's fc1 and in the CUTLASS fc1's epilogue.
# Bundle from scripts/gpu/bundle.sh (needs .gpu/{bench,test-linear,test-graph,test-paths_agreement}.xz);
# run from the repo root.
# STAGES (default "checks e2e ncu"):
#   checks  test-linear with phi (default rule and every fc1 forced through CUTLASS), memcheck
#           over it, test-graph, paths at DeiT-S (phi, CUTLASS forced)
#   e2e     bench dense / Threshold-L2 fixed / EViT fixed, T/S/B, batch 1/8/64/256, f16 and bf16,
#           erf and phi interleaved, twice; per-row erf/phi latency ratios
#   ncu     per-kernel times of a dense forward, erf vs phi: DeiT-S at batch 256 and 64 (fc1 on
#           CUTLASS), DeiT-T at batch 64 (cuBLASLt + the GELU kernel)
set -u
stages=${STAGES:-checks e2e ncu}
has() { [[ " $stages " == *" $1 "* ]]; }
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
B=/tmp/gpu-bin; mkdir -p $B
for f in .gpu/*.xz; do xz -dc "$f" > $B/$(basename "$f" .xz); done; chmod +x $B/*
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=/usr/local/cuda/bin:$PATH
export CANDLE_RAGGED_REQUIRE_CUDA=1
C="$out/checks.txt"
nvidia-smi --query-gpu=name --format=csv,noheader >> "$C"
if has checks; then
  for cut in default 1; do
    echo "== test-linear (CANDLE_FASTPATH_GELU=phi, CANDLE_FASTPATH_CUTLASS=$cut)" >> "$C"
    env CANDLE_FASTPATH_GELU=phi CANDLE_FASTPATH_CUTLASS=${cut/default/} $B/test-linear --test-threads=1 2>&1 | grep -E "test result|panicked|got" | head -5 >> "$C"
  done
  echo "== memcheck test-linear (phi, CUTLASS forced)" >> "$C"
  CANDLE_FASTPATH_GELU=phi CANDLE_FASTPATH_CUTLASS=1 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-linear --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  echo "== test-graph (phi)" >> "$C"
  CANDLE_FASTPATH_GELU=phi $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "== paths deit-small (phi, CUTLASS forced)" >> "$C"
  CANDLE_FASTPATH_GELU=phi CANDLE_FASTPATH_CUTLASS=1 PATHS_DEVICE=cuda PATHS_MODELS=deit-small PATHS_BATCH=32 $B/test-paths_agreement --ignored --test-threads=1 --nocapture > /tmp/paths.log 2>&1; echo "paths rc=$?" >> "$C"
  grep -E "test result" /tmp/paths.log | tail -2 >> "$C"
fi
if has e2e; then
  for r in 1 2; do
    for g in erf phi; do
      for d in f16 bf16; do
        CANDLE_FASTPATH_GELU=$g $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype $d --batch 1,8,64,256 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$out/e2e-$g-$d-$r.json" > /tmp/e2e.log 2>&1
        echo "e2e $g $d round $r rc=$?" >> "$C"
      done
    done
  done
  python3 - "$out" >> "$C" <<'PY'
import json, sys, os, glob
out = sys.argv[1]
def load(a):
    rows = {}
    for p in sorted(glob.glob(os.path.join(out, f"e2e-{a}-*.json"))):
        for r in json.load(open(p))["rows"]:
            k = (r["model"], r["dtype"], r["pruner"], r["batch"], r["decisions"], r["cuda_graph"])
            rows.setdefault(k, []).append(r["latency_ms"])
    return {k: sum(v) / len(v) for k, v in rows.items()}
erf, phi = load("erf"), load("phi")
print("model dtype pruner batch decisions graph | mean latency ms erf phi | erf/phi")
for k in erf:
    print(*k, "|", f"{erf[k]:.3f} {phi[k]:.3f}", "|", f"{erf[k] / phi[k]:.3f}")
PY
  (cd "$out" && tar czf e2e-json.tgz e2e-*.json && rm -f e2e-*.json)
fi
if has ncu; then
  for g in erf phi; do
    for mb in deit-small:256 deit-small:64 deit-tiny:64; do
      m=${mb%:*}; b=${mb#*:}
      CANDLE_FASTPATH_GELU=$g ncu --metrics gpu__time_duration.sum --csv --print-units base $B/bench --device cuda --models $m --dtype f16 --batch $b --pruners none --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
      python3 - /tmp/ncu.csv "$g $m batch $b" >> "$C" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr, data = rows[0], rows[1:]
ki, vi = hdr.index("Kernel Name"), hdr.index("Metric Value")
agg = collections.OrderedDict()
for r in data:
    a = agg.setdefault(r[ki][:70], [0, 0.0]); a[0] += 1; a[1] += float(r[vi].replace(",", "")) / 1000
print("== ncu dense f16,", sys.argv[2], "kernels", len(data), "sum us", round(sum(v[1] for v in agg.values()), 1))
for k, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:8]:
    print(f"{n:5d} {t:9.1f} us {t/n:8.2f} avg  {k}")
PY
    done
  done
fi
cat "$C"
