#!/usr/bin/env bash
# Lever 56 on the GPU machine: the copies around a CUDA graph replay (the input into the graph's
# buffer; the outputs, captured in the graph) by our copy kernel on the SMs against a copy-engine
# cuMemcpyDtoDAsync, one binary (CANDLE_FASTPATH_COPY=memcpy vs the default). Not kept: the
# switch and the kernel exist only with docs/benchmarks/history/lever56-copy-kernel.patch applied
# (without it both arms run the memcpy). Needs .gpu/{bench,test-graph,test-paths_agreement}.xz;
# repo root.
# STAGES (default "checks e2e"):
#   checks  test-graph with either copy, its memcheck, paths at DeiT-S (batch 32)
#   e2e     bench T/S/B, batch AB_BATCH (default 1,8,64,256), f16, PRUNERS (default dense,
#           Threshold-L2 and EViT fixed, Threshold-L2 adaptive), ragged path, arms interleaved,
#           twice; per-row ratios (graph rows are the ones that copy)
set -u
stages=${STAGES:-checks e2e}
. scripts/gpu/lib.sh
unpack bench test-graph test-paths_agreement
start_log copy.txt
if has checks; then
  for a in memcpy kernel; do
    echo "== test-graph (CANDLE_FASTPATH_COPY=$a)" >> "$C"
    CANDLE_FASTPATH_COPY=$a timeout 120 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  done
  echo "== memcheck test-graph" >> "$C"
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-graph --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  paths_check deit-small 32 200
fi
ARMS=${ARMS:-memcpy kernel}
copy_run() { CANDLE_FASTPATH_COPY=$1 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch "${AB_BATCH:-1,8,64,256}" --pruners "${PRUNERS:-none,threshold-l2-fixed,evit-fixed,threshold-l2-adaptive}" --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds copy copy_run
pack copy-json.tgz 'copy-*.json'
cat "$C"
