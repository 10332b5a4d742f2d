#!/usr/bin/env bash
# Lever 85 on the GPU machine, from the repo root: whether a sequence's class-attention selection is
# the same bits in any batch (split scores below one sequence per SM, in-kernel past it), with the
# kernel before the fix (.gpu-prev/test-select-prev.xz) and after (.gpu/test-select.xz), under
# CANDLE_RAGGED_SPLIT_SCORES unset / 0 / 1; then the select tests, memcheck / racecheck of the new
# test, paths at DeiT-T/S batch 8, the one-image graphs.
set -u
. scripts/gpu/lib.sh
unpack test-select test-select_rule test-select_bounded test-paths_agreement
unpack_prev test-select
start_log split-bits.txt
for arm in prev new; do for split in default 0 1; do
  echo "== test-select ($arm kernel) a_sequence_selects_the_same_in_any_batch, CANDLE_RAGGED_SPLIT_SCORES=${split#default}" >> $C
  CANDLE_RAGGED_SPLIT_SCORES=${split#default} timeout 120 $(prev_or_new $arm test-select) --test-threads=1 a_sequence_selects_the_same_in_any_batch 2>&1 | grep -E "test result|: the first" | cut -c1-200 >> $C
done; done
echo "== test-select (new), all" >> $C; timeout 120 $B/test-select --test-threads=1 2>&1 | grep -E "test result|panicked" >> $C
echo "== test-select_rule" >> $C; timeout 200 $B/test-select_rule --test-threads=1 2>&1 | grep -E "test result|panicked" >> $C
echo "== test-select_bounded" >> $C; timeout 200 $B/test-select_bounded --test-threads=1 2>&1 | grep -E "test result|panicked" >> $C
sanitize select a_sequence_selects_the_same_in_any_batch
paths_check deit-tiny,deit-small 8 300
graphs_check 200
cat $C
