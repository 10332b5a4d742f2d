#!/usr/bin/env bash
# Lever 50 on the GPU machine: the LayerNorm kernel requesting its weight and bias chunks beside
# the row (before the two reductions) against the binary before it (loaded after them). Two
# binaries, one call, from the repo root:
#   .gpu/bench.xz            this tree's bench
#   .gpu-prev/bench-prev.xz  bench built from the commit before the change
# plus .gpu/{test-norm,test-paths_agreement}.xz for the checks.
# STAGES (default "checks ab ncu"):
#   checks  test-norm and its memcheck, paths at DeiT-S (batch 32, every pruner, three dtypes)
#   ab      bench T/S/B, batch 1/8/64 (AB_BATCH), f16, dense and Threshold-L2 fixed, ragged path,
#           prev / new interleaved, twice; per-row prev/new ratios
#   ncu     the LayerNorm kernels alone, prev vs new: DeiT-S dense, batch 1 and 64, f16, eager
set -u
stages=${STAGES:-checks ab ncu}
. scripts/gpu/lib.sh
unpack bench test-norm test-paths_agreement
unpack_prev bench || exit 1
start_log layer-norm.txt
if has checks; then
  echo "== test-norm" >> "$C"; $B/test-norm --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "== memcheck test-norm" >> "$C"
  compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-norm --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  paths_check deit-small 32 300
fi
ln_run() { $(prev_or_new "$1" bench) --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch "${AB_BATCH:-1,8,64}" --pruners none,threshold-l2-fixed --paths ragged --reps 10 --out "$2"; }
ARMS="prev new"
has ab && ab_rounds ln ln_run
if has ncu; then
  for a in prev new; do
    bin=$(prev_or_new $a bench)
    for b in 1 64; do
      ncu -k regex:layer_norm --metrics gpu__time_duration.sum --csv --print-units base $bin --device cuda --models deit-small --dtype f16 --batch $b --pruners none --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
      python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "$a DeiT-S dense batch $b f16 (LayerNorm kernels only)" >> "$C"
    done
  done
fi
pack ln-json.tgz 'ln-*.json'
