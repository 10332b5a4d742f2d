#!/usr/bin/env bash
# Lever 57 on the GPU machine: the models' batch descriptions of equal-length sequences (dense
# forwards, fixed-ratio pruning steps) built once per shape and reused (models::UniformBatches)
# against the binary before it (a cu_seqlens upload per forward and step: a host-to-device memcpy
# node on a captured graph's chain, a driver call eagerly). Two binaries, one call, repo root:
#   .gpu/bench.xz            this tree's bench
#   .gpu-prev/bench-prev.xz  bench built from the commit before the change
# plus .gpu/{test-graph,test-paths_agreement}.xz for the checks.
# STAGES (default "checks anatomy ab"):
#   checks   test-graph and paths at DeiT-S (batch 32, every pruner, three dtypes)
#   anatomy  bench --graph-anatomy of each binary, DeiT-S, batch 1, f16, dense, Threshold-L2 and
#            EViT fixed, Threshold-L2 adaptive (the capturable forward): nodes by type, event times;
#            ANAT_ROUNDS (default 1) rounds, the binaries interleaved
#   ab       bench T/S/B, batch AB_BATCH (default 1,8,64), f16, PRUNERS (default dense, Threshold-L2
#            and EViT fixed, Threshold-L2 adaptive), ragged path, prev / new interleaved, twice;
#            per-row prev/new ratios (eager and graph rows)
set -u
stages=${STAGES:-checks anatomy ab}
. scripts/gpu/lib.sh
unpack bench test-graph test-paths_agreement
unpack_prev bench || exit 1
start_log uniform-batches.txt
if has checks; then
  echo "== test-graph" >> "$C"
  timeout 120 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  paths_check deit-small 32 300
fi
if has anatomy; then
  for r in $(seq 1 "${ANAT_ROUNDS:-1}"); do for a in prev new; do
    echo "== graph anatomy, $a, round $r" >> "$C"
    timeout 200 $(prev_or_new $a bench) --device cuda --models deit-small --dtype f16 --batch 1 \
      --pruners none,threshold-l2-fixed,evit-fixed,threshold-l2-adaptive --paths ragged --reps 100 \
      --graph-anatomy --out /tmp/anat.json 2>&1 | grep -E "^graph|rror" | grep -v "only:" >> "$C"
  done; done
fi
ub_run() { timeout 280 $(prev_or_new "$1" bench) --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch "${AB_BATCH:-1,8,64}" --pruners "${PRUNERS:-none,threshold-l2-fixed,evit-fixed,threshold-l2-adaptive}" --paths ragged --reps 20 --out "$2"; }
ARMS="prev new"
has ab && ab_rounds ub ub_run
pack ub-json.tgz 'ub-*.json'
cat "$C"
