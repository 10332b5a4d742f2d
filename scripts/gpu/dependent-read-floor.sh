#!/usr/bin/env bash
# What the read behind griddepcontrol.wait costs by its size (scripts/gpu/probes/dependent_read_floor.cu):
# a graph of one-phase launches, each CTA reading 0-96 KB of what the launch before wrote, by
# ordinary loads and by the bulk-copy engine, with and without programmatic edges, one and two
# CTAs an SM; run twice (the GPU's clocks drift). GPU machine, repo root.
set -u
. scripts/gpu/lib.sh
start_log dependent-read-floor.txt
probe_twice dependent_read_floor
cat "$C"
