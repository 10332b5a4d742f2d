#!/usr/bin/env bash
# Lever 113 on the GPU machine, from the repo root: the LayerNorm kernel with a row to a group of
# 8 or 16 lanes (rows of up to 24 / 48 16-byte vectors: DeiT-T's and DeiT-S's widths in 16-bit
# storage) against one warp a row (`CANDLE_FASTPATH_LN_CHUNKS=warp`, the kernels before it). Same
# bits by construction (test-norm's grouped_rows_equal_one_warp_rows_bit_for_bit). One binary.
# Needs .gpu/{bench,test-norm,test-paths_agreement}.xz.
# STAGES (default "checks replay e2e"):
#   checks  test-norm and its memcheck; paths at DeiT-T batch 64
#   replay  one graph replay's kernels (ncu, warm, boost) per arm: DeiT-T batch 64 Threshold-L2
#           fixed, DeiT-S batch 64 dense
#   e2e     bench T / S / B, batch 64 / 256 (E2E_BATCH), f16, dense and Threshold-L2 / EViT fixed,
#           ragged path, arms interleaved, two rounds; per-row ratios
set -u
stages=${STAGES:-checks replay e2e}
. scripts/gpu/lib.sh
unpack bench test-norm test-paths_agreement
start_log layer-norm-groups.txt
ARMS=${ARMS:-warp default}
V=CANDLE_FASTPATH_LN_CHUNKS
val() { [ "$1" = default ] && echo "" || echo "$1"; }
if has checks; then
  tests_memcheck norm
  paths_check deit-tiny 64 300
fi
has replay && replay_arms "$V" "$ARMS" "deit-tiny:64:threshold-l2-fixed deit-small:64:none" "layer_norm"
e2e_run() { env "$V=$(val $1)" timeout 280 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 \
  --batch "${E2E_BATCH:-64,256}" --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds e2e e2e_run
pack layer-norm-groups-json.tgz 'e2e-*.json'
cat "$C"
