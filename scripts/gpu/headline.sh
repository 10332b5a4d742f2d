#!/usr/bin/env bash
# The headline run on the GPU machine, from the repository root, with .gpu/ carried (bundle.sh):
# quick checks of the bundle, then the end-to-end `bench` (f16), the PyTorch peers right after it
# (same call, so the ratios in docs/BENCHMARKS.md are same-run), torch max-autotune for the cells
# named in MAX_MODELS / MAX_BATCH, then bf16 and f32. Each step has its own time limit so a slow
# one cannot eat the next; results and logs go to $OUT (or /tmp/gpu-out).
# Stop 18's run (limits 150 s peers, 130 s f32) lost the peers' last row and f32's last two rows
# to those limits (steps took: checks ~80 s, f16 43 s, max 121 s, bf16 42 s); they are now 200 s
# and 160 s, which with everything else still fits one 600 s call only if the checks are skipped
# (STEPS="f16 peers max bf16 f32") or max is.
#   STEPS (default "checks f16 peers max bf16 f32")
#   checks  test-attention (default kernels and CANDLE_RAGGED_RESIDENT=k64), memcheck over its
#           odd-length / key-part / resident-and-tiled tests, paths at DeiT-S and DeiT-B (batch 32)
#   f16 / bf16 / f32   bench --dtype <it> --batch 1,8,64,256 --reps 10, T/S/B, every pruner
#           (step limits 170 / BF16_LIMIT, default 90 s (stop 34's f16 step took 106 s: pass ~170
#           to run bf16 after f16 and the peers in one call) / F32_LIMIT, default 160 s: give f32
#           ~420 s in a call of its own)
#   peers   scripts/peers/timm_deit.py (eager, CUDA graph, compile reduce-overhead), f16
#   max     the same with --compile max for MAX_MODELS (deit-base) at MAX_BATCH (256)
#   attn    bench-attention's full table, then scripts/peers/varlen_attention.py (PyTorch's
#           FlashAttention-2 varlen and padded SDPA on the same shapes), then a copy-bandwidth
#           reading (torch, 2 GiB device-to-device, median of 10) for the floor on this GPU
#           (limit ATTN_LIMIT, default 240 s, for the first two together)
# TAG (default h100) names the output files (TAG-e2e-f16.json, TAG-peers.json, ...), for a run on
# another GPU.
# Merge afterwards: scripts/bench_tables.py reads the f16 / bf16 / f32 JSON together.
set -u
stages=${STEPS:-checks f16 peers max bf16 f32}
. scripts/gpu/lib.sh
unpack
L="$out/headline.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$L"
models=deit-tiny,deit-small,deit-base
tag=${TAG:-h100}
if has checks; then
  {
    echo "== test-attention (default)"; $B/test-attention --test-threads=1 2>&1 | grep -E "test result|panicked"
    echo "== test-attention (CANDLE_RAGGED_RESIDENT=k64)"
    CANDLE_RAGGED_RESIDENT=k64 $B/test-attention --test-threads=1 2>&1 | grep -E "test result|panicked"
    echo "== memcheck test-attention (default)"
    compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-attention --test-threads=1 odd_lengths key_parts resident_and_tiled 2>&1 | grep -E "ERROR SUMMARY|test result"
    echo "== paths deit-small, deit-base (cuda, batch 32)"
    PATHS_DEVICE=cuda PATHS_MODELS=deit-small,deit-base PATHS_BATCH=32 $B/test-paths_agreement --ignored --test-threads=1 2>&1 | grep -E "test result|panicked"
  } >> "$L" 2>&1
fi
bench() { step "bench $1" "$2" $B/bench --device cuda --models $models --dtype "$1" --batch 1,8,64,256 --reps 10 --out "$out/$tag-e2e-$1.json" > "$out/e2e-$1.log" 2>&1; }
has f16 && bench f16 170
has peers && step peers 200 env PYTHONUNBUFFERED=1 python3 scripts/peers/timm_deit.py --out "$out/$tag-peers.json" --models $models --batch 1,8,64,256 --reps 20 --budget-s 150 > "$out/peers.log" 2>&1
has max && step max 200 env PYTHONUNBUFFERED=1 python3 scripts/peers/timm_deit.py --out "$out/peers-max-autotune.json" --models "${MAX_MODELS:-deit-base}" --batch "${MAX_BATCH:-256}" --compile max > "$out/peers-max-autotune.log" 2>&1
if has attn; then
  step attention "${ATTN_LIMIT:-240}" bash -c "$B/bench-attention --out $out/$tag-attention.json \
      --command 'bench-attention --out docs/benchmarks/$tag-attention.json (scripts/gpu/headline.sh, STEPS=attn)' \
      > $out/attention.log 2>&1 && PYTHONUNBUFFERED=1 python3 scripts/peers/varlen_attention.py \
      --out $out/$tag-peers-attention.json > $out/peers-attention.log 2>&1"
  step bandwidth 60 python3 -c '
import statistics, torch
x = torch.empty(1 << 30, dtype=torch.half, device="cuda"); y = torch.empty_like(x); ts = []
for _ in range(13):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); y.copy_(x); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
ms = statistics.median(ts[3:])
print(f"copy 2 GiB -> 2 GiB: {ms:.3f} ms median of 10, {2 * 2**31 / ms / 1e9:.2f} TB/s counting read + write")' >> "$L" 2>&1
fi
has bf16 && bench bf16 "${BF16_LIMIT:-90}"
has f32 && bench f32 "${F32_LIMIT:-160}"
# The device tool returns at most 8 files: the JSON and headline.log as they are, the logs packed.
pack headline-logs.tgz 'e2e-*.log' 'peers*.log' 'attention.log'
cat "$L"
