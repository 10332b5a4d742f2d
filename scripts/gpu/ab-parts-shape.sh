#!/usr/bin/env bash
# Lever 106 on the GPU machine, from the repo root: the resident attention kernel's key-part
# split at batch 1 (DeiT-S: 6 heads, DeiT-B: 12, 197 tokens) with more query-tile warps per
# block, so that fewer blocks stage the head's K / V (CANDLE_RAGGED_PARTS_SHAPE=P:W: P key parts
# × W query-tile warps per block), against the rule's split (8 × 1 at 6 heads, 4 × 2 at 12).
# Arms are named pPwW (p8w2 = 8:2); `default` is the rule. One binary. Not kept: the code is
# docs/benchmarks/history/lever106-parts-shape.patch, to apply before building.
# Needs .gpu/{bench,bench-attention,test-attention,test-paths_agreement}.xz.
# STAGES (default "checks ncu attn anatomy"; "e2e" separately):
#   checks   test-attention per arm (its key-part tests run the split), memcheck and racecheck of
#            the key-part tests under each non-default arm; paths at DeiT-S and DeiT-B batch 1
#            and the one-image graphs at DeiT-S under ARM_CHECK (default p8w2)
#   ncu      the attention kernel alone, per arm, 6 and 12 heads, batch 1, keep 1.0 / 0.7, f16
#   attn     bench-attention, heads 6 / 12, batch 1 / 8, keep 1.0 / 0.7, f16 / bf16, arms
#            interleaved, two rounds; per-row GPU-time ratios
#   anatomy  bench --graph-anatomy, DeiT-S and DeiT-B batch 1, f16, dense and the fixed
#            pruners, every arm, two rounds: replay event times
#   e2e      bench DeiT-S / DeiT-B batch 1, f16 and bf16, every pruner and mode, ragged path,
#            arms interleaved, two rounds; per-row ratios
set -u
stages=${STAGES:-checks ncu attn anatomy}
. scripts/gpu/lib.sh
unpack bench bench-attention test-attention test-paths_agreement
start_log parts-shape.txt
ARMS=${ARMS:-default p8w2 p16w1 p4w4}
V=CANDLE_RAGGED_PARTS_SHAPE
# shape ARM: the switch's value for an arm name (pPwW -> P:W, default -> empty).
shape() { case $1 in default) echo "" ;; *) local s=${1#p}; echo "${s%w*}:${s#*w}" ;; esac; }
if has checks; then
  for a in $ARMS; do
    echo "== test-attention, $V=$(shape $a)" >> "$C"
    env "$V=$(shape $a)" timeout 300 $B/test-attention --test-threads=1 2>&1 | grep -E -A2 "test result|panicked" | head -6 >> "$C"
    [ "$a" = default ] && continue
    echo "== test-attention key_parts under memcheck, then racecheck, $V=$(shape $a)" >> "$C"
    env "$V=$(shape $a)" timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-attention --test-threads=1 key_parts 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
    env "$V=$(shape $a)" timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-attention --test-threads=1 key_parts 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" >> "$C"
  done
  export "$V=$(shape "${ARM_CHECK:-p8w2}")"
  echo "== model checks with $V=${!V}" >> "$C"
  paths_check deit-small 1 300
  paths_check deit-base 1 300
  GRAPHS_MODELS=deit-small graphs_check 200
  unset "$V"
fi
if has ncu; then
  for a in $ARMS; do
    for h in 6 12; do for keep in 1.0 0.7; do
      echo "== ncu attention, $V=$(shape $a), $h heads, batch 1, keep $keep, f16" >> "$C"
      env "$V=$(shape $a)" ncu --kernel-name regex:ragged_attn_resident --launch-skip 20 --launch-count 3 \
        --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size \
        $B/bench-attention --heads $h --batch 1 --keep $keep --dtype f16 --host-calls 10 --gpu-reps 3 --out /tmp/x.json 2>/dev/null \
        | grep -E "gpu__time|grid_size|block_size" | sort | uniq -c >> "$C"
    done; done
  done
fi
attn_run() { env "$V=$(shape $1)" timeout 200 $B/bench-attention --heads 6,12 --batch 1,8 --keep 1.0,0.7 --dtype f16,bf16 --host-calls 200 --out "$2"; }
has attn && ab_rounds attn attn_run --attn
if has anatomy; then
  for r in 1 2; do for a in $ARMS; do
    echo "== graph anatomy, $V=$(shape $a)" >> "$C"
    env "$V=$(shape $a)" timeout 200 $B/bench --device cuda --models deit-small,deit-base --dtype f16 --batch 1 \
      --pruners none,threshold-l2-fixed,evit-fixed --paths ragged --reps 100 --graph-anatomy --out /tmp/anat.json 2>&1 \
      | grep -E "^graph|rror" | grep -v "only:" | sed -E 's/ [0-9]+ mem-alloc.*replay:/ replay:/' >> "$C"
  done; done
fi
e2e_run() { env "$V=$(shape $1)" timeout 250 $B/bench --device cuda --models deit-small,deit-base --dtype f16,bf16 --batch 1 \
  --pruners none,threshold-l2,dynamicvit,evit,ats --paths ragged --reps 10 --out "$2"; }
has e2e && ab_rounds e2e e2e_run
pack parts-shape-json.tgz 'attn-*.json' 'e2e-*.json'
cat "$C"
