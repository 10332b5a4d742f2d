#!/usr/bin/env bash
# Lever 24 on the GPU machine: the resident attention kernel's A/B candidates
# (CANDLE_RAGGED_RESIDENT; kernels/ragged_attention.cu) against the kernel of before, one bundle
# (scripts/gpu/bundle.sh from branch lever23-fc1-cluster; needs .gpu/{bench,bench-attention,
# test-attention}.xz). From the repo root.
# Arms: base (64-key steps, 128 registers, 2 blocks per SM) / k32 (32-key steps) / k32b3 (32-key
# steps capped for 3 blocks per SM: 80 registers, 40 bytes spilled).
# As run (stop 18) on binaries from 45e60ba, where those were the variant names. k32b3 won and is
# now the default; k32 is gone and the old kernel is CANDLE_RAGGED_RESIDENT=k64, so on a newer
# bundle run it with ARMS="k64 default" (var() maps any other name to the default kernel).
# SWITCH names another variable for the arms (default CANDLE_RAGGED_RESIDENT; an arm `default`
# leaves it empty, the library's default). Lever 135 (stop 55), call 1: ARMS="default pair
# pair128" on the kernel forced for every launch (arms since removed); call 2:
# SWITCH=CANDLE_RAGGED_PAIR_WARPS ARMS="0 default 8" (the plan's rule: never / up to 4 warps /
# always); SANITIZE_ARMS names the arms run under memcheck and racecheck. Lever 136 (stop 55) ran
# on its own script (scripts/gpu/ab-attention-pairq.sh at d3d7fec, folded in here since: its
# `paths` stage); its rule (stop 56): SWITCH=CANDLE_RAGGED_PAIRQ_PAIRS ARMS="100000 default 0".
# STAGES (default "checks attn ncu e2e"):
#   checks  test-attention per arm (lib.sh's test_arms; outputs NaN-poisoned), then per arm of
#           SANITIZE_ARMS (default k32b3) memcheck over the odd-length, key-parts, resident /
#           tiled and two-tile tests and racecheck over the last three
#   paths   padded vs ragged on the full-size models, PATHS="MODEL:BATCH ..." (default
#           "deit-small:64 deit-base:64"), default arm
#   attn    bench-attention, heads 3/6/12, batch 8/64/256, keep 1.0/0.7/0.5, f16 and bf16, arms
#           interleaved, twice; per-row base/arm GPU-time ratios (ATTN_ARGS replaces the grid;
#           the full grid takes ~250 s per run, mostly the padded method)
#   ncu     occupancy and time of the kernel per arm at 12 heads, batch 256, keep NCU_KEEP (0.7), f16
#   e2e     bench dense / Threshold-L2 fixed / EViT fixed, T/S/B, batch 64/256, f16, per arm, twice
#           (E2E_ARGS replaces the models and batches)
set -u
stages=${STAGES:-checks attn ncu e2e}
. scripts/gpu/lib.sh
unpack
start_log attention-resident.txt
ARMS=${ARMS:-base k32 k32b3}
V=${SWITCH:-CANDLE_RAGGED_RESIDENT}
var() { echo "$V=${1#default}"; }
if has checks; then
  test_arms "$V" "$ARMS" attention
  for a in ${SANITIZE_ARMS:-k32b3}; do
    echo "== memcheck test-attention ($a)" >> "$C"
    env $(var $a) compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-attention --test-threads=1 odd_lengths key_parts resident_and_tiled two_tiles 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
    echo "== racecheck test-attention ($a)" >> "$C"
    env $(var $a) compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-attention --test-threads=1 key_parts resident_and_tiled two_tiles 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" >> "$C"
  done
fi
if has paths; then
  for mb in ${PATHS:-deit-small:64 deit-base:64}; do paths_check "${mb%%:*}" "${mb##*:}" 200; done
fi
attn_run() { env $(var $1) $B/bench-attention ${ATTN_ARGS:---heads 3,6,12 --batch 8,64,256 --keep 1.0,0.7,0.5 --dtype f16,bf16} --out "$2"; }
has attn && ab_rounds attn attn_run --attn
if has ncu; then
  for a in $ARMS; do
    echo "== ncu $a (${NCU_KEEP:-0.7}: 12 heads, batch 256, keep ${NCU_KEEP:-0.7}, f16)" >> "$C"
    env $(var $a) ncu --kernel-name regex:ragged_attn_resident --launch-skip 20 --launch-count 1 \
      --metrics gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers,smsp__average_warp_latency_issue_stalled_long_scoreboard,sm__inst_executed.sum \
      $B/bench-attention --heads 12 --batch 256 --keep ${NCU_KEEP:-0.7} --dtype f16 --host-calls 10 --gpu-reps 3 --out /tmp/x.json 2>/dev/null \
      | grep -E "gpu__time|warps_active|registers|occupancy_limit|long_scoreboard|inst_executed" >> "$C"
  done
fi
e2e_run() { env $(var $1) $B/bench --device cuda ${E2E_ARGS:---models deit-tiny,deit-small,deit-base --batch 64,256} --dtype f16 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds e2e e2e_run
pack attention-resident-json.tgz 'attn-*.json' 'e2e-*.json'
cat "$C"
