#!/usr/bin/env bash
# Levers 27 and 28 on the GPU machine, from the repo root (as run in stop 19 on 84b5356; both were
# reverted after it, so on a later bundle the switch and the attention change are gone). Two bundles:
#   .gpu/*.xz                     this change (scripts/gpu/bundle.sh): bench, bench-attention,
#                                 test-attention, test-linear, test-graph, test-paths_agreement
#   .gpu-prev/bench-prev.xz       main before it (same defaults otherwise), and
#   .gpu-prev/bench-attention-prev.xz
# Lever 27: fc1 (bias + GELU) of small problems on CUTLASS 64-row tiles (CANDLE_FASTPATH_CUTLASS_SMALL
# = off | 64x64 | 64x128, the default) instead of cuBLASLt + the GELU pass.
# Lever 28: the attention kernels scale scores inside the exponent (one FFMA) and rescale O only
# when a row's maximum grew by more than 2^8 (prev binary vs this one).
# Arms of the e2e stage: prev (the previous binary), l28 (this binary, small kernel off: lever 28
# alone), s64 and s128 (levers 27 and 28).
# STAGES (default "checks attn ncu"; "e2e" is the second call):
#   checks  test-attention (all three kernels), memcheck + racecheck over its odd-length, key-part,
#           scale and boundary tests; test-linear through each CUTLASS kernel and memcheck;
#           test-graph; paths at DeiT-S (default switches)
#   attn    bench-attention prev / new, interleaved, twice (ATTN_ARGS replaces the grid); GPU-time
#           ratios per row
#   ncu     per-kernel time of one dense DeiT-S forward at batch 1 and 8 per lever-27 arm, and the
#           attention kernel's instructions and time prev / new at 12 heads, batch 256, keep 0.7
#   e2e     bench dense / Threshold-L2 fixed / EViT fixed, T/S/B, f16, per arm, twice (E2E_ARGS
#           replaces the models / batches)
set -u
stages=${STAGES:-checks attn ncu}
. scripts/gpu/lib.sh
unpack
unpack_prev bench bench-attention || exit 1
start_log levers-27-28.txt
if has checks; then
  for a in default k64 tiled; do
    echo "== test-attention ($a)" >> "$C"
    case $a in k64) v="CANDLE_RAGGED_RESIDENT=k64";; tiled) v="CANDLE_RAGGED_ATTENTION=tiled";; *) v="X=1";; esac
    env $v $B/test-attention --test-threads=1 2>&1 | grep -E "test result|panicked|got" | head -5 >> "$C"
  done
  echo "== memcheck test-attention" >> "$C"
  compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-attention --test-threads=1 odd_lengths key_parts resident_and_tiled negative_and_zero large_logits 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  echo "== racecheck test-attention" >> "$C"
  compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-attention --test-threads=1 key_parts resident_and_tiled negative_and_zero 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" >> "$C"
  for s in off 64x64 64x128; do
    echo "== test-linear (CANDLE_FASTPATH_CUTLASS=1, _SMALL=$s)" >> "$C"
    CANDLE_FASTPATH_CUTLASS=1 CANDLE_FASTPATH_CUTLASS_SMALL=$s $B/test-linear --test-threads=1 2>&1 | grep -E "test result|panicked|got" | head -5 >> "$C"
  done
  for s in 64x64 64x128; do
    echo "== memcheck test-linear (_SMALL=$s)" >> "$C"
    CANDLE_FASTPATH_CUTLASS_SMALL=$s compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-linear --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  done
  echo "== racecheck test-linear (CUTLASS: _SMALL=64x128 and, forced, the large kernel)" >> "$C"
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-linear --test-threads=1 matches_reference 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" >> "$C"; echo "rc=$?" >> "$C"
  CANDLE_FASTPATH_CUTLASS=1 CANDLE_FASTPATH_CUTLASS_SMALL=off timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-linear --test-threads=1 matches_reference 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" >> "$C"; echo "rc=$?" >> "$C"
  echo "== test-graph" >> "$C"
  $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "== paths deit-small (batch 32) and deit-tiny (batch 8)" >> "$C"
  PATHS_DEVICE=cuda PATHS_MODELS=deit-small PATHS_BATCH=32 $B/test-paths_agreement --ignored --test-threads=1 > "$out/paths-s.log" 2>&1; echo "paths S rc=$?" >> "$C"
  PATHS_DEVICE=cuda PATHS_MODELS=deit-tiny PATHS_BATCH=8 $B/test-paths_agreement --ignored --test-threads=1 > "$out/paths-t.log" 2>&1; echo "paths T rc=$?" >> "$C"
  grep -hE "test result" "$out"/paths-*.log >> "$C"
fi
attn_run() {
  local bin=$B/bench-attention; [ $1 = prev ] && bin=$B/bench-attention-prev
  $bin ${ATTN_ARGS:---heads 12,6,3 --batch 1,8,64,256 --keep 1.0,0.7 --dtype f16 --host-calls 200} --out "$2"
}
has attn && ARMS="prev new" ab_rounds attn attn_run --attn
if has ncu; then
  for s in ${NCU_ARMS:-off 64x128 64x64}; do
    for b in ${NCU_BATCH:-1 8}; do
      CANDLE_FASTPATH_CUTLASS_SMALL=$s ncu --metrics gpu__time_duration.sum --csv --print-units base $B/bench --device cuda --models deit-small --dtype f16 --batch $b --pruners none --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
      python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "DeiT-S batch $b f16, _SMALL=$s" >> "$C"
    done
  done
  for a in prev new; do
    bin=$B/bench-attention; [ $a = prev ] && bin=$B/bench-attention-prev
    echo "== ncu attention $a (12 heads, batch 256, keep 0.7, f16)" >> "$C"
    ncu --kernel-name regex:ragged_attn_resident --launch-skip 20 --launch-count 1 \
      --metrics gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,sm__inst_executed.sum,smsp__average_warp_latency_issue_stalled_long_scoreboard,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active \
      $bin --heads 12 --batch 256 --keep 0.7 --dtype f16 --host-calls 10 --gpu-reps 3 --out /tmp/x.json 2>/dev/null \
      | grep -E "gpu__time|warps_active|registers|inst_executed|long_scoreboard|pipe" >> "$C"
  done
fi
e2e_run() {
  local bin=$B/bench v="X=1"
  case $1 in prev) bin=$B/bench-prev;; l28) v="CANDLE_FASTPATH_CUTLASS_SMALL=off";; s64) v="CANDLE_FASTPATH_CUTLASS_SMALL=64x64";; esac
  env $v $bin --device cuda ${E2E_ARGS:---models deit-tiny,deit-small,deit-base --batch 1,8,64,256} --dtype f16 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$2"
}
has e2e && ARMS="prev l28 s64 s128" ab_rounds e2e e2e_run
pack "levers-27-28-${stages// /-}.tgz" 'attn-*.json' 'e2e-*.json' 'paths-*.log'
cat "$C"
