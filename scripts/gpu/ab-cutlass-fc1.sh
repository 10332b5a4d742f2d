#!/usr/bin/env bash
# Lever 18 on the GPU machine: fc1 (bias + exact GELU) on CUTLASS vs cuBLASLt + the GELU pass.
# Bundle from scripts/gpu/bundle.sh (needs .gpu/{bench,test-linear,test-graph,test-paths_agreement}.xz;
# remove the other .gpu/*.xz so the carried tree stays under 64 MiB); run from the repo root.
#   CANDLE_FASTPATH_CUTLASS=0   never (cuBLASLt + GELU kernel: the "off" arm)
#   CANDLE_FASTPATH_CUTLASS=1   every eligible bias + GELU problem (how the tests reach it)
#   unset                       outputs of 2^24 elements and up (the default: the "on" arm)
# STAGES (default "checks e2e"):
#   checks  test-linear forced and default, memcheck over test-linear forced, test-graph forced,
#           paths at DeiT-S forced
#   e2e     bench dense / Threshold-L2 fixed / EViT fixed, T/S/B, batch 1/8/64/256, f16 and bf16,
#           off and on interleaved, twice; then per-row off/on latency ratios
set -u
stages=${STAGES:-checks e2e}
. scripts/gpu/lib.sh
unpack
start_log checks.txt
if has checks; then
  for mode in 1 default; do
    echo "== test-linear (CANDLE_FASTPATH_CUTLASS=$mode)" >> "$C"
    env CANDLE_FASTPATH_CUTLASS=${mode/default/} $B/test-linear --test-threads=1 2>&1 | grep -E "test result|panicked|got" | head -5 >> "$C"
  done
  echo "== memcheck test-linear (forced)" >> "$C"
  CANDLE_FASTPATH_CUTLASS=1 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-linear --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  echo "== test-graph (forced)" >> "$C"
  CANDLE_FASTPATH_CUTLASS=1 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "== paths deit-small (forced)" >> "$C"
  CANDLE_FASTPATH_CUTLASS=1 PATHS_DEVICE=cuda PATHS_MODELS=deit-small PATHS_BATCH=32 $B/test-paths_agreement --ignored --test-threads=1 --nocapture > /tmp/paths.log 2>&1; echo "paths rc=$?" >> "$C"
  grep -E "test result" /tmp/paths.log | tail -2 >> "$C"
fi
if has e2e; then
  for r in 1 2; do
    for a in off on; do
      for d in f16 bf16; do
        env CANDLE_FASTPATH_CUTLASS=$([ $a = off ] && echo 0) $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype $d --batch 1,8,64,256 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$out/e2e-$a-$d-$r.json" > /tmp/e2e.log 2>&1
        echo "e2e $a $d round $r rc=$?" >> "$C"
      done
    done
  done
  python3 scripts/gpu/ab_ratios.py "$out/e2e" off on >> "$C"
  pack e2e-json.tgz 'e2e-*.json'
fi
cat "$C"
