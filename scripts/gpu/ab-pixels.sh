#!/usr/bin/env bash
# Lever 114 on the GPU machine, from the repo root: `bench --pixels model` (images in the compute
# dtype, as timm's half-precision models take them and scripts/peers/timm_deit.py feeds them;
# patchify copies 16-bit pixels instead of reading f32 ones and casting) against `--pixels f32`
# (the input before it). The patch rows, and so every output, are the same bits either way.
# One binary. Needs .gpu/{bench,test-patch}.xz.
# STAGES (default "checks replay e2e"):
#   checks  test-patch (every pixel dtype → every row dtype) and its memcheck
#   replay  one graph replay's kernels (ncu, warm, boost), DeiT-T batch 64 Threshold-L2 fixed,
#           with the new default
#   e2e     bench T / S / B, batch 1 / 8 / 64 / 256 (E2E_BATCH), f16 and bf16, dense and
#           Threshold-L2 / EViT fixed, ragged path, arms interleaved, two rounds; per-row ratios
set -u
stages=${STAGES:-checks replay e2e}
. scripts/gpu/lib.sh
unpack bench test-patch
start_log pixels.txt
ARMS=${ARMS:-f32 model}
if has checks; then
  tests_memcheck patch
fi
if has replay; then
  FORWARDS="deit-tiny:64:threshold-l2-fixed" LOG=replay-pixels.txt bash scripts/gpu/ncu-graph-replay.sh > /dev/null 2>&1
  grep -E "^graph|^==|patchify" "$out/replay-pixels.txt" | head -8 >> "$C"
fi
e2e_run() { timeout 280 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16,bf16 \
  --batch "${E2E_BATCH:-1,8,64,256}" --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --pixels "$1" --out "$2"; }
has e2e && ab_rounds e2e e2e_run
pack pixels-json.tgz 'e2e-*.json'
cat "$C"
