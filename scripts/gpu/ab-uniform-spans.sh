#!/usr/bin/env bash
# Lever 54 on the GPU machine: the attention kernels taking equal-length sequences' spans from
# their length (b · len) instead of loading cu_seqlens first, against the load, one binary
# (CANDLE_RAGGED_UNIFORM_SPANS=0 vs the default). Needs .gpu/{bench,bench-attention,test-attention,
# test-paths_agreement}.xz; repo root.
# STAGES (default "checks attn e2e ncu"):
#   checks  test-attention with the switch off and on, memcheck and racecheck of the equal-length
#           test, paths at DeiT-S (batch 32)
#   attn    bench-attention heads 3/6/12, batch 1 (the one bench-attention shape with equal
#           lengths), keep 1.0, f16 and bf16, arms interleaved, twice
#   e2e     bench T/S/B, batch AB_BATCH (default 1,8), f16, dense, Threshold-L2 and EViT fixed
#           (equal lengths after every step), ragged path, arms interleaved, twice
#   ncu     attention kernel times in a DeiT-S dense forward at batch 1, both arms
set -u
stages=${STAGES:-checks attn e2e ncu}
. scripts/gpu/lib.sh
unpack bench bench-attention test-attention test-paths_agreement
start_log uniform-spans.txt
ARMS=${ARMS:-0 1}
if has checks; then
  for a in 0 1; do
    echo "== test-attention (CANDLE_RAGGED_UNIFORM_SPANS=$a)" >> "$C"
    CANDLE_RAGGED_UNIFORM_SPANS=$a timeout 120 $B/test-attention --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  done
  echo "== memcheck / racecheck test-attention equal_lengths" >> "$C"
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-attention --test-threads=1 equal_lengths 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  timeout 200 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-attention --test-threads=1 equal_lengths 2>&1 | grep -E "RACECHECK SUMMARY|test result" >> "$C"
  paths_check deit-small 32 200
fi
attn_run() { CANDLE_RAGGED_UNIFORM_SPANS=$1 $B/bench-attention --heads 3,6,12 --batch 1 --keep 1.0 --dtype f16,bf16 --out "$2"; }
has attn && ab_rounds attn attn_run --attn
e2e_run() { CANDLE_RAGGED_UNIFORM_SPANS=$1 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch "${AB_BATCH:-1,8}" --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds e2e e2e_run
if has ncu; then
  for a in $ARMS; do
    CANDLE_RAGGED_UNIFORM_SPANS=$a CANDLE_FASTPATH_SMALL_BLOCK=0 ncu --cache-control none --clock-control none -k regex:ragged_attn --metrics gpu__time_duration.sum --csv --print-units base \
      $B/bench --device cuda --models deit-small --dtype f16 --batch 1,8 --pruners none --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
    python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "CANDLE_RAGGED_UNIFORM_SPANS=$a DeiT-S dense batch 1 and 8 f16, attention kernels, warm, boost clocks" >> "$C"
  done
fi
pack uniform-spans-json.tgz 'attn-*.json' 'e2e-*.json'
cat "$C"
