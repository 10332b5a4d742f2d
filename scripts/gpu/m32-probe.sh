#!/usr/bin/env bash
# Lever 81's follow-up probe on the GPU machine, from the repo root, with
# docs/benchmarks/history/lever81-m32-m64-in-graphs.patch applied (not kept; the code was
# reverted): norm_linear's 32- and 64-row tiles taken inside CUDA graphs too
# (CANDLE_FASTPATH_NORM_LINEAR=m32 / m64) against the two steps (=narrow), DeiT-T batch 8 and 16:
# test-norm_linear in both modes, memcheck with m32, graph anatomy per arm, ncu of the m32 kernels.
# Needs .gpu/{bench,test-norm_linear}.xz.
set -u
. scripts/gpu/lib.sh
unpack bench test-norm_linear
C=$out/m32.txt
for arm in default m32; do echo "== test-norm_linear CANDLE_FASTPATH_NORM_LINEAR=${arm#default}" >> $C; CANDLE_FASTPATH_NORM_LINEAR=${arm#default} timeout 100 $B/test-norm_linear --test-threads=1 2>&1 | grep -E "test result|panicked" >> $C; done
echo "== memcheck m32" >> $C; CANDLE_FASTPATH_NORM_LINEAR=m32 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-norm_linear --test-threads=1 matches_the_two_steps 2>&1 | grep -E "ERROR SUMMARY|test result" >> $C
for arm in narrow m32 m64; do
  echo "== graph anatomy, CANDLE_FASTPATH_NORM_LINEAR=$arm" >> $C
  CANDLE_FASTPATH_NORM_LINEAR=$arm timeout 200 $B/bench --device cuda --models deit-tiny --dtype f16 --batch 8,16 --pruners none,threshold-l2-fixed,dynamicvit-fixed,evit-fixed --paths ragged --reps 100 --graph-anatomy --out /tmp/anat.json 2>&1 | grep -E "^graph|rror" | grep -v "only:" >> $C
done
ncu --metrics gpu__time_duration.sum --csv --print-units base -k regex:norm_linear -c 6 env CANDLE_FASTPATH_NORM_LINEAR=m32 $B/bench --device cuda --models deit-tiny --dtype f16 --batch 8 --pruners none --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json 2>/dev/null | grep norm_linear | cut -c1-200 >> $C
cat $C
