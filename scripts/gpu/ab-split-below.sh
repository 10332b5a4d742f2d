#!/usr/bin/env bash
# Lever 109 on the GPU machine, from the repo root: the resident attention kernel's split rule.
# Without key parts, a batch gets one block per (sequence, head) whose warps walk two 16-row query
# tiles each, or, below CANDLE_RAGGED_SPLIT_BELOW warps per SM, two blocks per (sequence, head)
# and a tile per warp. The rule was 8; DeiT-T at batch 64 (3 heads, 197 tokens: 192 blocks of 7
# warps, 10 a SM) sat just above it, and lever 109 (kept) made it 11. Arms are the threshold's
# values (`default`: unset, the library's rule); `ARMS="8 default"` measures the rule of before.
# One binary. Needs .gpu/{bench,bench-attention,test-attention,test-paths_agreement}.xz.
# STAGES (default "checks attn ncu e2e"):
#   checks   test-attention per arm; memcheck of it under the largest arm; paths at DeiT-T
#            batch 64 under ARM_CHECK (default 16)
#   attn     bench-attention, heads 3 / 6 / 12, batch 8 / 64 / 256, every keep, f16, arms
#            interleaved, two rounds; per-row GPU-time ratios
#   ncu      per-kernel times of DeiT-T batch-64 forwards (dense, Threshold-L2 fixed), per arm
#   e2e      bench DeiT-T / DeiT-S batch 64, f16, dense and the fixed pruners, arms interleaved,
#            two rounds; per-row ratios
set -u
stages=${STAGES:-checks attn ncu e2e}
. scripts/gpu/lib.sh
unpack bench bench-attention test-attention test-paths_agreement
start_log split-below.txt
ARMS=${ARMS:-default 12 16 24}
V=CANDLE_RAGGED_SPLIT_BELOW
val() { [ "$1" = default ] && echo "" || echo "$1"; }
if has checks; then
  for a in $ARMS; do
    echo "== test-attention, $V=$(val $a)" >> "$C"
    env "$V=$(val $a)" timeout 300 $B/test-attention --test-threads=1 2>&1 | grep -E -A2 "test result|panicked" | head -6 >> "$C"
  done
  last=${ARMS##* }
  echo "== test-attention under memcheck, $V=$(val $last)" >> "$C"
  env "$V=$(val $last)" timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-attention --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  export "$V=${ARM_CHECK:-16}"
  echo "== model checks with $V=${!V}" >> "$C"
  paths_check deit-tiny 64 300
  unset "$V"
fi
attn_run() { env "$V=$(val $1)" timeout 200 $B/bench-attention --heads 3,6,12 --batch 8,64,256 --dtype f16 --host-calls 200 --gpu-reps 100 --out "$2"; }
has attn && ab_rounds attn attn_run --attn
if has ncu; then
  for a in $ARMS; do for p in none threshold-l2-fixed; do
    ncu_forward "$V=$(val $a)" "deit-tiny batch 64 f16 $p, $V=$(val $a), warm, boost clocks" \
      --models deit-tiny --dtype f16 --batch 64 --pruners $p
  done; done
fi
e2e_run() { env "$V=$(val $1)" timeout 250 $B/bench --device cuda --models deit-tiny,deit-small --dtype f16 --batch 64 \
  --pruners none,threshold-l2-fixed,evit-fixed,dynamicvit-fixed --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds e2e e2e_run
pack split-below-json.tgz 'attn-*.json' 'e2e-*.json'
cat "$C"
