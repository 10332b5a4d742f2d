#!/usr/bin/env bash
# What a captured forward's memory nodes cost a replay (scripts/gpu/probes/graph_nodes_floor.cu):
# graphs of 16 and 54 kernels with and without an allocation / free node pair per kernel, run
# twice. GPU machine, repo root.
set -u
. scripts/gpu/lib.sh
start_log graph-nodes-floor.txt
nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/graph_nodes_floor scripts/gpu/probes/graph_nodes_floor.cu -lcuda -lcublasLt
for r in 1 2; do
  echo "== run $r" >> "$C"
  timeout 120 /tmp/graph_nodes_floor >> "$C" 2>&1
done
cat "$C"
