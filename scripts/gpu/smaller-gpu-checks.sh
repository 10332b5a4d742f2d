#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .gpu/ carried (bundle.sh attention
# paths_agreement, or candle-fastpath's attention_norm_linear attention_lrn norm_linear
# pooled_head programmatic small_block, three at a time: each stage runs what the bundle
# holds): the choices a GPU with less shared memory a block makes, run on this one.
# CANDLE_RAGGED_GPU_SMEM_KB and CANDLE_FASTPATH_GPU_SMEM_KB lower the per-block opt-in (and a
# SM's shared memory to one KB more) that candle-ragged's attention plans and candle-fastpath's
# kernel choices read, as on compute capability 8.6 / 8.9 / 12.x (99 KB); the fallbacks they
# pick (fewer key parts, no Q staging, the tiled attention kernel; the composed ops where a fused
# kernel does not fit) then run against the same references.
#   KBS="99 64" scripts/gpu/smaller-gpu-checks.sh      # log: $OUT/smaller-gpu.txt
set -uo pipefail
. scripts/gpu/lib.sh
unpack
start_log smaller-gpu.txt
kbs=${KBS:-99 64}
t0=$SECONDS
if [[ -x $B/test-norm_linear ]]; then
  echo "== test-norm_linear (the device's own limits)" >> "$C"
  timeout 200 $B/test-norm_linear --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
fi
for kb in $kbs; do
  # candle-fastpath's kernels past a smaller GPU's shared memory: fused where they fit the
  # capped limit, refused (or the composed path) where not, as their applies checks say.
  for t in attention_norm_linear attention_lrn norm_linear pooled_head programmatic small_block; do
    [[ -x $B/test-$t ]] || continue
    echo "== test-$t, CANDLE_FASTPATH_GPU_SMEM_KB=$kb ($((SECONDS - t0)) s)" >> "$C"
    CANDLE_FASTPATH_GPU_SMEM_KB=$kb timeout 200 $B/test-$t --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  done
  [[ -x $B/test-attention ]] || continue
  echo "== test-attention, CANDLE_RAGGED_GPU_SMEM_KB=$kb ($((SECONDS - t0)) s)" >> "$C"
  CANDLE_RAGGED_GPU_SMEM_KB=$kb timeout 200 $B/test-attention --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
done
first=${kbs%% *}
if [[ -x $B/test-attention ]]; then
  echo "== test-attention under memcheck, CANDLE_RAGGED_GPU_SMEM_KB=$first ($((SECONDS - t0)) s)" >> "$C"
  CANDLE_RAGGED_GPU_SMEM_KB=$first timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
    $B/test-attention --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
fi
if [[ -x $B/test-paths_agreement ]]; then
  export CANDLE_RAGGED_GPU_SMEM_KB=$first CANDLE_FASTPATH_GPU_SMEM_KB=$first
  echo "== both crates capped at $first KB ($((SECONDS - t0)) s)" >> "$C"
  paths_check "${PATHS_MODELS:-deit-tiny,deit-small,deit-base}" "${PATHS_BATCH:-8}" 240
  graphs_check 200
fi
echo "total $((SECONDS - t0)) s" >> "$C"
cat "$C"
