#!/usr/bin/env bash
# Lever 129 on the GPU machine, from the repo root: the thin GEMM's CTA (qkv, fc1 + GELU at
# DeiT-S's batch-1 rows) as two warpgroups, each multiplying and finishing 32 of the tile's 64
# columns, against one warpgroup for all 64; one binary: CANDLE_FASTPATH_THIN_WG=1 and the default.
# Not kept (docs/LEVERS.md, lever 129): the switch exists only with
# docs/benchmarks/history/lever129-thin-gemm-two-warpgroups.patch applied.
# Needs .gpu/test-{linear,programmatic}.xz for checks (graphs also takes test-paths_agreement),
# .gpu/bench.xz for anatomy and e2e.
# STAGES (default "checks"; run in the order checks, graphs, e2e, anatomy):
#   checks   test-linear and test-programmatic in both arms, then under memcheck (default arm)
#   graphs   the one-image graphs at DeiT-S, paths at DeiT-S batch 1 and 8 (default arm)
#   e2e      bench at batch 1, DTYPES (default f16), every pruner and mode, ragged path (MODELS,
#            default deit-small), arms interleaved, two rounds; per-row ratios
#   anatomy  bench --graph-anatomy at batch 1, f16, MODELS, dense and the fixed pruners, both
#            arms, two rounds
set -u
stages=${STAGES:-checks}
. scripts/gpu/lib.sh
unpack
start_log thin-wg.txt
ARMS=${ARMS:-1 default}
MODELS=${MODELS:-deit-small}
V=CANDLE_FASTPATH_THIN_WG
if has checks; then
  for t in linear programmatic; do test_arms $V "$ARMS" $t; done
  tests_memcheck linear programmatic
fi
if has graphs; then
  [ -f "$B/test-paths_agreement" ] && { GRAPHS_MODELS=deit-small graphs_check 200; paths_check deit-small 1 300; paths_check deit-small 8 300; }
fi
VAR=$V
DTYPES=${DTYPES:-f16}
has e2e && batch1_e2e thin-wg
has anatomy && batch1_anatomy $V "$ARMS" "$MODELS"
pack thin-wg-json.tgz 'thin-wg-*.json'
cat "$C"
