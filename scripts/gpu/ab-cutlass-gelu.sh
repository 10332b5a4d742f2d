#!/usr/bin/env bash
# Lever 18 on the GPU machine (bundle from scripts/gpu/bundle.sh; .gpu/ carried; run from the repo root):
# fc1 as CUTLASS's Hopper GEMM with the exact GELU in its epilogue vs cuBLASLt + the GELU kernel.
#   CANDLE_FASTPATH_CUTLASS_ROWS=N sends f16/bf16 fc1 problems of >= N rows to CUTLASS (unset: none).
# 1. correctness: test-linear with every GELU case on CUTLASS (ROWS=1), memcheck over it, paths at DeiT-S;
# 2. speed: bench, dense / Threshold-L2 fixed / EViT fixed, T/S/B, f16, off / on / off / on;
# 3. ncu: per-kernel times of one DeiT-S batch-256 dense forward each way.
# STAGES="checks e2e ncu" (default all three; split them over two device calls if 600 s is short).
# Only bench, test-linear and test-paths_agreement are needed: remove the other .gpu/*.xz so the
# carried tree stays under 64 MiB.
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
nvidia-smi --query-gpu=name --format=csv,noheader > "$C"
if has checks; then
echo "== test-linear, every GELU case on CUTLASS" >> "$C"
CANDLE_FASTPATH_CUTLASS_ROWS=1 $B/test-linear --test-threads=1 2>&1 | grep -E "test result|panicked|got" | head -20 >> "$C"
CANDLE_FASTPATH_CUTLASS_ROWS=1 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-linear --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
echo "== paths deit-small, CUTLASS from 1 row" >> "$C"
CANDLE_FASTPATH_CUTLASS_ROWS=1 PATHS_DEVICE=cuda PATHS_MODELS=deit-small PATHS_BATCH=32 $B/test-paths_agreement --ignored --test-threads=1 --nocapture > /tmp/paths.log 2>&1; echo "paths rc=$?" >> "$C"
grep -E "F16|BF16|test result" /tmp/paths.log | tail -8 >> "$C"
fi
if has e2e; then
ARGS="--device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 1,8,64,256 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10"
run() { local name=$1; shift; env "$@" $B/bench $ARGS --out "$out/e2e-$name.json" > /tmp/e2e-$name.log 2>&1; echo "e2e $name rc=$?" >> "$C"; }
run off CANDLE_FASTPATH_CUTLASS_ROWS=
run on CANDLE_FASTPATH_CUTLASS_ROWS=1
run off2 CANDLE_FASTPATH_CUTLASS_ROWS=
run on2 CANDLE_FASTPATH_CUTLASS_ROWS=1
python3 - "$out" >> "$C" <<'PY'
import json, sys, os
out = sys.argv[1]
def load(n):
    d = json.load(open(os.path.join(out, f"e2e-{n}.json")))
    return {(r["model"], r["pruner"], r["batch"], r["decisions"], r["cuda_graph"]): r["latency_ms"] for r in d["rows"]}
runs = {n: load(n) for n in ("off", "on", "off2", "on2")}
print("model pruner batch decisions graph | off on off2 on2 | off/on (means)")
for k in runs["off"]:
    v = [runs[n].get(k) for n in ("off", "on", "off2", "on2")]
    if None in v: continue
    print(*k, "|", " ".join(f"{x:.3f}" for x in v), "|", f"{(v[0] + v[2]) / (v[1] + v[3]):.3f}")
PY
fi
if has ncu; then
for rows in "" 1; do
  CANDLE_FASTPATH_CUTLASS_ROWS=$rows ncu --metrics gpu__time_duration.sum --csv --print-units base $B/bench --device cuda --models deit-small --dtype f16 --batch 256 --pruners none --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
  python3 - /tmp/ncu.csv "rows=$rows" >> "$C" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr, data = rows[0], rows[1:]
ki, vi = hdr.index("Kernel Name"), hdr.index("Metric Value")
agg = collections.OrderedDict()
for r in data:
    a = agg.setdefault(r[ki][:70], [0, 0.0]); a[0] += 1; a[1] += float(r[vi].replace(",", "")) / 1000
print("== ncu DeiT-S b256 dense", sys.argv[2], "kernels", len(data), "sum us", round(sum(v[1] for v in agg.values()), 1))
for k, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:10]:
    print(f"{n:5d} {t:9.1f} us {t/n:8.2f} avg  {k}")
PY
done
fi
cat "$C"
