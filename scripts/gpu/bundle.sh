#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything the GPU checks run, and packs it into .gpu/
# (ignored by git) for the device machine: the release binaries built with --features cuda and
# every GPU test executable (all integration tests of candle-ragged and candle-fastpath, and the
# workspace's full-size path-agreement test). Then, on the GPU machine:
# scripts/gpu/device-checks.sh.
#
#   scripts/gpu/bundle.sh [NAME...]      # uses $CARGO_TARGET_DIR, default target/
#
# NAMEs pick what is packed (everything is built either way; packing takes seconds): a test's name
# (attention, norm_linear, paths_agreement, ...; packed as test-NAME.xz) or a binary's (classify,
# eval, bench, bench-attention); no NAME packs all of them. Each executable is ~5-7 MB compressed
# (candle's and our PTX are in every one), ~130 MB in all: where the device tool carries at most
# 64 MiB with the repository's own files (~50 MB tracked), pack two or three at a time (under
# ~14 MB; `du -sh .gpu` below says what this bundle came to), e.g.
#   scripts/gpu/bundle.sh attention pack select
#   scripts/gpu/bundle.sh select_bounded select_rule sequence_mean
#   scripts/gpu/bundle.sh step_scores attention_norm_linear attention_lrn
#   scripts/gpu/bundle.sh embed head linear
#   scripts/gpu/bundle.sh norm norm_linear after_attention
#   scripts/gpu/bundle.sh patch pooled_head programmatic
#   scripts/gpu/bundle.sh small_block graph gelu_phi
#   scripts/gpu/bundle.sh bench-attention classify
#   scripts/gpu/bundle.sh bench paths_agreement
# and run device-checks.sh on each (its tests and sanitizer stages take what the bundle holds).
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(scripts/install-cuda-toolkit.sh)"
target=${CARGO_TARGET_DIR:-target}
export CARGO_TARGET_DIR=$target
names=" $* "

cargo build --release --features cuda -p bin --bins
# Test executables: cargo names them in its JSON messages.
# Their compiler output goes to a log, shown if the build fails (the JSON is on stdout).
build_log=$target/gpu-tests-build.log
if ! {
  cargo test --release --features cuda -p candle-ragged -p candle-fastpath --test '*' \
    --no-run --message-format=json 2>"$build_log" &&
  cargo test --release --features cuda -p workspace-tests --test paths_agreement \
    --no-run --message-format=json 2>>"$build_log"
} > "$target/gpu-tests.json"; then
  tail -40 "$build_log" >&2
  echo "bundle.sh: building the test executables failed (log: $build_log)" >&2
  exit 1
fi
python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["target"]["name"], m["executable"])
' < "$target/gpu-tests.json" | sort -u > "$target/gpu-tests.txt"

wanted() { [[ $names == "  " || $names == *" $1 "* ]]; }

binaries="classify eval bench-attention bench"
tests=$(cut -d' ' -f1 "$target/gpu-tests.txt" | tr '\n' ' ')
# A NAME that is neither a binary nor a test (a typo) would otherwise pack nothing, silently:
# refuse it before the bundle already there is replaced.
for name in $names; do
  if [[ " $binaries $tests " != *" $name "* ]]; then
    echo "bundle.sh: no binary or test named '$name' (tests: $tests)" >&2
    exit 2
  fi
done

rm -rf .gpu && mkdir -p .gpu
for b in $binaries; do
  if wanted "$b"; then xz -T0 -6 -c "$target/release/$b" > ".gpu/$b.xz"; fi
done
while read -r name exe; do
  if wanted "$name"; then xz -T0 -6 -c "$exe" > ".gpu/test-$name.xz"; fi
done < "$target/gpu-tests.txt"
ls -la .gpu
du -sh .gpu
