#!/usr/bin/env bash
# DeiT-B next to its best PyTorch peers in one call (the whole-model speed issue's closest cell:
# dense at batch 256 against torch.compile max-autotune), from the repo root, with .gpu/ carried
# (scripts/gpu/bundle.sh; needs bench, test-attention, test-paths_agreement).
#   STEPS (default "checks ours peers max ours2")
#   checks  test-attention (default kernels), paths at DeiT-B (batch 32: fc1 on the large CUTLASS
#           kernel), f16
#   ours    bench DeiT-B, f16, batch 64/256, dense / Threshold-L2 / EViT fixed, ragged (ours2: the
#           same again after the peers, so drift between the two shows)
#   peers   timm_deit.py DeiT-B at 64/256: eager, CUDA graph, compile reduce-overhead
#   max     timm_deit.py DeiT-B at MAX_BATCH (256): compile max-autotune
set -u
stages=${STEPS:-checks ours peers max ours2}
. scripts/gpu/lib.sh
unpack bench test-attention test-paths_agreement
L="$out/deit-b-vs-peers.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$L"
if has checks; then
  {
    echo "== test-attention"; $B/test-attention --test-threads=1 2>&1 | grep -E -A2 "test result|panicked"
    echo "== paths deit-base (cuda, batch 32)"
    PATHS_DEVICE=cuda PATHS_MODELS=deit-base PATHS_BATCH=32 $B/test-paths_agreement --ignored --test-threads=1 2>&1 | grep -E "test result|panicked"
  } >> "$L" 2>&1
fi
ours() { step "bench $1" 120 $B/bench --device cuda --models deit-base --dtype f16 --batch 64,256 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$out/ours-$1.json" > /dev/null 2>&1; }
has ours && ours 1
has peers && step peers 200 env PYTHONUNBUFFERED=1 python3 scripts/peers/timm_deit.py --out "$out/peers-ro.json" --models deit-base --batch 64,256 --reps 20 --budget-s 150 > "$out/peers-ro.log" 2>&1
has max && step max 200 env PYTHONUNBUFFERED=1 python3 scripts/peers/timm_deit.py --out "$out/peers-max.json" --models deit-base --batch "${MAX_BATCH:-256}" --compile max > "$out/peers-max.log" 2>&1
has ours2 && ours 2
tail -8 "$out/peers-ro.log" "$out/peers-max.log" >> "$L" 2>/dev/null
cat "$L"
