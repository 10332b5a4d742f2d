#!/usr/bin/env bash
# Our DeiT forward on the CPU next to timm's in PyTorch (eager and torch.compile), on the same
# machine, interleaved round by round so that both see the same load:
#
#   PYTHON=/path/to/venv/bin/python scripts/peers/cpu-same-run.sh OUT_DIR
#
# PYTHON must have torch and timm (`pip install torch timm`). BENCH is our `bench` binary
# (default: target/release/bench, from `cargo build --release -p bin --bin bench`).
# Settings (environment): MODELS (deit-tiny,deit-small), DTYPES (f32,bf16), BATCHES (1,8),
# ROUNDS (3), REPS (10 timed forwards a row; the median is reported), PRUNERS (our rows besides
# the dense one: threshold-l2-fixed,evit-fixed), COMPILE (on: also torch.compile; `none`: not).
# Writes OUT_DIR/ours-N.json and OUT_DIR/peers-N.json for each round and OUT_DIR/summary.md, the
# per-row medians over the rounds and their ratios (scripts/peers/cpu_summary.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: cpu-same-run.sh OUT_DIR}
mkdir -p "$out"
python=${PYTHON:-python3}
bench=${BENCH:-target/release/bench}
models=${MODELS:-deit-tiny,deit-small}
dtypes=${DTYPES:-f32,bf16}
batches=${BATCHES:-1,8}
rounds=${ROUNDS:-3}
reps=${REPS:-10}
pruners=${PRUNERS:-threshold-l2-fixed,evit-fixed}
compile=${COMPILE:-on}
[[ -x $bench ]] || { echo "cpu-same-run.sh: no bench binary at $bench (BENCH=...)" >&2; exit 2; }
"$python" -c 'import torch, timm' || { echo "cpu-same-run.sh: $python lacks torch or timm" >&2; exit 2; }

for round in $(seq 1 "$rounds"); do
  echo "== round $round: ours"
  "$bench" --device cpu --models "$models" --dtype "$dtypes" --batch "$batches" \
    --pruners "none,$pruners" --paths ragged --reps "$reps" --warmup 2 --out "$out/ours-$round.json"
  echo "== round $round: timm"
  "$python" scripts/peers/timm_deit.py --device cpu --models "$models" --dtype "$dtypes" \
    --batch "$batches" --reps "$reps" --compile "$compile" --budget-s 1e9 --out "$out/peers-$round.json"
done
"$python" scripts/peers/cpu_summary.py "$out" | tee "$out/summary.md"
