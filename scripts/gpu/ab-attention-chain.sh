#!/usr/bin/env bash
# Lever 35 on the GPU machine, from the repo root: the resident attention kernel's full key
# chunks branch-free (independent MMA chains, ldmatrix ahead of them) under a 96-register cap,
# against main before it. Two bundles:
#   .gpu/*.xz        this change (scripts/gpu/bundle.sh): bench, bench-attention, test-attention,
#                    test-graph, test-paths_agreement
#   .gpu-prev/       bench-prev.xz and bench-attention-prev.xz, main before it
# Arms: prev (the previous binaries), new (this change), and, through CANDLE_RAGGED_RESIDENT,
# r96 / r80 (this change's kernel under one register bound for every launch). The first call ran
# the candidate before the launch plan chose between the bounds: its `new` is r96, its `lb3` r80.
# STAGES (default "tests attn ncu", then a second call "sanitize e2e"):
#   tests     test-attention under each resident variant and the tiled kernel
#   sanitize  memcheck and racecheck over test-attention's odd-length, key-part and boundary
#             tests, test-graph, paths at DeiT-S batch 32 and DeiT-T batch 8
#   attn    bench-attention prev / new interleaved (ATTN_ARMS adds r96, r80), twice (ATTN_ARGS replaces the grid);
#           GPU-time ratios per row
#   ncu     scripts/gpu/ncu-attention-detail.sh for prev and new (SHAPES as there)
#   e2e     bench dense / Threshold-L2 fixed / EViT fixed, T/S/B, f16, prev / new, twice
#           (E2E_ARGS replaces the models / batches)
set -u
stages=${STAGES:-tests attn ncu}
. scripts/gpu/lib.sh
unpack bench bench-attention test-attention test-graph test-paths_agreement
for p in bench-prev bench-attention-prev; do
  if [ -f .gpu-prev/$p.xz ]; then xz -dc .gpu-prev/$p.xz > $B/$p && chmod +x $B/$p; fi
done
start_log attention-chain.txt
if has tests; then
  for a in default r96 r80 k64 tiled; do
    echo "== test-attention ($a)" >> "$C"
    case $a in r96|r80|k64) v="CANDLE_RAGGED_RESIDENT=$a";; tiled) v="CANDLE_RAGGED_ATTENTION=tiled";; *) v="X=1";; esac
    env $v timeout 120 $B/test-attention --test-threads=1 2>&1 | grep -E "test result|panicked|got" | head -5 >> "$C"
  done
fi
if has sanitize; then
  echo "== memcheck test-attention" >> "$C"
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-attention --test-threads=1 odd_lengths key_parts resident_and_tiled negative_and_zero large_logits stepped_scores 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  echo "== racecheck test-attention" >> "$C"
  timeout 200 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-attention --test-threads=1 key_parts resident_and_tiled negative_and_zero stepped_scores 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" >> "$C"
  echo "== test-graph" >> "$C"
  timeout 120 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "== paths deit-small (batch 32) and deit-tiny (batch 8)" >> "$C"
  PATHS_DEVICE=cuda PATHS_MODELS=deit-small PATHS_BATCH=32 timeout 200 $B/test-paths_agreement --ignored --test-threads=1 > "$out/paths-s.log" 2>&1; echo "paths S rc=$?" >> "$C"
  PATHS_DEVICE=cuda PATHS_MODELS=deit-tiny PATHS_BATCH=8 timeout 120 $B/test-paths_agreement --ignored --test-threads=1 > "$out/paths-t.log" 2>&1; echo "paths T rc=$?" >> "$C"
  grep -hE "test result" "$out"/paths-*.log >> "$C"
fi
attn_run() {
  local bin=$B/bench-attention v="X=1"
  case $1 in prev) bin=$B/bench-attention-prev;; r96|r80) v="CANDLE_RAGGED_RESIDENT=$1";; esac
  env $v $bin ${ATTN_ARGS:---heads 12,6,3 --batch 1,8,64,256 --keep 1.0,0.7,0.5 --dtype f16,bf16 --host-calls 200 --gpu-reps 100} --out "$2"
}
has attn && ARMS="${ATTN_ARMS:-prev new}" ab_rounds attn attn_run --attn
if has ncu; then
  for a in prev new; do
    b=bench-attention; [ $a = prev ] && b=bench-attention-prev
    echo "== ncu detail, arm $a" >> "$C"
    BENCH=$b bash scripts/gpu/ncu-attention-detail.sh > /dev/null 2>&1
    cat "$out/ncu-attention-detail-$b.txt" >> "$C"
  done
fi
e2e_run() {
  local bin=$B/bench
  [ $1 = prev ] && bin=$B/bench-prev
  $bin --device cuda ${E2E_ARGS:---models deit-tiny,deit-small,deit-base --batch 1,8,64,256} --dtype f16 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$2"
}
has e2e && ARMS="prev new" ab_rounds e2e e2e_run
pack "attention-chain-${stages// /-}.tgz" 'attn-*.json' 'e2e-*.json' 'paths-*.log' 'ncu-attention-detail-*.txt'
cat "$C"
