#!/usr/bin/env bash
# The capturable pruned forward (DeiT::forward_pruned_capturable, candle_ragged::select_by_rule_bounded)
# on the GPU machine, from the repository root, with .gpu/ carried (bundle.sh): its tests, the
# sanitizers over them, full-size agreement (paths), then the end-to-end `bench` in f16, whose
# device-decided graph rows for adaptive modes and ATS are new. Results and logs go to $OUT.
#   STEPS (default "checks sanitizer paths f16")
set -u
stages=${STEPS:-checks sanitizer paths f16}
. scripts/gpu/lib.sh
unpack
L="$out/capturable.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$L"
tests="select_bounded select_rule select pack sequence_mean attention graph"
if has checks; then
  for t in $tests; do
    step "test-$t" 120 $B/test-$t --test-threads=1 >> "$out/tests.log" 2>&1
  done
  grep -E "test result|panicked|FAILED" "$out/tests.log" >> "$L"
fi
if has sanitizer; then
  for t in select_bounded pack; do
    step "memcheck $t" 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-$t --test-threads=1 >> "$out/sanitizer.log" 2>&1
  done
  step "racecheck select_bounded" 150 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-select_bounded --test-threads=1 >> "$out/sanitizer.log" 2>&1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" "$out/sanitizer.log" >> "$L"
fi
if has paths; then
  step "paths T/S/B batch 32" 220 env PATHS_DEVICE=cuda PATHS_MODELS=${PATHS_MODELS:-deit-tiny,deit-small,deit-base} PATHS_BATCH=32 \
    $B/test-paths_agreement --ignored --test-threads=1 --nocapture > "$out/paths.log" 2>&1
  grep -E "test result|panicked|capturable" "$out/paths.log" | tail -20 >> "$L"
fi
has f16 && step "bench f16" 200 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 \
  --batch ${E2E_BATCH:-1,8,64,256} --reps 10 --out "$out/h100-e2e-f16.json" > "$out/e2e-f16.log" 2>&1
pack capturable-logs.tgz tests.log sanitizer.log paths.log 'e2e-*.log'
cat "$L"
