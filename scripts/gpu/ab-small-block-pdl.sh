#!/usr/bin/env bash
# Lever 41 on the GPU machine, from the repo root: the fused block (lever 40) launched with
# programmatic dependent launch (CANDLE_FASTPATH_SMALL_BLOCK_LAUNCH=pdl: an ordinary launch that
# may start while the previous block's kernel finishes, prefetching its first qkv weight tile
# before griddepcontrol.wait) against the cooperative launch; one binary. Checks: test-small_block
# and paths T/S/B at batch 1 under pdl (always), memcheck under pdl. Then bench at batch 1
# (T/S, every pruner, ragged, f16), five arms interleaved, two rounds: off, cooperative eager,
# pdl eager, cooperative always, pdl always (ARM = <launch>-<mode>).
. scripts/gpu/lib.sh
unpack bench test-small_block test-paths_agreement
start_log pdl.txt
CANDLE_FASTPATH_SMALL_BLOCK_LAUNCH=pdl timeout 60 $B/test-small_block --test-threads=1 > $out/t.log 2>&1; rc=$?
echo "test-small_block (pdl) rc=$rc $(grep -E 'test result' $out/t.log)" >> $C
[ $rc = 0 ] || { cat $C $out/t.log | tail -30; exit 1; }
echo "memcheck (pdl): $(CANDLE_FASTPATH_SMALL_BLOCK_LAUNCH=pdl timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-small_block --test-threads=1 2>&1 | grep 'ERROR SUMMARY')" >> $C
CANDLE_FASTPATH_SMALL_BLOCK_LAUNCH=pdl CANDLE_FASTPATH_SMALL_BLOCK=always PATHS_DEVICE=cuda PATHS_MODELS=deit-tiny,deit-small,deit-base PATHS_BATCH=1 timeout 150 $B/test-paths_agreement --ignored --test-threads=1 > $out/paths-b1-pdl.log 2>&1
echo "paths b1 (pdl, always) rc=$? $(grep -E 'test result' $out/paths-b1-pdl.log)" >> $C
e2e_run() {
  local launch=${1%-*} mode=${1#*-}
  CANDLE_FASTPATH_SMALL_BLOCK_LAUNCH=$launch CANDLE_FASTPATH_SMALL_BLOCK=$mode $B/bench --device cuda --models deit-tiny,deit-small --dtype f16 --batch 1 --paths ragged --reps 10 --out "$2"
}
ARMS="cooperative-0 cooperative-eager pdl-eager cooperative-always pdl-always" ab_rounds e2e e2e_run
cat $C
