#!/usr/bin/env bash
# Lever 127 on the GPU machine, from the repo root: the thin GEMM (qkv, fc1 + GELU at DeiT-S's
# batch-1 rows) transposed, yᵀ = W·xᵀ, so that each CTA reads 32 or 16 rows of x behind its
# griddepcontrol.wait instead of 64; one binary: CANDLE_FASTPATH_THIN_T=0 (the 64 × 64 tiles),
# 32, 16 and the default. Not kept (docs/LEVERS.md, lever 127): the switch exists only with
# docs/benchmarks/history/lever127-thin-gemm-t.patch applied.
# Needs .gpu/test-{linear,programmatic}.xz for checks, .gpu/bench.xz for anatomy and e2e (graphs
# also takes test-paths_agreement).
# STAGES (default "checks"; run in the order checks, graphs, e2e, anatomy):
#   checks   test-linear and test-programmatic in every arm, then under memcheck (arms 32, 16)
#            and racecheck (test-programmatic, unless RACECHECK=0)
#   graphs   the one-image graphs at DeiT-T and DeiT-S, paths at DeiT-S batch 1 and 8
#   e2e      bench at batch 1, DTYPES (default f16), every pruner and mode, ragged path (MODELS,
#            default deit-small), arms interleaved, two rounds; per-row ratios
#   anatomy  bench --graph-anatomy at batch 1, f16, MODELS, dense and the fixed pruners, every
#            arm, two rounds
set -u
stages=${STAGES:-checks}
. scripts/gpu/lib.sh
unpack
start_log thin-t.txt
ARMS=${ARMS:-0 32 16}
MODELS=${MODELS:-deit-small}
V=CANDLE_FASTPATH_THIN_T
if has checks; then
  for t in linear programmatic; do test_arms $V "$ARMS" $t; done
  for a in ${MEMCHECK_ARMS:-32 16}; do echo "== memcheck, $V=$a" >> "$C"; env $V=$a bash -c ". scripts/gpu/lib.sh; C=$C; tests_memcheck linear programmatic"; done
  [ "${RACECHECK:-1}" = 1 ] && for a in 32 16; do echo "== racecheck, $V=$a" >> "$C"; env $V=$a bash -c ". scripts/gpu/lib.sh; C=$C; sanitize programmatic"; done
fi
if has graphs; then
  for a in $ARMS; do
    echo "== graphs and paths, $V=$a" >> "$C"
    [ -f "$B/test-paths_agreement" ] && env $V=$a bash -c ". scripts/gpu/lib.sh; C=$C; GRAPHS_MODELS=deit-small graphs_check 200; paths_check deit-small 1 300; paths_check deit-small 8 300"
  done
fi
VAR=$V
DTYPES=${DTYPES:-f16}
has e2e && batch1_e2e thin-t
has anatomy && batch1_anatomy $V "$ARMS" "$MODELS"
pack thin-t-json.tgz 'thin-t-*.json'
cat "$C"
