#!/usr/bin/env bash
# What a phase boundary costs (scripts/gpu/probes/phase_floor.cu): a kernel boundary in a CUDA
# graph against a grid barrier or per-CTA flags inside one persistent kernel, with a token or a
# 48 KB activation read a phase; run twice (the GPU's clocks drift). GPU machine, repo root.
set -u
. scripts/gpu/lib.sh
start_log phase-floor.txt
nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/phase_floor scripts/gpu/probes/phase_floor.cu -lcuda -lcublasLt
for r in 1 2; do
  echo "== probe, run $r" >> "$C"
  timeout 120 /tmp/phase_floor >> "$C" 2>&1
done
cat "$C"
