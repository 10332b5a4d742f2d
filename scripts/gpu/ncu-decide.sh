#!/usr/bin/env bash
# Per-kernel GPU time under ncu of pruned forwards with counts from the scores (select_by_rule's
# decide / gather kernels), one pruner per ncu run so the sums do not mix. Needs .gpu/bench.xz.
#   RUNS="deit-small:1:ats-fixed ..." scripts/gpu/ncu-decide.sh
# bench: --paths ragged --cuda-graph false --warmup 1 --reps 1, so every kernel name covers two
# host-decided and two device-decided forwards; the decide, offsets and gather kernels run in the
# device-decided ones only (ncu_kernels.py halves the counts: per device forward read them as is).
set -u
. scripts/gpu/lib.sh
unpack ${BENCH:-bench}
start_log ncu-decide.txt
for run in ${RUNS:-deit-small:1:ats-fixed deit-small:1:evit-adaptive deit-small:1:threshold-l2-adaptive deit-small:1:dynamicvit-adaptive deit-small:8:ats-fixed deit-small:8:evit-adaptive}; do
  IFS=: read -r m b p <<< "$run"
  ncu --metrics gpu__time_duration.sum --csv --print-units base $B/${BENCH:-bench} --device cuda --models $m --dtype ${DTYPE:-f16} \
    --batch $b --pruners $p --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
  python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "$m batch $b $p ${DTYPE:-f16}" >> "$C"
done
cat "$C"
