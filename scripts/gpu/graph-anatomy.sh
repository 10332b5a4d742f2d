#!/usr/bin/env bash
# Where a CUDA graph replay's time goes (stop 31), on the GPU machine. Needs .gpu/{bench,test-graph}.xz
# and, for the probe, the PTX of the same build in .gpu/{fastpath,ragged_attention}.ptx (from
# target/release/build/candle-{fastpath,ragged}-*/out/); repo root.
# STAGES (default "probe anatomy checks"):
#   probe     scripts/gpu/probes/block_floor.cu: a DeiT-S block's kernels alone, twelve blocks in
#             one graph (with an input copy before it, as CapturedForward::replay does), and the
#             twelve blocks with their buffers from cudaMallocAsync / cudaFreeAsync inside the
#             capture (graph memory nodes, as candle's allocations become)
#   anatomy   bench --graph-anatomy, T/S/B, batch ANAT_BATCH (default 1,8), f16, PRUNERS (default
#             dense, Threshold-L2 and EViT fixed), ragged path, ANAT_ROUNDS (default 2) rounds:
#             each graph's nodes by type and its replays' host time, wall time and event time; for
#             the dense forward also its embedding, blocks and head captured alone
#   checks    test-graph, and test-graph under memcheck
set -u
stages=${STAGES:-probe anatomy checks}
. scripts/gpu/lib.sh
unpack bench test-graph
start_log anatomy.txt
if has probe; then
  echo "== block_floor probe" >> "$C"
  nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/block_floor scripts/gpu/probes/block_floor.cu -lcublasLt -lcuda >> "$C" 2>&1 \
    && timeout 240 /tmp/block_floor .gpu/fastpath.ptx .gpu/ragged_attention.ptx >> "$C" 2>&1
  echo "probe rc=$?" >> "$C"
fi
if has anatomy; then
  for r in $(seq 1 "${ANAT_ROUNDS:-2}"); do
    echo "== bench --graph-anatomy, round $r" >> "$C"
    timeout 400 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 \
      --batch "${ANAT_BATCH:-1,8}" --pruners "${PRUNERS:-none,threshold-l2-fixed,evit-fixed}" --paths ragged \
      --reps 100 --graph-anatomy --out "$out/anatomy-$r.json" 2>&1 | grep -E "^graph|rror" >> "$C"
  done
fi
if has checks; then
  echo "== test-graph" >> "$C"
  timeout 120 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "== memcheck test-graph" >> "$C"
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-graph --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
fi
cat "$C"
