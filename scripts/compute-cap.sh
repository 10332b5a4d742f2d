#!/usr/bin/env bash
# Prints the compute capability to build CUDA kernels for, as a number (90 for 9.0):
# CUDA_COMPUTE_CAP if set, else the lowest one nvidia-smi lists on this machine (a build for
# its GPUs: PTX for 9.0 does not load on an 8.x GPU), else 90 (no GPU here: the H100 machines).
# install-cuda-toolkit.sh exports it as CUDA_COMPUTE_CAP, which candle's kernels and ours follow.
set -uo pipefail
cap=${CUDA_COMPUTE_CAP:-}
if [[ -z $cap ]] && command -v nvidia-smi >/dev/null; then
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
    | tr -d ' .' | grep -E '^[0-9]+$' | sort -n | head -1)
fi
echo "${cap:-90}"
