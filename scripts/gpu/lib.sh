# Shared by the scripts in scripts/gpu/ that run on the GPU machine; source it from the repo root.
# Sets where results go ($out: the device tool's $OUT, else /tmp/gpu-out) and where the bundle's
# binaries are unpacked ($B), puts CUDA's libraries and tools on the paths, and makes the GPU tests
# fail instead of running on the CPU when no GPU is found.
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
B=/tmp/gpu-bin; mkdir -p "$B"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=/usr/local/cuda/bin:$PATH
export CANDLE_RAGGED_REQUIRE_CUDA=1

# unpack [NAME...]: .gpu/NAME.xz into $B/NAME, executable; with no NAME, every .gpu/*.xz. A named
# binary the bundle lacks is skipped (the step that needs it then fails with its name).
unpack() {
  local name
  if [ $# -eq 0 ]; then
    for name in .gpu/*.xz; do set -- "$@" "$(basename "$name" .xz)"; done
  fi
  for name in "$@"; do
    if [ -f ".gpu/$name.xz" ]; then xz -dc ".gpu/$name.xz" > "$B/$name" && chmod +x "$B/$name"; fi
  done
}

# has STAGE: whether the space-separated $stages names STAGE.
has() { [[ " $stages " == *" $1 "* ]]; }
