#!/usr/bin/env bash
# Levers 82 and 117 on the GPU machine, from the repo root: select_by_rule_bounded (the on-device
# step of adaptive pruners and ATS in captured forwards) as one launch against its three kernels
# ($SWITCH=0). Lever 82 (SWITCH=CANDLE_RAGGED_FUSED_STEP, a binary built with
# docs/benchmarks/history/lever82-rule-step.patch applied; not kept): one cooperative launch,
# decide, a grid-wide barrier, each block's offset and rows. Lever 117 (SWITCH=
# CANDLE_RAGGED_RULE_STEP, the default; a binary built with
# docs/benchmarks/history/lever117-rule-step-lookback.patch applied; not kept either): an ordinary
# launch whose blocks find their offsets by a decoupled look-back over the lengths the blocks
# before them publish. Neither switch exists in main's code. Needs
# .gpu/{bench,test-select_bounded,test-select_rule,test-paths_agreement}.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   test-select_bounded (bounded steps bit for bit against exact ones; 132 and 133
#            sequences) in both arms, under compute-sanitizer memcheck and racecheck,
#            test-select_rule, paths at DeiT-T/S batch 8 and DeiT-B batch 32, the one-image graphs
#   anatomy  bench --graph-anatomy, DeiT-T batch 1 and 8 (ANATOMY_MODELS, ANATOMY_BATCH), f16,
#            the rule-based pruners, both arms (ANATOMY_ARMS)
#   e2e      bench DeiT-T/S/B, batch 1/8/64, f16 (DTYPES), dense and the rule-based pruners,
#            ragged path, arms interleaved, two rounds; per-row 0 / default ratios
set -u
stages=${STAGES:-checks anatomy e2e}
SWITCH=${SWITCH:-CANDLE_RAGGED_RULE_STEP}
. scripts/gpu/lib.sh
unpack bench test-select_bounded test-select_rule test-paths_agreement
start_log rule-step.txt
RULE_PRUNERS=threshold-l2-adaptive,dynamicvit-adaptive,evit-adaptive,ats-fixed,ats-adaptive
if has checks; then
  test_arms $SWITCH "default 0" select_bounded
  test_arms $SWITCH default select_rule
  sanitize select_bounded bounded_steps_keep_what_exact_steps_keep
  paths_check deit-tiny,deit-small 8 300
  paths_check deit-base 32 300
  graphs_check 200
fi
# ANATOMY_ARMS: the arms in order (e.g. "default 0" for a second round the other way round);
# ANATOMY_MODELS / ANATOMY_BATCH: which forwards.
has anatomy && anatomy $SWITCH "${ANATOMY_ARMS:-0 default}" --models ${ANATOMY_MODELS:-deit-tiny} --dtype f16 --batch ${ANATOMY_BATCH:-1,8} --pruners none,$RULE_PRUNERS
e2e_run() { env $SWITCH=${1#default} timeout 280 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype ${DTYPES:-f16} --batch 1,8,64 --pruners none,$RULE_PRUNERS --paths ragged --reps 10 --out "$2"; }
ARMS=${ARMS:-0 default}
has e2e && ab_rounds rs e2e_run
pack rs-json.tgz 'rs-*.json'
cat "$C"
