#!/usr/bin/env bash
# Lever 52 on the GPU machine: the resident attention kernel's key-part merge spread over every
# part (part y merges the 8-column n-tiles y, y + P, ... of all parts) instead of part 0 merging
# all of them while the other warps have left. Two binaries of each tool, one call, repo root:
#   .gpu/{bench,bench-attention}.xz                       docs/benchmarks/history/
#                                                         lever52-merge-over-parts.patch applied
#                                                         (not kept: no gain, docs/LEVERS.md)
#   .gpu-prev/{bench-prev,bench-attention-prev}.xz        the commit before the change
# plus .gpu/{test-attention,test-paths_agreement}.xz.
# STAGES (default "checks attn ncu e2e"):
#   checks  test-attention (outputs poisoned), memcheck and racecheck of the key-part and odd-length
#           tests, paths at DeiT-S (batch 32)
#   attn    bench-attention heads 3/6/12, batch 1/8, keep 1.0/0.7, f16 and bf16, prev / new
#           interleaved, twice; per-row GPU-time ratios
#   ncu     the attention kernel at DeiT-S's batch-1 shape (6 heads), prev vs new, warm caches
#   e2e     bench T/S/B, batch 1/8, f16, dense and Threshold-L2 fixed, prev / new, twice
set -u
stages=${STAGES:-checks attn ncu e2e}
. scripts/gpu/lib.sh
unpack bench bench-attention test-attention test-paths_agreement
unpack_prev bench bench-attention || exit 1
start_log merge.txt
if has checks; then
  echo "== test-attention" >> "$C"
  timeout 300 $B/test-attention --test-threads=1 2>&1 | grep -E -A3 "test result|panicked|FAIL" | head -20 >> "$C"
  echo "== memcheck / racecheck test-attention (key parts, odd lengths)" >> "$C"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-attention --test-threads=1 key_parts odd_lengths 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-attention --test-threads=1 key_parts 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" >> "$C"
  paths_check deit-small 32 300
fi
attn_run() { $(prev_or_new "$1" bench-attention) --heads 3,6,12 --batch 1,8 --keep 1.0,0.7 --dtype f16,bf16 --host-calls 200 --gpu-reps 100 --out "$2"; }
e2e_run() { $(prev_or_new "$1" bench) --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 1,8 --pruners none,threshold-l2-fixed --paths ragged --reps 10 --out "$2"; }
ARMS="prev new"
has attn && ab_rounds attn attn_run --attn
if has ncu; then
  for a in prev new; do
    echo "== ncu attention $a, 6 heads, batch 1, keep 1.0, f16" >> "$C"
    ncu --cache-control none --clock-control none --kernel-name regex:ragged_attn --launch-skip 20 --launch-count 5 --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,sm__cycles_active.avg \
      $(prev_or_new $a bench-attention) --heads 6 --batch 1 --keep 1.0 --dtype f16 --host-calls 10 --gpu-reps 3 --out /tmp/y.json 2>/dev/null | grep -E "gpu__time|launch__|cycles" >> "$C"
  done
fi
has e2e && ab_rounds e2e e2e_run
pack merge-json.tgz 'attn-*.json' 'e2e-*.json'
cat "$C"
