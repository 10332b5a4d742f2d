# Shared by the scripts in scripts/gpu/ that run on the GPU machine; source it from the repo root.
# Sets where results go ($out: the device tool's $OUT, else /tmp/gpu-out) and where the bundle's
# binaries are unpacked ($B), puts CUDA's libraries and tools on the paths, and makes the GPU tests
# fail instead of running on the CPU when no GPU is found.
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
B=/tmp/gpu-bin; mkdir -p "$B"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=/usr/local/cuda/bin:$PATH
export CANDLE_RAGGED_REQUIRE_CUDA=1

# start_log FILE: the script's log $C = $out/FILE, opened with the GPU's name.
start_log() {
  C="$out/$1"
  nvidia-smi --query-gpu=name --format=csv,noheader >> "$C"
}

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

# unpack_prev NAME...: .gpu-prev/NAME-prev.xz (a binary built from the commit before a change,
# for two-binary A/B scripts) into $B/NAME-prev, executable; a missing one is an error.
unpack_prev() {
  local name
  for name in "$@"; do
    xz -dc ".gpu-prev/$name-prev.xz" > "$B/$name-prev" && chmod +x "$B/$name-prev" || return 1
  done
}

# prev_or_new ARM NAME: $B/NAME-prev for ARM "prev", else $B/NAME (two-binary A/B arms).
prev_or_new() { if [ "$1" = prev ]; then echo "$B/$2-prev"; else echo "$B/$2"; fi; }

# build_probe NAME: the standalone probe scripts/gpu/probes/NAME.cu compiled for the H100 into
# /tmp/NAME.
build_probe() {
  nvcc -O3 -std=c++17 -arch=sm_90a -o "/tmp/$1" "scripts/gpu/probes/$1.cu" -lcuda -lcublasLt
}

# probe_twice NAME [LIMIT]: build_probe NAME, then run it twice (under `timeout LIMIT`, default
# 120 s), its output appended to $C under "== run N" headers (the GPU's clocks drift between runs).
probe_twice() {
  local r
  build_probe "$1" || return 1
  for r in 1 2; do
    echo "== run $r" >> "$C"
    timeout "${2:-120}" "/tmp/$1" >> "$C" 2>&1
  done
}

# paths_check MODELS BATCH [LIMIT]: the full-size path-agreement test (test-paths_agreement
# --ignored published_sizes_padded_equals_ragged) on CUDA for MODELS at BATCH, under `timeout
# LIMIT` (0 or absent: none); appends "== paths MODELS", its exit status and its result line to
# the script's log $C.
paths_check() {
  echo "== paths $1" >> "$C"
  PATHS_DEVICE=cuda PATHS_MODELS=$1 PATHS_BATCH=$2 timeout "${3:-0}" $B/test-paths_agreement --ignored --test-threads=1 published_sizes_padded_equals_ragged > /tmp/paths.log 2>&1
  echo "paths rc=$?" >> "$C"
  grep -E "test result" /tmp/paths.log | tail -1 >> "$C"
}

# tests_results LIMIT NAME...: each test-NAME the bundle has (under `timeout LIMIT`), its result,
# panic and error lines appended to $C under a header; a NAME the bundle lacks is logged as such.
tests_results() {
  local limit=$1 t
  shift
  for t in "$@"; do
    [ -f "$B/test-$t" ] || { echo "== test-$t: not in this bundle" >> "$C"; continue; }
    echo "== test-$t" >> "$C"
    timeout "$limit" $B/test-$t --test-threads=1 2>&1 | grep -E "test result|panicked|rror" >> "$C"
  done
}

# tests_memcheck NAME...: each test-NAME's result lines, then its run under compute-sanitizer
# memcheck (its error summary), appended to $C.
tests_memcheck() {
  local t
  for t in "$@"; do
    echo "== test-$t, then under memcheck" >> "$C"
    timeout 200 $B/test-$t --test-threads=1 2>&1 | grep -E -A3 "test result|panicked" | head -12 >> "$C"
    timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-$t --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  done
}

# test_arms VAR "ARMS" NAME: test-NAME once per arm of ARMS with VAR set to it (`default`: VAR
# empty, the library's default), its result and panic lines appended to $C under a header naming
# the arm; with ARMS "default", just the test.
test_arms() {
  local var=$1 arms=$2 name=$3 arm
  for arm in $arms; do
    echo "== test-$name, $var=${arm#default}" >> "$C"
    env "$var=${arm#default}" timeout 200 $B/test-$name --test-threads=1 2>&1 | grep -E "test result|panicked|rror" >> "$C"
  done
}

