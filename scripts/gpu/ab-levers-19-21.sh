#!/usr/bin/env bash
# Levers 19-21 on the GPU machine, against the code before them, in one bundle (built from branch
# lever21-embed by scripts/gpu/bundle.sh; needs .gpu/{bench,test-linear,test-norm,test-patch,
# test-embed,test-graph,test-paths_agreement}.xz; run from the repo root).
#   lever 19: CANDLE_FASTPATH_GELU=phi, the exact GELU as x·Φ(x) (kernels/gelu_phi.cuh), in the GELU
#             kernel and the CUTLASS fc1 epilogue (default still erf)
#   lever 20: LayerNorm kernels per size class (1/2/4/8 chunks per lane, fewer registers, more rows
#             in flight; the default); CANDLE_FASTPATH_LN_CHUNKS=8 is the one kernel of before
#   lever 21: embed_tokens (prefix + patches + pos_embed in one kernel; the default),
#             CANDLE_FASTPATH_EMBED=ops is cat + broadcast_add as before; and patchify one thread
#             per run of p pixels (no switch: every arm has it; its before is lever 18's ncu)
# Arms: old (erf, LN_CHUNKS=8, EMBED=ops) / ln (erf, EMBED=ops) / lnphi (phi, EMBED=ops) / all (phi).
# STAGES (default "checks e2e ncu"):
#   checks  test-norm (both LN settings), test-patch, test-embed and their memcheck, test-linear
#           with phi (CUTLASS default and forced) and its memcheck, test-graph, paths at DeiT-S
#           with phi and CUTLASS forced
#   e2e     bench dense / Threshold-L2 fixed / EViT fixed, T/S/B, batch 1/8/64/256, f16 and bf16,
#           the four arms interleaved, twice; per-row old/arm latency ratios
#   ncu     per-kernel times of dense forwards (DeiT-S 256 and 64, DeiT-T 64), old vs all
set -u
stages=${STAGES:-checks e2e ncu}
. scripts/gpu/lib.sh
unpack
start_log checks.txt
arm() {
  case $1 in
    old) echo "CANDLE_FASTPATH_GELU=erf CANDLE_FASTPATH_LN_CHUNKS=8 CANDLE_FASTPATH_EMBED=ops" ;;
    ln) echo "CANDLE_FASTPATH_GELU=erf CANDLE_FASTPATH_EMBED=ops" ;;
    lnphi) echo "CANDLE_FASTPATH_GELU=phi CANDLE_FASTPATH_EMBED=ops" ;;
    all) echo "CANDLE_FASTPATH_GELU=phi" ;;
  esac
}
if has checks; then
  for ln in default 8; do
    echo "== test-norm (CANDLE_FASTPATH_LN_CHUNKS=$ln)" >> "$C"
    env CANDLE_FASTPATH_LN_CHUNKS=${ln/default/} $B/test-norm --test-threads=1 2>&1 | grep -E "test result|panicked|got" | head -5 >> "$C"
  done
  for t in test-patch test-embed; do
    echo "== $t" >> "$C"
    $B/$t --test-threads=1 2>&1 | grep -E "test result|panicked|got" | head -5 >> "$C"
  done
  for t in test-norm test-patch test-embed; do
    echo "== memcheck $t" >> "$C"
    compute-sanitizer --tool memcheck --error-exitcode 9 $B/$t --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  done
  for cut in default 1; do
    echo "== test-linear (CANDLE_FASTPATH_GELU=phi, CANDLE_FASTPATH_CUTLASS=$cut)" >> "$C"
    env CANDLE_FASTPATH_GELU=phi CANDLE_FASTPATH_CUTLASS=${cut/default/} $B/test-linear --test-threads=1 2>&1 | grep -E "test result|panicked|got" | head -5 >> "$C"
  done
  echo "== memcheck test-linear (phi, CUTLASS forced)" >> "$C"
  CANDLE_FASTPATH_GELU=phi CANDLE_FASTPATH_CUTLASS=1 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-linear --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  echo "== test-graph (phi)" >> "$C"
  CANDLE_FASTPATH_GELU=phi $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "== paths deit-small (phi, CUTLASS forced)" >> "$C"
  CANDLE_FASTPATH_GELU=phi CANDLE_FASTPATH_CUTLASS=1 PATHS_DEVICE=cuda PATHS_MODELS=deit-small PATHS_BATCH=32 $B/test-paths_agreement --ignored --test-threads=1 --nocapture > /tmp/paths.log 2>&1; echo "paths rc=$?" >> "$C"
  grep -E "test result" /tmp/paths.log | tail -2 >> "$C"
fi
if has e2e; then
  for r in 1 2; do
    for a in old ln lnphi all; do
      for d in f16 bf16; do
        env $(arm $a) $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype $d --batch 1,8,64,256 --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 10 --out "$out/e2e-$a-$d-$r.json" > /tmp/e2e.log 2>&1
        echo "e2e $a $d round $r rc=$?" >> "$C"
      done
    done
  done
  python3 scripts/gpu/ab_ratios.py "$out/e2e" old ln lnphi all >> "$C"
  pack e2e-json.tgz 'e2e-*.json'
fi
if has ncu; then
  for a in old all; do
    for mb in deit-small:256 deit-small:64 deit-tiny:64; do
      m=${mb%:*}; b=${mb#*:}
      env $(arm $a) ncu --metrics gpu__time_duration.sum --csv --print-units base $B/bench --device cuda --models $m --dtype f16 --batch $b --pruners none --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
      python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "$a $m batch $b f16" --top 8 >> "$C"
    done
  done
fi
cat "$C"
