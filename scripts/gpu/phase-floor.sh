#!/usr/bin/env bash
# What a phase boundary costs (scripts/gpu/probes/phase_floor.cu): a kernel boundary in a CUDA
# graph against a grid barrier or per-CTA flags inside one persistent kernel, with a token or a
# 48 KB activation read a phase; run twice (the GPU's clocks drift). GPU machine, repo root.
set -u
. scripts/gpu/lib.sh
start_log phase-floor.txt
probe_twice phase_floor
cat "$C"