# sanitize NAME [TEST_FILTER]: test-NAME (its TEST_FILTER tests, or all) under compute-sanitizer
# memcheck, then racecheck; each run's error / hazard summary and result line appended to $C.
sanitize() {
  echo "== test-$1${2:+ $2} under memcheck" >> "$C"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-$1 --test-threads=1 ${2:-} 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  echo "== test-$1${2:+ $2} under racecheck" >> "$C"
  timeout 400 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test-$1 --test-threads=1 ${2:-} 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" >> "$C"
}

# anatomy VAR "ARMS" BENCH_ARGS...: for each arm of ARMS (`default`: VAR unset), `bench
# --graph-anatomy` with VAR set to it and BENCH_ARGS (models, dtype, batch, pruners); its
# per-graph lines appended to $C under a header naming the arm.
anatomy() {
  local var=$1 arms=$2 arm
  shift 2
  for arm in $arms; do
    echo "== graph anatomy, $var=${arm#default}" >> "$C"
    env "$var=${arm#default}" timeout 200 $B/bench --device cuda "$@" --paths ragged --reps 100 --graph-anatomy --out /tmp/anat.json 2>&1 \
      | grep -E "^graph|rror" | grep -v "only:" >> "$C"
  done
}

# racecheck_ours NAME FILTER KERNEL [LIMIT]: test-NAME's FILTER tests under compute-sanitizer
# racecheck (under `timeout LIMIT`, default 300; assignments before the call reach the test), its
# summary, the hazard reports counted per kernel and the number of log lines naming KERNEL
# appended to $C. Racecheck also reports cuBLASLt's nvjet GEMMs that reference steps run, which
# are not ours; ours must have none. (--kernel-name kns=... made the sanitizer fail with an
# internal error, hence the count.) Succeeds only if the run did and no log line names KERNEL (a
# grep basic regex); /tmp/race.log keeps the whole log.
racecheck_ours() {
  local name=$1 filter=$2 kernel=$3
  echo "== test-$name $filter under racecheck" >> "$C"
  timeout "${4:-300}" compute-sanitizer --tool racecheck $B/test-$name --test-threads=1 "$filter" > /tmp/race.log 2>&1
  local rc=$? ours
  grep -E "RACECHECK SUMMARY|test result" /tmp/race.log >> "$C"
  echo "hazard reports by kernel:" >> "$C"
  grep -oE "Race reported between [A-Za-z]+ access at [A-Za-z0-9_]+" /tmp/race.log | awk '{print $NF}' | sort | uniq -c >> "$C"
  ours=$(grep -c "$kernel" /tmp/race.log)
  echo "lines naming $kernel: $ours" >> "$C"
  [[ $rc -eq 0 && $ours -eq 0 ]]
}

# ncu_forward ENV TITLE BENCH_ARGS...: per-kernel times (ncu, caches and clocks left alone: warm,
# boost) of `bench BENCH_ARGS --paths ragged --reps 1 --warmup 1 --cuda-graph false`, run with the
# space-separated assignments ENV (may be empty) and the one-kernel block off (so the eager
# forwards run a graph's kernels), summarised by ncu_kernels.py under TITLE and appended to $C.
ncu_forward() {
  local envs=$1 title=$2
  shift 2
  # shellcheck disable=SC2086  # ENV: assignments split into words
  env $envs CANDLE_FASTPATH_SMALL_BLOCK=0 ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    $B/bench --device cuda "$@" --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json > /tmp/ncu.csv 2>/dev/null
  python3 scripts/gpu/ncu_kernels.py /tmp/ncu.csv "$title" >> "$C"
}

# replay_arms VAR "ARMS" "FORWARDS" KERNELS: per arm of ARMS (`default`: VAR empty), one graph
# replay's kernels under ncu (ncu-graph-replay.sh with FORWARDS, its log $out/replay-ARM.txt), then
# its graph and total lines and the by-name rows of the kernels matching the extended regex
# KERNELS appended to $C under a header naming the arm.
replay_arms() {
  local var=$1 arms=$2 forwards=$3 kernels=$4 a
  for a in $arms; do
    echo "== replay, $var=${a#default}" >> "$C"
    env "$var=${a#default}" FORWARDS="$forwards" LOG="replay-$a.txt" bash scripts/gpu/ncu-graph-replay.sh > /dev/null 2>&1
    grep -E "^graph|^==|launches" "$out/replay-$a.txt" >> "$C"
    grep -E "^ +[0-9]+ +[0-9.]+ +[0-9.]+ " "$out/replay-$a.txt" | grep -E "$kernels" >> "$C"
  done
}

