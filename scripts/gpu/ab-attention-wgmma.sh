#!/usr/bin/env bash
# Levers 46 / 48 on the GPU machine, from the repo root: the warpgroup-MMA attention kernel
# (kernels/ragged_attention_sm90.cu, CANDLE_RAGGED_ATTENTION=wgmma1) against the resident mma.sync
# kernel (any other value, e.g. "res"), one binary (needs .gpu/{bench-attention,test-attention}.xz;
# bench for e2e). Lever 48's arms (wgmma2 and the experiment kernels iox, io1x, iopx, cmpx, ...)
# exist only with docs/benchmarks/history/lever48-wgmma-pipelined-and-io-only.patch applied, and
# lever 49's (wgmma5 with its hang fixed, the slot-pool kernels wgmma6-9) with
# docs/benchmarks/history/lever49-wgmma-pool.patch (both levers' arms; apply one or the other).
# STAGES (default "checks attn ncu"):
#   checks  test-attention on each wgmma arm (outputs NaN-poisoned; lengths 1..256 reach the new
#           kernel, longer ones the tiled one), memcheck and racecheck of a subset on each
#   attn    bench-attention, heads 6/12, batch 8/64/256, keep 1.0/0.7/0.5, f16 and bf16 (ATTN_HEADS,
#           ATTN_BATCH, ATTN_DTYPE override), arms interleaved, twice; per-row GPU-time ratios
#   ncu     the kernel of each arm, 12 heads, batch 256, keep 1.0 and 0.7, f16
#   stalls  each arm's stall reasons under ncu (12 heads, batch 256, keep 0.7, f16)
#   source  each arm's per-SASS-instruction stall samples (ncu source page, CSV, packed)
#   e2e     bench dense / Threshold-L2 fixed, T/S/B, batch 64/256, f16, per arm, twice
set -u
stages=${STAGES:-checks attn ncu}
. scripts/gpu/lib.sh
unpack bench bench-attention test-attention
start_log wgmma.txt
ARMS=${ARMS:-res wgmma1}
if has checks; then
  for a in $ARMS; do
    [ "$a" = res ] && continue
    echo "== test-attention (CANDLE_RAGGED_ATTENTION=$a)" >> "$C"
    CANDLE_RAGGED_ATTENTION=$a timeout 300 $B/test-attention --test-threads=1 2>&1 | grep -E -A3 "test result|panicked|FAIL|worst" | head -40 >> "$C"
    echo "== memcheck / racecheck test-attention ($a)" >> "$C"
    CANDLE_RAGGED_ATTENTION=$a timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-attention --test-threads=1 odd_lengths mixed_lengths 2>&1 | grep -E "ERROR SUMMARY|test result|=====" | head -20 >> "$C"
    CANDLE_RAGGED_ATTENTION=$a timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-attention --test-threads=1 mixed_lengths 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result|=====" | head -20 >> "$C"
  done
fi
# ncu_attn ARM KEEP NCU-ARGS...: ncu over one ragged_attn launch of ARM (after 20 warm-up
# launches) at 12 heads, batch 256, keep KEEP, f16; ncu's report on stdout.
ncu_attn() {
  local arm=$1 keep=$2
  shift 2
  CANDLE_RAGGED_ATTENTION=$arm ncu --kernel-name regex:ragged_attn --launch-skip 20 --launch-count 1 "$@" \
    $B/bench-attention --heads 12 --batch 256 --keep "$keep" --dtype f16 --host-calls 10 --gpu-reps 3 --out /tmp/x.json
}
# An arm is a CANDLE_RAGGED_ATTENTION value, with ":hm" for q / k / v in the head-major layout
# (bench-attention --qkv-layout head-major) instead of views of the fused qkv projection.
attn_run() {
  local layout=fused
  [[ $1 == *:hm ]] && layout=head-major
  CANDLE_RAGGED_ATTENTION=${1%%:*} $B/bench-attention --heads "${ATTN_HEADS:-6,12}" --batch "${ATTN_BATCH:-8,64,256}" \
    --keep 1.0,0.7,0.5 --dtype "${ATTN_DTYPE:-f16,bf16}" --qkv-layout $layout --host-calls 200 --gpu-reps 100 --out "$2"
}
has attn && ab_rounds attn attn_run --attn
if has ncu; then
  for a in $ARMS; do
    for keep in 1.0 0.7; do
      echo "== ncu attention, CANDLE_RAGGED_ATTENTION=$a, 12 heads, batch 256, keep $keep, f16" >> "$C"
      ncu_attn "$a" "$keep" \
        --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers 2>/dev/null \
        | grep -E "gpu__time|registers|warps_active|issue_active|dram__|gmma|occupancy" >> "$C"
    done
  done
fi
if has stalls; then
  # Where each arm's warps wait: stall reasons per issued instruction (12 heads, batch 256, keep 0.7).
  for a in $ARMS; do
    echo "== ncu stalls, CANDLE_RAGGED_ATTENTION=$a, 12 heads, batch 256, keep 0.7, f16 (warps stalled per issue, > 0.05)" >> "$C"
    ncu_attn "$a" 0.7 \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum" 2>/dev/null \
      | awk '/gpu__time|issue_active/ {print; next} /stalled/ {v=$NF; gsub(",", "", v); if (v + 0 > 0.05) print}' >> "$C"
  done
fi
if has source; then
  # Per-SASS-instruction warp-state samples of each arm's kernel (12 heads, batch 256, keep 0.7,
  # f16), as CSV for reading off where the stalls sit.
  for a in $ARMS; do
    ncu_attn "$a" 0.7 --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
      > "$out/source-$a.csv" 2> "$out/source-$a.err"
    echo "== ncu source page, $a: rc=$? $(wc -l < "$out/source-$a.csv") lines" >> "$C"
  done
fi
e2e_run() { CANDLE_RAGGED_ATTENTION=$1 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 64,256 --pruners none,threshold-l2-fixed --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds e2e e2e_run
pack wgmma-json.tgz 'attn-*.json' 'e2e-*.json' 'source-*'
cat "$C"
