#!/usr/bin/env bash
# Lever 123 on the GPU machine, from the repo root: CapturedForward's input copies as the graph's
# first nodes (a replay is one graph launch; a moved input repoints its node) against a
# stream-ordered copy before each launch, one binary: CANDLE_FASTPATH_GRAPH_INPUT_COPY=stream
# and the default.
# Needs .gpu/{bench,test-graph,test-paths_agreement}.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   test-graph in both arms, then under memcheck (default); the one-image graphs at
#            DeiT-T and DeiT-S; paths at DeiT-T batch 8 (capturable and staged graphs)
#   anatomy  bench --graph-anatomy at batch 1, f16, DeiT-T / DeiT-S (MODELS), dense and the fixed
#            pruners, both arms, two rounds: host time to return, wall to a synchronised device,
#            time between events
#   e2e      bench at batch 1, f16 and bf16, every pruner and mode, ragged path (MODELS), arms
#            interleaved, two rounds; per-row ratios
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-graph test-paths_agreement
start_log graph-input-copy.txt
ARMS=${ARMS:-stream default}
MODELS=${MODELS:-deit-tiny,deit-small}
V=CANDLE_FASTPATH_GRAPH_INPUT_COPY
if has checks; then
  test_arms $V "$ARMS" graph
  tests_memcheck graph
  graphs_check 200
  GRAPHS_MODELS=deit-small graphs_check 200
  paths_check deit-tiny 8 300
fi
has anatomy && batch1_anatomy $V "$ARMS" "$MODELS"
VAR=$V
has e2e && batch1_e2e gic
pack gic-json.tgz 'gic-*.json'
cat "$C"
