#!/usr/bin/env bash
# Lever 82 on the GPU machine, from the repo root: select_by_rule_bounded (the on-device step of
# adaptive pruners and ATS in captured forwards) as one cooperative launch (decide, a grid-wide
# barrier, each block's offset and rows) against its three kernels (CANDLE_RAGGED_FUSED_STEP=0).
# One binary, built with docs/benchmarks/history/lever82-rule-step.patch applied (not kept: no
# faster; the code was reverted). Needs .gpu/{bench,test-select_bounded,test-select_rule,
# test-paths_agreement}.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   test-select_bounded (bounded steps bit for bit against exact ones; 132 and 133
#            sequences) in both arms, under compute-sanitizer memcheck and racecheck,
#            test-select_rule, paths at DeiT-T/S batch 8 and DeiT-B batch 32, the one-image graphs
#   anatomy  bench --graph-anatomy, DeiT-T batch 1 and 8, f16, the rule-based pruners, both arms
#   e2e      bench DeiT-T/S/B, batch 1/8/64, f16 (DTYPES), dense and the rule-based pruners,
#            ragged path, arms interleaved, two rounds; per-row 0 / default ratios
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-select_bounded test-select_rule test-paths_agreement
start_log rule-step.txt
RULE_PRUNERS=threshold-l2-adaptive,dynamicvit-adaptive,evit-adaptive,ats-fixed,ats-adaptive
if has checks; then
  test_arms CANDLE_RAGGED_FUSED_STEP "default 0" select_bounded
  test_arms CANDLE_RAGGED_FUSED_STEP default select_rule
  sanitize select_bounded bounded_steps_keep_what_exact_steps_keep
  paths_check deit-tiny,deit-small 8 300
  paths_check deit-base 32 300
  graphs_check 200
fi
has anatomy && anatomy CANDLE_RAGGED_FUSED_STEP "0 default" --models deit-tiny --dtype f16 --batch 1,8 --pruners none,$RULE_PRUNERS
e2e_run() { CANDLE_RAGGED_FUSED_STEP=${1#default} timeout 280 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype ${DTYPES:-f16} --batch 1,8,64 --pruners none,$RULE_PRUNERS --paths ragged --reps 10 --out "$2"; }
ARMS=${ARMS:-0 default}
has e2e && ab_rounds rs e2e_run
pack rs-json.tgz 'rs-*.json'
cat "$C"
