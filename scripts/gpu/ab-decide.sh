#!/usr/bin/env bash
# Levers 31-32 on the GPU machine, from the repo root: select_by_rule's decide kernel, two
# binaries: .gpu/bench.xz (new) against .gpu/bench-prev.xz (prev). Lever 31 (d98101f against
# d8f7c33): 1024 threads, the ordered f64 sums over arrays gathered in parallel. Lever 32 (against
# d98101f): ranks counted by split threads and only where a rule needs them, the threshold
# fallback by a block argmax, slots by a block scan. Lever 34 (584f676 against 301d218): the
# mass share's two ordered passes as one chain of running sums and a parallel search. Lever 110
# (against 3d5a93d): ranks from one 64-bit key per patch (sort key and position packed), a warp
# of 32 patches against broadcast keys. Lever 112 (not kept; docs/benchmarks/history/
# lever112-blocked-scan.patch): the rules' f64 sums as warp scans in chunks of 32, host and device
# alike. Lever 118 (against 18caef8): warp-shuffle reductions of block_min / block_best's partials,
# ATS's f64 total beside the ranking, the slots' scan by one warp beside the fused-row total. The
# bundle of all six executables passes the device tool's 64 MiB: run `checks` with the tests
# (bundle.sh select_rule select_bounded select paths_agreement) and `ncu e2e` with bench and
# bench-prev in separate calls.
# STAGES (default "checks ncu e2e"):
#   checks  the selection tests on the new bundle, memcheck over them, racecheck of the rule tests
#   ncu     decide / gather kernel times per pruner (ncu-decide.sh's runs), each binary
#   e2e     bench, every pruner (or PRUNERS), ragged path, T/S/B (or MODELS), batch 1/8, f16, arms
#           interleaved, twice
set -u
stages=${STAGES:-checks ncu e2e}
. scripts/gpu/lib.sh
unpack bench bench-prev test-select_rule test-select_bounded test-select test-paths_agreement
start_log decide.txt
ARMS=${ARMS:-prev new}
bin_of() { if [ "$1" = prev ]; then echo bench-prev; else echo bench; fi; }
if has checks; then
  for t in select_rule select_bounded select; do
    echo "== test-$t" >> "$C"
    timeout 120 $B/test-$t --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-$t --test-threads=1 2>&1 | grep -E "ERROR SUMMARY" >> "$C"
  done
  echo "== racecheck test-select_rule every_rule_once, test-select_bounded many_sequences" >> "$C"
  timeout 200 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-select_rule --test-threads=1 every_rule_once 2>&1 | grep -E "RACECHECK SUMMARY|test result" >> "$C"
  timeout 100 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-select_bounded --test-threads=1 many_sequences 2>&1 | grep -E "RACECHECK SUMMARY|test result" >> "$C"
  echo "== paths (cuda, T/S/B, batch 32)" >> "$C"
  PATHS_DEVICE=cuda PATHS_MODELS=deit-tiny,deit-small,deit-base PATHS_BATCH=32 timeout 200 $B/test-paths_agreement --ignored --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
fi
if has ncu; then
  for a in $ARMS; do
    echo "== ncu, arm $a" >> "$C"
    OUT=$out/ncu-$a BENCH=$(bin_of $a) RUNS="deit-small:1:ats-fixed deit-small:1:evit-adaptive deit-small:1:threshold-l2-adaptive deit-small:8:ats-fixed" \
      bash scripts/gpu/ncu-decide.sh 2>&1 | grep -E "^==|decide|gather|offsets" >> "$C"
  done
fi
e2e_run() { $B/$(bin_of $1) --device cuda --models ${MODELS:-deit-tiny,deit-small,deit-base} --dtype f16 --batch 1,8 --pruners ${PRUNERS:-none,threshold-l2,dynamicvit,evit,ats} --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds e2e e2e_run
pack decide-json.tgz 'e2e-*.json'
cat "$C"
