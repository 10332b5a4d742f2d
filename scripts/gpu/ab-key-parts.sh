#!/usr/bin/env bash
# Lever 29 on the GPU machine, from the repo root: the resident attention kernel's key parts at
# small batches, 8 warps per query tile against lever 16's 4, one bundle (needs .gpu/{bench,
# bench-attention,test-attention}.xz). As first run (stop 19), arm 8 meant "8 parts wherever they
# fit one wave of warps" (then behind CANDLE_RAGGED_KEY_PARTS=8); the kept rule allows 8 only
# within half a wave, is the default, and CANDLE_RAGGED_KEY_PARTS=4 is lever 16's rule, so on a
# later bundle run it with ARMS="4 default" (any value but 1 and 4 selects the default).
# STAGES (default "checks attn ncu e2e"):
#   checks  test-attention per arm (outputs NaN-poisoned), memcheck and racecheck of its key-part
#           and scale tests with 8 parts
#   attn    bench-attention, heads 3/6/12, batch 1/8, keep 1.0/0.7, f16 and bf16, arms
#           interleaved, twice; per-row GPU-time ratios
#   ncu     the attention kernel's time per arm, DeiT-T/S/B batch-1 shapes (3/6/12 heads, 197 tokens)
#   e2e     bench dense / Threshold-L2 / EViT fixed, T/S/B, batch 1/8, f16, per arm, twice
set -u
stages=${STAGES:-checks attn ncu e2e}
. scripts/gpu/lib.sh
unpack bench bench-attention test-attention
start_log key-parts.txt
ARMS=${ARMS:-4 8}
if has checks; then
  for a in $ARMS; do
    echo "== test-attention (CANDLE_RAGGED_KEY_PARTS=$a)" >> "$C"
    CANDLE_RAGGED_KEY_PARTS=$a $B/test-attention --test-threads=1 2>&1 | grep -E -A2 "test result|panicked" | head -6 >> "$C"
  done
  echo "== memcheck / racecheck test-attention (8 parts)" >> "$C"
  CANDLE_RAGGED_KEY_PARTS=8 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-attention --test-threads=1 key_parts negative_and_zero 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  CANDLE_RAGGED_KEY_PARTS=8 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-attention --test-threads=1 key_parts 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" >> "$C"
fi
attn_run() { CANDLE_RAGGED_KEY_PARTS=$1 $B/bench-attention --heads 3,6,12 --batch 1,8 --keep 1.0,0.7 --dtype f16,bf16 --host-calls 200 --out "$2"; }
has attn && ab_rounds attn attn_run --attn
if has ncu; then
  for a in $ARMS; do
    for h in 3 6 12; do
      echo "== ncu attention, CANDLE_RAGGED_KEY_PARTS=$a, $h heads, batch 1, keep 1.0, f16" >> "$C"
      CANDLE_RAGGED_KEY_PARTS=$a ncu --kernel-name regex:ragged_attn_resident --launch-skip 20 --launch-count 1 \
        --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size \
        $B/bench-attention --heads $h --batch 1 --keep 1.0 --dtype f16 --host-calls 10 --gpu-reps 3 --out /tmp/x.json 2>/dev/null \
        | grep -E "gpu__time|grid_size|block_size" >> "$C"
    done
  done
fi
e2e_run() { CANDLE_RAGGED_KEY_PARTS=$1 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 1,8 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds e2e e2e_run
pack key-parts-json.tgz 'attn-*.json' 'e2e-*.json'
cat "$C"
