#!/usr/bin/env bash
# How long a batch-1 replay's host waits past the GPU, per context scheduling flag
# (scripts/gpu/probes/sync_floor.cu): each flag in its own process, two rounds interleaved.
# GPU machine, repo root.
set -u
. scripts/gpu/lib.sh
start_log sync-floor.txt
build_probe sync_floor
for r in 1 2; do
  for m in auto spin yield blocking; do
    timeout 60 /tmp/sync_floor $m >> "$C" 2>&1
  done
done
cat "$C"
