#!/usr/bin/env bash
# Lever 128 on the GPU machine, from the repo root: the fc2 kernel (fc2 + residual + norm1 at
# DeiT-S's batch-1 rows, lever 103) sending its f32 partial sums to their row's CTA as one bulk
# copy a warp instead of 8-byte remote stores; one binary: CANDLE_FASTPATH_TRN_BULK=0 and the
# default. Not kept (docs/LEVERS.md, lever 128): the switch exists only with
# docs/benchmarks/history/lever128-trn-bulk.patch applied.
# Needs .gpu/test-{norm_linear,programmatic}.xz for checks (graphs also takes
# test-paths_agreement), .gpu/bench.xz for anatomy and e2e.
# STAGES (default "checks"; run in the order checks, graphs, e2e, anatomy):
#   checks   test-norm_linear and test-programmatic in both arms, then under memcheck (default
#            arm) and racecheck (test-programmatic, unless RACECHECK=0)
#   graphs   the one-image graphs at DeiT-S, paths at DeiT-S batch 1 and 8, in both arms
#   e2e      bench at batch 1, DTYPES (default f16,bf16), every pruner and mode, ragged path
#            (MODELS, default deit-small), arms interleaved, two rounds; per-row ratios
#   anatomy  bench --graph-anatomy at batch 1, f16, MODELS, dense and the fixed pruners, both
#            arms, two rounds
set -u
stages=${STAGES:-checks}
. scripts/gpu/lib.sh
unpack
start_log trn-bulk.txt
ARMS=${ARMS:-0 default}
MODELS=${MODELS:-deit-small}
V=CANDLE_FASTPATH_TRN_BULK
if has checks; then
  for t in norm_linear programmatic; do test_arms $V "$ARMS" $t; done
  tests_memcheck norm_linear programmatic
  [ "${RACECHECK:-1}" = 1 ] && sanitize programmatic
fi
if has graphs; then
  for a in $ARMS; do
    echo "== graphs and paths, $V=${a#default}" >> "$C"
    [ -f "$B/test-paths_agreement" ] && env $V=${a#default} bash -c ". scripts/gpu/lib.sh; C=$C; GRAPHS_MODELS=deit-small graphs_check 200; paths_check deit-small 1 300; paths_check deit-small 8 300"
  done
fi
VAR=$V
has e2e && batch1_e2e trn-bulk
has anatomy && batch1_anatomy $V "$ARMS" "$MODELS"
pack trn-bulk-json.tgz 'trn-bulk-*.json'
cat "$C"
