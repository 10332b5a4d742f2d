#!/usr/bin/env bash
# Levers 64 and 65 on the GPU machine, from the repo root: candle_fastpath::
# attention_residual_norm_linear (one image's attention folded into lever 61's proj → norm2 → fc1
# cluster kernel, DeiT-T's width) against candle-ragged's attention kernel followed by lever 61's,
# and candle_fastpath::attention_block (that kernel continuing into fc2 and the next block's
# norm1 + qkv) against the two kernels; one binary, arms ARMS (default "0 default") of the switch
# SWITCH (default CANDLE_FASTPATH_ATTENTION_RNL, lever 64; CANDLE_FASTPATH_ATTENTION_BLOCK for
# lever 65).
# Needs .gpu/{bench,test-attention_norm_linear,test-norm_linear,test-graph,test-paths_agreement}.xz
# and, for the probe stage, .gpu-probe/arnl.xz (scripts/gpu/probes/arnl.cu, built on the build
# machine with the nvcc line in its header, then xz-compressed).
# STAGES (default "checks anatomy e2e"):
#   checks   test-attention_norm_linear and test-norm_linear, memcheck of the new test,
#            racecheck of its quick form (ATTENTION_RNL_TEST_QUICK: f16, 197 rows and 64 of 70),
#            test-graph, paths at DeiT-T batch 1 and 8, DeiT-T distilled batch 1, DeiT-S batch 1
#            (unchanged: C = 384), then one-image CUDA graphs against the padded path (graphs_check:
#            the chained kernels through the model)
#   probe    .gpu-probe/arnl: the kernel against the two launches, µs per launch in graph chains,
#            and its checks under racecheck
#   anatomy  bench --graph-anatomy, DeiT-T batch 1, f16, dense and Threshold-L2 fixed, both arms
#   e2e      bench DeiT-T, batch 1/8, f16 and bf16, dense, Threshold-L2 / EViT fixed, Threshold-L2
#            adaptive, ragged path, arms interleaved, two rounds; per-row 0 / default ratios
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-attention_norm_linear test-norm_linear test-graph test-paths_agreement
start_log attention-rnl.txt
if has checks; then
  for t in attention_norm_linear norm_linear; do
    echo "== test-$t" >> "$C"
    timeout 200 $B/test-$t --test-threads=1 2>&1 | grep -E -A3 "test result|panicked" | head -12 >> "$C"
  done
  echo "== memcheck / racecheck test-attention_norm_linear" >> "$C"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-attention_norm_linear --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  ATTENTION_RNL_TEST_QUICK=1 timeout 240 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-attention_norm_linear --test-threads=1 matches 2>&1 | grep -E "RACECHECK SUMMARY|test result" >> "$C"
  echo "racecheck rc=$?" >> "$C"
  echo "== test-graph" >> "$C"
  timeout 120 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "(paths: DeiT-T batch 1 and 8, DeiT-T distilled and DeiT-S batch 1)" >> "$C"
  paths_check deit-tiny 1 200
  paths_check deit-tiny 8 200
  paths_check deit-tiny-distilled 1 200
  paths_check deit-small 1 200
  graphs_check 200
fi
if has probe; then
  echo "== probe arnl" >> "$C"
  xz -dc .gpu-probe/arnl.xz > $B/arnl && chmod +x $B/arnl
  timeout 120 $B/arnl >> "$C" 2>&1
  ARNL_CHECK_ONLY=1 timeout 200 compute-sanitizer --tool racecheck $B/arnl 2>&1 | grep -E "RACECHECK SUMMARY" >> "$C"
fi
ARMS=${ARMS:-0 default}
SW=${SWITCH:-CANDLE_FASTPATH_ATTENTION_RNL}
if has anatomy; then
  for a in $ARMS; do
    echo "== graph anatomy, $SW=$a" >> "$C"
    env "$SW=${a#default}" timeout 200 $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 \
      --pruners none,threshold-l2-fixed --paths ragged --reps 100 \
      --graph-anatomy --out /tmp/anat.json 2>&1 | grep -E "^graph|rror" | grep -v "only:" >> "$C"
  done
fi
e2e_run() { env "$SW=${1#default}" timeout 280 $B/bench --device cuda --models deit-tiny --dtype f16,bf16 --batch 1,8 --pruners none,threshold-l2-fixed,evit-fixed,threshold-l2-adaptive --paths ragged --reps 20 --out "$2"; }
has e2e && ab_rounds arnl e2e_run
pack arnl-json.tgz 'arnl-*.json'
cat "$C"
