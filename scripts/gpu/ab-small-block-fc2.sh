#!/usr/bin/env bash
# Lever 40 v3 on the GPU machine, from the repo root: fc2 split over the block's warps (this
# bundle, .gpu/) against v2 (.gpu-prev/bench.xz, the bundle before), in one call: test-small_block
# and its memcheck, then bench at batch 1 (T/S/B, every pruner, ragged, f16) in four arms
# interleaved, two rounds: the separate kernels (CANDLE_FASTPATH_SMALL_BLOCK=0), v2 eager, v3
# eager, v3 always; then ncu per launch of DeiT-T/S with the phase masks 0, 31 (barriers only)
# and 15 (fc2 only).
. scripts/gpu/lib.sh
unpack bench test-small_block
xz -dc .gpu-prev/bench.xz > $B/bench-prev; chmod +x $B/bench-prev
C=$out/v3.txt
timeout 60 $B/test-small_block --test-threads=1 --nocapture > $out/t.log 2>&1; rc=$?; echo "test rc=$rc" >> $C; grep -E 'worst|result|panick' $out/t.log >> $C
[ $rc = 0 ] || { cat $C; exit 1; }
echo "memcheck: $(timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-small_block --test-threads=1 2>&1 | grep 'ERROR SUMMARY')" >> $C
run() { local bin=$1 mode=$2 f=$3; CANDLE_FASTPATH_SMALL_BLOCK=$mode $B/$bin --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch 1 --paths ragged --reps 10 --out $f > /dev/null 2>&1; echo "$bin $mode rc=$?" >> $C; }
for r in 1 2; do
  run bench 0 $out/e2e-off-$r.json
  run bench-prev eager $out/e2e-v2eager-$r.json
  run bench eager $out/e2e-v3eager-$r.json
  run bench always $out/e2e-v3always-$r.json
done
python3 scripts/gpu/ab_ratios.py $out/e2e off v2eager v3eager v3always >> $C
for m in deit-tiny deit-small; do for k in 0 31 15; do
  CANDLE_FASTPATH_SMALL_BLOCK=always CANDLE_FASTPATH_SMALL_BLOCK_SKIP=$k timeout 60 ncu --kernel-name regex:small_block --launch-skip 14 --launch-count 3 --metrics gpu__time_duration.sum $B/bench --device cuda --models $m --dtype f16 --batch 1 --pruners none --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/n.txt 2>&1
  echo "ncu v3 $m skip=$k $(grep -E 'gpu__time_duration.sum' /tmp/n.txt | awk '{print $NF}' | tr '\n' ' ')" >> $C
done; done
cat $C
