#!/usr/bin/env bash
# Lever 126 on the GPU machine, from the repo root: the activation tiles of the thin GEMM (qkv,
# fc1 + GELU) and of the fc2 cluster kernel multicast by the TMA to the CTAs of a cluster that
# multiply the same rows, against one read per CTA; one binary: CANDLE_FASTPATH_MULTICAST=0 (off),
# trn (the fc2 kernel's alone), 2 / 3 / 6 (the thin GEMM in clusters of that many column tiles,
# and the fc2 kernel's) and the default. Not kept (docs/LEVERS.md, lever 126): the switch
# exists only with docs/benchmarks/history/lever126-multicast.patch applied.
# Needs .gpu/test-{linear,norm_linear,programmatic}.xz for checks, .gpu/bench.xz for anatomy and
# e2e (graphs also takes test-paths_agreement).
# STAGES (default "checks"; run in the order checks, graphs, e2e, anatomy):
#   checks   test-linear, test-norm_linear and test-programmatic in every arm, then under memcheck
#            (default arm) and racecheck (test-programmatic, unless RACECHECK=0)
#   graphs   the one-image graphs at DeiT-T and DeiT-S, paths at DeiT-S batch 1 and 8
#   e2e      bench at batch 1, DTYPES (default f16), every pruner and mode, ragged path (MODELS,
#            default deit-small), arms interleaved, two rounds; per-row ratios
#   anatomy  bench --graph-anatomy at batch 1, f16, MODELS, dense and the fixed pruners, every
#            arm, two rounds
set -u
stages=${STAGES:-checks}
. scripts/gpu/lib.sh
unpack
start_log multicast.txt
ARMS=${ARMS:-0 trn 2 3 6}
MODELS=${MODELS:-deit-small}
V=CANDLE_FASTPATH_MULTICAST
if has checks; then
  for t in linear norm_linear programmatic; do test_arms $V "$ARMS" $t; done
  tests_memcheck linear norm_linear programmatic
  [ "${RACECHECK:-1}" = 1 ] && sanitize programmatic
fi
if has graphs; then
  [ -f "$B/test-paths_agreement" ] && { graphs_check 200; GRAPHS_MODELS=deit-small graphs_check 200; paths_check deit-small 1 300; paths_check deit-small 8 300; }
fi
VAR=$V
DTYPES=${DTYPES:-f16}
has e2e && batch1_e2e multicast
has anatomy && batch1_anatomy $V "$ARMS" "$MODELS"
pack multicast-json.tgz 'multicast-*.json'
cat "$C"
