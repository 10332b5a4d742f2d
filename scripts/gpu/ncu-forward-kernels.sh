#!/usr/bin/env bash
# Per-kernel GPU time of whole dense forwards under ncu (gpu__time_duration per launch, summed by
# kernel name), for "what bounds it" in docs/BENCHMARKS.md. Needs .gpu/bench.xz; repo root.
#   FORWARDS="deit-base:256 deit-small:1" scripts/gpu/ncu-forward-kernels.sh
# bench runs one warm-up and one timed forward (--cuda-graph false), so counts and sums cover two
# forwards; the summary halves them.
set -u
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
B=/tmp/gpu-bin; mkdir -p $B; xz -dc .gpu/bench.xz > $B/bench; chmod +x $B/bench
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=/usr/local/cuda/bin:$PATH
C="$out/ncu-forward-kernels.txt"
nvidia-smi --query-gpu=name --format=csv,noheader >> "$C"
for mb in ${FORWARDS:-deit-base:256 deit-small:1}; do
  m=${mb%:*}; b=${mb#*:}
  ncu --metrics gpu__time_duration.sum --csv --print-units base $B/bench --device cuda --models $m --dtype ${DTYPE:-f16} --batch $b --pruners none --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
  python3 - /tmp/ncu.csv "$m batch $b ${DTYPE:-f16}" >> "$C" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr, data = rows[0], rows[1:]
ki, vi = hdr.index("Kernel Name"), hdr.index("Metric Value")
agg = collections.OrderedDict()
for r in data:
    a = agg.setdefault(r[ki][:80], [0, 0.0]); a[0] += 1; a[1] += float(r[vi].replace(",", "")) / 1000
total = sum(v[1] for v in agg.values())
print(f"== ncu dense, {sys.argv[2]}: per forward {len(data) // 2} kernels, {total / 2:.1f} us")
print("launches/fwd  us/fwd  us/launch  share  kernel")
for k, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
    print(f"{n / 2:8.1f} {t / 2:9.1f} {t / n:9.2f} {100 * t / total:5.1f}%  {k}")
PY
done
cat "$C"