# graphs_check [LIMIT]: test-paths_agreement's one_image_graphs_agree_with_the_padded_path on CUDA
# (DeiT-T and DeiT-T distilled, batch 1, f16 / bf16: dense and fixed-pruner CUDA graphs, where
# the chained batch-1 kernels run, against the padded path); appends its exit status, its
# per-graph max |Δlogit| lines and its result line to $C.
graphs_check() {
  echo "== graphs: one image, CUDA graphs vs padded" >> "$C"
  PATHS_DEVICE=cuda timeout "${1:-0}" $B/test-paths_agreement --ignored --test-threads=1 --nocapture one_image_graphs_agree_with_the_padded_path > /tmp/graphs.log 2>&1
  echo "graphs rc=$?" >> "$C"
  grep -E "vs padded|panicked|differ|test result" /tmp/graphs.log | tail -20 >> "$C"
}

# step NAME LIMIT CMD...: CMD under `timeout LIMIT`, then "NAME rc=<status> <seconds> s" appended
# to the script's log $L.
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@"; local rc=$?; echo "$name rc=$rc $((SECONDS - t0)) s" >> "$L"; }

# has STAGE: whether the space-separated $stages names STAGE.
has() { [[ " $stages " == *" $1 "* ]]; }

# ab_rounds NAME RUN [ab_ratios.py flags]: two rounds with the arms of $ARMS interleaved, each run
# being `RUN ARM JSON` (a function of the script) into $out/NAME-ARM-ROUND.json, its exit status
# logged to $C; then ab_ratios.py's per-row table of the arms (first arm / arm) into $C.
ab_rounds() {
  local name=$1 run=$2 r a
  shift 2
  for r in 1 2; do
    for a in $ARMS; do
      "$run" "$a" "$out/$name-$a-$r.json" > /dev/null 2>&1
      echo "$name $a round $r rc=$?" >> "$C"
    done
  done
  python3 scripts/gpu/ab_ratios.py "$@" "$out/$name" $ARMS >> "$C"
}

# batch1_paths_graphs: the model-level checks of a DeiT-S batch-1 lever: paths at DeiT-S batch 1
# and 8, the one-image graphs at DeiT-T and at DeiT-S (GRAPHS_MODELS).
batch1_paths_graphs() {
  paths_check deit-small 1 300
  paths_check deit-small 8 300
  graphs_check 200
  GRAPHS_MODELS=deit-small graphs_check 200
}

# The three batch-1 stages of a lever's A/B script (ab-thin-gemm.sh, ab-thin-residual-norm.sh),
# for the arms ARMS of the switch VAR (`default`: VAR empty, the library's default) and the
# comma-separated MODELS:
# batch1_anatomy: `anatomy` twice, f16, dense and the fixed pruners.
batch1_anatomy() {
  local var=$1 arms=$2 models=$3 r
  for r in 1 2; do
    anatomy "$var" "$arms" --models "$models" --dtype f16 --batch 1 --pruners none,threshold-l2-fixed,evit-fixed,dynamicvit-fixed
  done
}
# batch1_ncu: per-kernel times of a dense f16 forward per arm and model (eager forwards with the
# graph's kernels), warm caches, boost clocks.
batch1_ncu() {
  local var=$1 arms=$2 models=$3 a model
  for a in $arms; do for model in ${models//,/ }; do
    ncu_forward "$var=${a#default}" "$model batch 1 f16 dense, $var=${a#default} (eager forwards with the graph's kernels), warm, boost clocks" \
      --models "$model" --dtype f16 --batch 1 --pruners none
  done; done
}
# batch1_e2e NAME: bench at batch 1, DTYPES (default f16,bf16), every pruner and mode, ragged path, the arms
# interleaved, two rounds (ab_rounds into $out/NAME-ARM-ROUND.json; VAR and MODELS from the
# variables of those names).
batch1_e2e_run() {
  env "$VAR=${1#default}" timeout 250 "$B/bench" --device cuda --models "$MODELS" --dtype "${DTYPES:-f16,bf16}" --batch 1 \
    --pruners none,threshold-l2,dynamicvit,evit,ats --paths ragged --reps 10 --out "$2"
}
batch1_e2e() { ab_rounds "$1" batch1_e2e_run; }

# pack ARCHIVE PATTERN...: the files of $out matching the patterns, packed into $out/ARCHIVE and
# removed (the device tool returns at most 8 files). Patterns that match nothing are skipped; with
# no file at all nothing is written. An ARCHIVE already there (a script run twice in one device
# call) is unpacked first and its files packed again with the new ones, not overwritten.
pack() {
  local archive=$1 files old=""
  shift
  if [ -f "$out/$archive" ]; then
    old=$(cd "$out" && tar tzf "$archive" && tar xzf "$archive" && rm -f "$archive")
  fi
  # shellcheck disable=SC2086  # file names from $out: no spaces
  files=$( (cd "$out" && for p in "$@"; do compgen -G "$p"; done; printf '%s\n' $old) | sort -u | grep -v '^$')
  [ -n "$files" ] || return 0
  # shellcheck disable=SC2086  # file names from $out: no spaces
  (cd "$out" && tar czf "$archive" $files && rm -f $files)
}
