#!/usr/bin/env bash
# What a captured forward's memory nodes cost a replay (scripts/gpu/probes/graph_nodes_floor.cu):
# graphs of 16 and 54 kernels with and without an allocation / free node pair per kernel, run
# twice. GPU machine, repo root.
set -u
. scripts/gpu/lib.sh
start_log graph-nodes-floor.txt
probe_twice graph_nodes_floor
cat "$C"
