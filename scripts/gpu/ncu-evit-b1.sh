#!/usr/bin/env bash
# Where a DeiT-T batch-1 EViT (fixed) step's time goes, kernel by kernel, next to the dense and
# Threshold-L2 forwards: ncu over eager forwards with the one-kernel block off
# (CANDLE_FASTPATH_SMALL_BLOCK=0, so the kernels are a graph replay's), caches and clocks left
# alone. The eager runs include host-decision forwards too; the device path's kernels are the
# chained ones (attention_block, attention_residual_norm_linear, mlp_block, select_top_k,
# cls_probs). Needs .gpu/bench.xz; repo root.
set -u
. scripts/gpu/lib.sh
unpack bench
start_log evit-b1-ncu.txt
for p in none threshold-l2-fixed evit-fixed; do
CANDLE_FASTPATH_SMALL_BLOCK=0 ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 --pruners $p --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "deit-tiny batch 1 f16 $p ragged (eager forwards with the graph's kernels: host and device decisions), warm, boost clocks" >> $C
done
cat $C
