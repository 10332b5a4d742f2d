#!/usr/bin/env bash
# Installs a CUDA 13.0 build toolkit (nvcc, headers, cudart, cuBLAS, cuRAND, NVRTC) from NVIDIA's
# PyPI wheels into a prefix, for machines that have no CUDA toolkit, and prints what to export.
# Also the CUTLASS headers (NVIDIA's nvidia-cutlass wheel carries the C++ tree), for
# candle-fastpath's Hopper GEMM with the exact GELU in its epilogue.
#
#   eval "$(scripts/install-cuda-toolkit.sh [PREFIX])"   # default PREFIX: ~/.cache/candle-ragged/cuda-13.0
#   cargo build --release --features cuda
#
# Why 13.0: the GPU machines run driver 580 (CUDA 13.0); PTX from a newer nvcc is rejected there.
# Why a stub libcuda: the wheels carry no driver library; linking needs one with the driver's
# soname. At run time the real libcuda.so.1 of the driver is loaded instead of the stub.
# The script is idempotent: a second run only prints the exports. Progress goes to stderr,
# the export line alone to stdout.
set -euo pipefail

prefix=${1:-${CANDLE_RAGGED_CUDA_PREFIX:-$HOME/.cache/candle-ragged/cuda-13.0}}
python=${PYTHON:-python3}
# The PTX target exported as CUDA_COMPUTE_CAP (candle's kernels and ours both build for it): the
# caller's, else the machine's GPUs', else 90 (compute-cap.sh).
compute_cap=$("$(dirname "$0")/compute-cap.sh")
home=$prefix/nvidia/cu13

wheels=(
  "nvidia-cuda-nvcc==13.0.88"
  "nvidia-cuda-crt==13.0.88"
  "nvidia-nvvm==13.0.88"
  "nvidia-cuda-runtime==13.0.96"
  "nvidia-cublas==13.1.0.3"
  "nvidia-curand==10.4.0.35"
  "nvidia-cuda-nvrtc==13.0.88"
  "nvidia-cuda-cccl==13.0.85"
)

if [[ ! -x $home/bin/nvcc || ! -e $home/include/cublas_v2.h ]]; then
  command -v "$python" >/dev/null || { echo "install-cuda-toolkit: needs $python with pip" >&2; exit 1; }
  echo "install-cuda-toolkit: installing CUDA 13.0 wheels into $prefix" >&2
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$prefix" "${wheels[@]}" >&2
fi
[[ -x $home/bin/nvcc ]] || { echo "install-cuda-toolkit: nvcc missing under $home after install" >&2; exit 1; }
cutlass=$prefix/cutlass_library/source
if [[ ! -e $cutlass/include/cutlass/cutlass.h ]]; then
  echo "install-cuda-toolkit: installing the CUTLASS headers into $prefix" >&2
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$prefix" "nvidia-cutlass==4.2.0.0" >&2
fi
[[ -e $cutlass/include/cutlass/cutlass.h ]] || { echo "install-cuda-toolkit: CUTLASS headers missing under $cutlass" >&2; exit 1; }

cd "$home"
[[ -e lib64 ]] || ln -s lib lib64
# The wheels ship only versioned sonames (libcublas.so.13); linkers look for the plain name.
for l in cublas cublasLt cudart curand nvrtc; do
  if [[ ! -e lib/lib$l.so ]]; then
    versioned=$(cd lib && ls "lib$l.so."* 2>/dev/null | head -1)
    [[ -n $versioned ]] || { echo "install-cuda-toolkit: lib$l.so.* missing" >&2; exit 1; }
    ln -s "$versioned" "lib/lib$l.so"
  fi
done
# Link-time stand-in for the driver library: every cu* symbol of cuda.h as an empty function,
# with the real library's soname so the binary loads the driver's libcuda.so.1 at run time.
if [[ ! -e lib/stubs/libcuda.so ]]; then
  command -v gcc >/dev/null || { echo "install-cuda-toolkit: needs gcc for the libcuda link stub" >&2; exit 1; }
  mkdir -p lib/stubs
  grep -ohE '\bcu[A-Z][A-Za-z0-9_]*\b' include/cuda.h | sort -u | awk '{print "void " $1 "(void){}"}' > lib/stubs/stub.c
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 lib/stubs/stub.c -o lib/stubs/libcuda.so
fi
echo "install-cuda-toolkit: $("$home/bin/nvcc" --version | tail -2 | head -1)" >&2
echo "export CUTLASS_HOME=$cutlass CUDA_HOME=$home CUDA_PATH=$home PATH=$home/bin:\$PATH CUDA_COMPUTE_CAP=$compute_cap LIBRARY_PATH=$home/lib/stubs:$home/lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
