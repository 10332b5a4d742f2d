#!/usr/bin/env bash
# Lever 23 on the GPU machine: fc1's CUTLASS kernel with thread-block clusters (TMA multicast of
# the weight and/or activation tiles) and other tile orders, against lever 18's 1 x 1 kernel, in
# one bundle (scripts/gpu/bundle.sh from branch lever23-fc1-cluster; needs .gpu/{bench,
# test-linear,test-graph,test-paths_agreement}.xz). From the repo root.
# Arms (CANDLE_FASTPATH_CUTLASS_CLUSTER / _RASTER / _SWIZZLE; the Φ GELU, the default, in all):
#   c11 (lever 18's kernel) / c21 / c12 / c22 / c21rm (2x1, raster along M) / c21s2 (2x1, swizzle 2)
#   and lever 25 (CANDLE_FASTPATH_CUTLASS_PLAIN: the other Linears on CUTLASS too, same size rule):
#   c21pb (2x1, qkv and the patch embedding too) / c21pa (2x1, also proj and fc2) / c22pa (2x2, all)
# At ~600 s for everything, run it as two calls: STAGES="checks ncu", then STAGES=e2e.
# STAGES (default "checks ncu e2e"):
#   checks  test-linear with every eligible fc1 forced through CUTLASS, per cluster shape, and with
#           every Linear forced (lever 25); memcheck over both at 2x1; test-graph (2x1, forced);
#           paths at DeiT-S (2x1, every Linear forced)
#   ncu     every GEMM (CUTLASS and cuBLASLt) per arm: DeiT-B and DeiT-S dense, batch 256, f16
#   e2e     bench dense / Threshold-L2 fixed / EViT fixed, T/S/B, batch 64/256, f16, arms
#           interleaved, twice; per-row c11/arm latency ratios
set -u
stages=${STAGES:-checks ncu e2e}
has() { [[ " $stages " == *" $1 "* ]]; }
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
B=/tmp/gpu-bin; mkdir -p $B
for f in .gpu/*.xz; do xz -dc "$f" > $B/$(basename "$f" .xz); done; chmod +x $B/*
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=/usr/local/cuda/bin:$PATH
export CANDLE_RAGGED_REQUIRE_CUDA=1
C="$out/fc1-cluster.txt"
nvidia-smi --query-gpu=name --format=csv,noheader >> "$C"
arm() {
  case $1 in
    c11) echo "CANDLE_FASTPATH_CUTLASS_CLUSTER=1x1" ;;
    c21) echo "CANDLE_FASTPATH_CUTLASS_CLUSTER=2x1" ;;
    c12) echo "CANDLE_FASTPATH_CUTLASS_CLUSTER=1x2" ;;
    c22) echo "CANDLE_FASTPATH_CUTLASS_CLUSTER=2x2" ;;
    c21rm) echo "CANDLE_FASTPATH_CUTLASS_CLUSTER=2x1 CANDLE_FASTPATH_CUTLASS_RASTER=m" ;;
    c21s2) echo "CANDLE_FASTPATH_CUTLASS_CLUSTER=2x1 CANDLE_FASTPATH_CUTLASS_SWIZZLE=2" ;;
    c21pb) echo "CANDLE_FASTPATH_CUTLASS_CLUSTER=2x1 CANDLE_FASTPATH_CUTLASS_PLAIN=bias" ;;
    c21pa) echo "CANDLE_FASTPATH_CUTLASS_CLUSTER=2x1 CANDLE_FASTPATH_CUTLASS_PLAIN=both" ;;
    c22pa) echo "CANDLE_FASTPATH_CUTLASS_CLUSTER=2x2 CANDLE_FASTPATH_CUTLASS_PLAIN=both" ;;
  esac
}
ARMS=${ARMS:-c11 c21 c12 c22 c21rm c21s2 c21pb c21pa c22pa}
if has checks; then
  for c in 2x1 1x2 2x2; do
    echo "== test-linear (CUTLASS forced, cluster $c)" >> "$C"
    CANDLE_FASTPATH_CUTLASS=1 CANDLE_FASTPATH_CUTLASS_CLUSTER=$c $B/test-linear --test-threads=1 matches_reference column_slices 2>&1 | grep -E "test result|panicked|got" | head -5 >> "$C"
  done
  for c in 1x1 2x1 2x2; do
    echo "== test-linear (CUTLASS forced for every Linear, cluster $c)" >> "$C"
    CANDLE_FASTPATH_CUTLASS=1 CANDLE_FASTPATH_CUTLASS_PLAIN=both CANDLE_FASTPATH_CUTLASS_CLUSTER=$c $B/test-linear --test-threads=1 matches_reference column_slices 2>&1 | grep -E "test result|panicked|got" | head -5 >> "$C"
  done
  echo "== memcheck test-linear (CUTLASS forced for every Linear, 2x1)" >> "$C"
  CANDLE_FASTPATH_CUTLASS=1 CANDLE_FASTPATH_CUTLASS_PLAIN=both CANDLE_FASTPATH_CUTLASS_CLUSTER=2x1 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-linear --test-threads=1 matches_reference 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  echo "== memcheck test-linear (CUTLASS forced, 2x1)" >> "$C"
  CANDLE_FASTPATH_CUTLASS=1 CANDLE_FASTPATH_CUTLASS_CLUSTER=2x1 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-linear --test-threads=1 column_slices 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  echo "== test-graph (CUTLASS forced, 2x1)" >> "$C"
  CANDLE_FASTPATH_CUTLASS=1 CANDLE_FASTPATH_CUTLASS_CLUSTER=2x1 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "== paths deit-small (CUTLASS forced for every Linear, 2x1)" >> "$C"
  CANDLE_FASTPATH_CUTLASS=1 CANDLE_FASTPATH_CUTLASS_PLAIN=both CANDLE_FASTPATH_CUTLASS_CLUSTER=2x1 PATHS_DEVICE=cuda PATHS_MODELS=deit-small PATHS_BATCH=32 $B/test-paths_agreement --ignored --test-threads=1 > /tmp/paths.log 2>&1; echo "paths rc=$?" >> "$C"
  grep -E "test result" /tmp/paths.log | tail -1 >> "$C"
fi
if has ncu; then
  # Every GEMM of a dense forward per arm: CUTLASS (device_kernel) and cuBLASLt (nvjet) kernels,
  # mean time per (kernel, grid) class; one forward, no warm-up.
  for a in $ARMS; do
    for m in deit-base deit-small; do
      echo "== ncu GEMMs $a $m batch 256 f16" >> "$C"
      env $(arm $a) ncu -k regex:"device_kernel|nvjet" --metrics gpu__time_duration.sum --csv --print-units base $B/bench --device cuda --models $m --dtype f16 --batch 256 --pruners none --paths ragged --reps 1 --warmup 0 --cuda-graph false --out /tmp/x.json 2>/dev/null \
        | python3 -c '
import csv, sys, collections
rows = [r for r in csv.reader(sys.stdin) if len(r) > 10]
hdr, data = rows[0], rows[1:]
ki, gi, vi = hdr.index("Kernel Name"), hdr.index("Grid Size"), hdr.index("Metric Value")
agg = collections.defaultdict(list)
for r in data:
    name = "cutlass" if "device_kernel" in r[ki] else r[ki][:40]
    agg[(name, r[gi])].append(float(r[vi].replace(",", "")) / 1000)
for (name, grid), v in sorted(agg.items(), key=lambda kv: -sum(kv[1])):
    print(f"  {len(v):3d} x {sum(v) / len(v):8.1f} us  grid {grid:16s} {name}")
print(f"  total {sum(sum(v) for v in agg.values()):.1f} us")' >> "$C"
    done
  done
fi
if has e2e; then
  for r in 1 2; do
    for a in $ARMS; do
      env $(arm $a) $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 64,256 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$out/e2e-$a-$r.json" > /dev/null 2>&1
      echo "e2e $a round $r rc=$?" >> "$C"
    done
  done
  python3 - "$out" $ARMS >> "$C" <<'PY'
import json, sys, os, glob
out, arms = sys.argv[1], sys.argv[2:]
def load(a):
    rows = {}
    for p in glob.glob(os.path.join(out, f"e2e-{a}-*.json")):
        for r in json.load(open(p))["rows"]:
            k = (r["model"], r["pruner"], r["batch"], r["decisions"], r["cuda_graph"])
            rows.setdefault(k, []).append(r["latency_ms"])
    return {k: sum(v) / len(v) for k, v in rows.items()}
data = {a: load(a) for a in arms}
base = data[arms[0]]
print("model pruner batch decisions graph | latency ms", arms[0], "|", " ".join(f"{arms[0]}/{a}" for a in arms[1:]))
for k in sorted(base):
    print(*k, "|", f"{base[k]:.3f}", "|", " ".join(f"{base[k] / data[a][k]:.3f}" for a in arms[1:]))
PY
  (cd "$out" && tar czf e2e-json.tgz e2e-*.json && rm -f e2e-*.json)
fi
cat "$C"
