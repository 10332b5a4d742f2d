#!/usr/bin/env bash
# Lever 67 on the GPU machine, from the repo root: DeiT::embed_into_first_block (the patch GEMM,
# position embedding and class rows inside block 0's norm1 + qkv kernel, one image at DeiT-T's
# width) against the embedding's own kernels followed by lever 58's norm1 + qkv kernel; one
# binary, arms ARMS (default "0 default") of CANDLE_DEIT_FUSED_EMBED; or, with
# SWITCH=CANDLE_DEIT_FUSED_HEAD, lever 69 (the last block's fc2 into the final norm and the head,
# residual_norm_linear's wide fc2 form) against its fc2 and the head's own kernel.
# Needs .gpu/{bench,test-patch,test-norm_linear,test-attention_norm_linear,test-graph,
# test-paths_agreement}.xz.
# STAGES (default "checks anatomy e2e"):
#   checks   test-patch (its kernel gained the zero rows) and test-norm_linear, each also under
#            memcheck; test-attention_norm_linear; test-graph; the paths test
#            embedding_into_the_first_block on CUDA (the fused embedding inside a captured graph,
#            two kernels fewer, against embed + norm_linear); paths at DeiT-T batch 1, DeiT-T
#            distilled batch 1, DeiT-S batch 1; graphs_check (one-image graphs, now starting with
#            the fused embedding, against the padded path)
#   anatomy  bench --graph-anatomy, DeiT-T batch 1, f16, dense and Threshold-L2 fixed, both arms,
#            two rounds
#   e2e      bench DeiT-T, batch 1, f16 and bf16, dense, Threshold-L2 / EViT fixed, Threshold-L2
#            adaptive, ragged path, arms interleaved, two rounds; per-row 0 / default ratios
set -u
stages=${STAGES:-checks anatomy e2e}
. scripts/gpu/lib.sh
unpack bench test-patch test-norm_linear test-attention_norm_linear test-graph test-paths_agreement
start_log fused-embed.txt
if has checks; then
  tests_memcheck patch norm_linear
  for t in attention_norm_linear graph; do
    echo "== test-$t" >> "$C"
    timeout 200 $B/test-$t --test-threads=1 2>&1 | grep -E -A3 "test result|panicked" | head -12 >> "$C"
  done
  echo "== paths embedding_into_the_first_block" >> "$C"
  PATHS_DEVICE=cuda timeout 200 $B/test-paths_agreement --test-threads=1 --nocapture embedding_into_the_first_block 2>&1 | grep -E "vs |test result|panicked|differ" >> "$C"
  echo "(paths: DeiT-T batch 1, DeiT-T distilled batch 1, DeiT-S batch 1)" >> "$C"
  paths_check deit-tiny 1 200
  paths_check deit-tiny-distilled 1 200
  paths_check deit-small 1 200
  graphs_check 200
fi
ARMS=${ARMS:-0 default}
SW=${SWITCH:-CANDLE_DEIT_FUSED_EMBED}
if has anatomy; then
  for a in $ARMS $ARMS; do
    echo "== graph anatomy, $SW=$a" >> "$C"
    env "$SW=${a#default}" timeout 200 $B/bench --device cuda --models deit-tiny --dtype f16 --batch 1 \
      --pruners none,threshold-l2-fixed --paths ragged --reps 100 \
      --graph-anatomy --out /tmp/anat.json 2>&1 | grep -E "^graph|rror" | grep -v "only:" >> "$C"
  done
fi
e2e_run() { env "$SW=${1#default}" timeout 280 $B/bench --device cuda --models deit-tiny --dtype f16,bf16 --batch 1 --pruners none,threshold-l2-fixed,evit-fixed,threshold-l2-adaptive --paths ragged --reps 20 --out "$2"; }
has e2e && ab_rounds embed e2e_run
pack embed-json.tgz 'embed-*.json'
cat "$C"
