#!/usr/bin/env bash
# Experiment (a throwaway build with docs/benchmarks/history/stop52-trace.patch applied): per-CTA
# %globaltimer marks of DeiT-S's batch-1 kernels (thin GEMM, fc2 + norm1, attention + proj +
# norm2) in one graph replay, three replays, dense and Threshold-L2 fixed, f16; the raw records
# and trace_deit_s_b1.py's per-launch table. Needs .gpu/bench.xz built with the patch.
set -u
. scripts/gpu/lib.sh
unpack bench
start_log trace-deit-s-b1.txt
FASTPATH_TRACE=1 timeout 200 $B/bench --device cuda --models deit-small --dtype f16 --batch 1 \
  --pruners none,threshold-l2-fixed --paths ragged --reps 100 --graph-anatomy --out /tmp/anat.json 2>&1 \
  | grep -E "^graph|^TRACE|rror" > "$out/trace-raw.txt"
grep -E "^graph|rror" "$out/trace-raw.txt" >> "$C"
for r in 0 1 2; do python3 scripts/gpu/probes/trace_deit_s_b1.py "$out/trace-raw.txt" "deit-small F16 b1 dense" $r >> "$C" 2>&1; done
python3 scripts/gpu/probes/trace_deit_s_b1.py "$out/trace-raw.txt" "deit-small F16 b1 threshold-l2 fixed ragged" 1 >> "$C" 2>&1
gzip -f "$out/trace-raw.txt"
cat "$C"
