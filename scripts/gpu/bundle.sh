#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything the GPU checks run, and packs it into .gpu/
# (ignored by git) for the device machine: the release binaries built with --features cuda and the
# candle-ragged / candle-fastpath test executables. Then, on the GPU machine: scripts/gpu/device-checks.sh.
#
#   scripts/gpu/bundle.sh            # uses $CARGO_TARGET_DIR, default target/
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(scripts/install-cuda-toolkit.sh)"
target=${CARGO_TARGET_DIR:-target}
export CARGO_TARGET_DIR=$target

cargo build --release --features cuda -p bin --bins
# Test executables: cargo names them in its JSON messages.
cargo test --release --features cuda -p candle-ragged -p candle-fastpath -p workspace-tests \
  --test attention --test pack --test select --test step_scores --test select_rule --test select_bounded --test sequence_mean --test linear --test head --test norm --test patch --test embed --test small_block --test norm_linear --test attention_norm_linear --test graph --test paths_agreement \
  --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["target"]["name"], m["executable"])
' > "$target/gpu-tests.txt"

rm -rf .gpu && mkdir -p .gpu
for b in classify eval bench-attention bench; do
  xz -T0 -6 -c "$target/release/$b" > ".gpu/$b.xz"
done
while read -r name exe; do
  xz -T0 -6 -c "$exe" > ".gpu/test-$name.xz"
done < "$target/gpu-tests.txt"
ls -la .gpu
du -sh .gpu
