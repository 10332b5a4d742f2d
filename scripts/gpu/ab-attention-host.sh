#!/usr/bin/env bash
# Levers 54-55 on the GPU machine, two binaries in one call (repo root; lever 55 was not kept: apply
# docs/benchmarks/history/lever55-qkv-one-pointer.patch before building to run it again):
#   .gpu/{bench,bench-attention}.xz              this tree (uniform spans; q / k / v of one
#                                                storage through one device pointer; no
#                                                cu_seqlens pointer when spans are uniform)
#   .gpu-prev/{bench,bench-attention}-prev.xz    the commit before lever 54
# plus .gpu/test-attention.xz for the checks.
# STAGES (default "checks host gpu e2e"):
#   checks  test-attention, its memcheck (every test) and racecheck (equal lengths, fused views)
#   host    bench-attention heads 3/6/12, batch 1/8, keep 1.0/0.7, f16 and bf16, prev / new
#           interleaved, twice: host_us and gpu_us ratios
#   gpu     bench-attention heads 6/12, batch 64/256, keep 1.0/0.7, f16: gpu_us ratios (lever 54's
#           kernels against the previous ones where spans are not uniform)
#   e2e     bench T/S/B, batch 1/8, f16, dense and Threshold-L2 fixed, ragged path
set -u
stages=${STAGES:-checks host gpu e2e}
. scripts/gpu/lib.sh
unpack bench bench-attention test-attention
unpack_prev bench bench-attention || exit 1
start_log attention-host.txt
if has checks; then
  echo "== test-attention" >> "$C"
  timeout 120 $B/test-attention --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "== memcheck test-attention (every test)" >> "$C"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-attention --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  echo "== racecheck test-attention equal_lengths" >> "$C"
  timeout 200 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-attention --test-threads=1 equal_lengths 2>&1 | grep -E "RACECHECK SUMMARY|test result" >> "$C"
fi
ARMS="prev new"
host_run() { $(prev_or_new "$1" bench-attention) --heads 3,6,12 --batch 1,8 --keep 1.0,0.7 --dtype f16,bf16 --out "$2"; }
if has host; then
  ab_rounds host host_run --attn --metric host_us
  echo "== host_vs_affine (each run's ragged host time over the same run's candle_affine)" >> "$C"
  python3 scripts/gpu/ab_ratios.py --attn --metric host_vs_affine "$out/host" $ARMS >> "$C"
  echo "== gpu_us" >> "$C"
  python3 scripts/gpu/ab_ratios.py --attn "$out/host" $ARMS >> "$C"
fi
gpu_run() { $(prev_or_new "$1" bench-attention) --heads 6,12 --batch 64,256 --keep 1.0,0.7 --dtype f16 --out "$2"; }
has gpu && ab_rounds gpu gpu_run --attn
e2e_run() { $(prev_or_new "$1" bench) --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 1,8 --pruners none,threshold-l2-fixed --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds e2e e2e_run
pack attention-host-json.tgz 'host-*.json' 'gpu-*.json' 'e2e-*.json'
cat "$C"
