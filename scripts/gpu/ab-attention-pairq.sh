#!/usr/bin/env bash
# Lever 136 (stop 55, an experiment on top of lever 135) on the GPU machine, from the repo root:
# the paired attention kernel with Q staged in shared memory instead of held in registers
# (CANDLE_RAGGED_PAIRQ=16: 16-key steps under 128 registers, 16 warps a SM where lever 135's
# form holds 12), on every unsplit block (CANDLE_RAGGED_PAIR_WARPS=8: arm `pairq16`) or on the
# plan's paired blocks only (arm `pairq16r`), against the default. One bundle:
# .gpu/{test-attention,bench-attention,test-paths_agreement}.xz.
# STAGES (default "checks paths attn"):
#   checks  test-attention per arm (outputs NaN-poisoned), memcheck and racecheck of pairq16
#   paths   padded vs ragged at DeiT-S and DeiT-B batch 64 (default arm: lever 135's kernel runs
#           the pruned stages of up to 128 tokens)
#   attn    bench-attention, heads 6 / 12, batch 64 / 256, keep 1.0 / 0.7 / 0.5, f16, arms
#           interleaved, two rounds (ATTN_ARGS replaces the grid)
set -u
stages=${STAGES:-checks paths attn}
. scripts/gpu/lib.sh
unpack
start_log attention-pairq.txt
ARMS=${ARMS:-default pairq16 pairq16r}
arm_env() {
  case $1 in
    pairq16) echo "CANDLE_RAGGED_PAIR_WARPS=8 CANDLE_RAGGED_PAIRQ=16" ;;
    pairq32) echo "CANDLE_RAGGED_PAIR_WARPS=8 CANDLE_RAGGED_PAIRQ=32" ;;
    pairq16r) echo "CANDLE_RAGGED_PAIRQ=16" ;;
    *) echo "X=1" ;;
  esac
}
if has checks; then
  for a in $ARMS; do
    echo "== test-attention ($a)" >> "$C"
    env $(arm_env $a) $B/test-attention --test-threads=1 2>&1 | grep -E "test result|panicked|got" | head -5 >> "$C"
  done
  echo "== memcheck test-attention (pairq16)" >> "$C"
  env $(arm_env pairq16) compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-attention --test-threads=1 two_tiles odd_lengths 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  echo "== racecheck test-attention (pairq16)" >> "$C"
  env $(arm_env pairq16) compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-attention --test-threads=1 two_tiles 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" >> "$C"
fi
if has paths; then
  paths_check deit-small 64 150
  paths_check deit-base 64 150
fi
attn_run() { env $(arm_env $1) $B/bench-attention ${ATTN_ARGS:---heads 6,12 --batch 64,256 --keep 1.0,0.7,0.5 --dtype f16 --host-calls 200 --gpu-reps 100} --out "$2"; }
has attn && ab_rounds attn attn_run --attn
pack attention-pairq-json.tgz 'attn-*.json'
cat "$C"
