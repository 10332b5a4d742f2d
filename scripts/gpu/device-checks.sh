#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .gpu/ carried (see bundle.sh):
#   STAGES="tests sanitizer parity bench" scripts/gpu/device-checks.sh
# The tests and sanitizer stages run every test executable the bundle holds, so a bundle of a few
# (bundle.sh NAME..., for a 64 MiB carry) checks those.
# Logs and results go to $OUT (the device tool's output folder) or /tmp/gpu-out.
set -uo pipefail
stages=${STAGES:-tests sanitizer parity bench}
. scripts/gpu/lib.sh
unpack
bin=$B
status=0
summary=()
note() { summary+=("$1"); echo "== $1"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"

for stage in $stages; do
  case $stage in
  tests)
    # Every test executable the bundle holds (bundle.sh; a few of them where the device tool
    # carries only part), but the full-size path agreement (the paths stage).
    for t in "$bin"/test-*; do
      name=$(basename "$t")
      [[ $name == test-paths_agreement ]] && continue
      if "$t" --test-threads=1 >> "$out/tests.log" 2>&1; then note "PASS $name"; else note "FAIL $name"; status=1; fi
    done
    if [[ -x $bin/test-linear ]]; then
      # The CUTLASS fc1 takes only large problems by default: run the Linear tests again with every
      # eligible fc1 sent through it (a build without CUTLASS runs the same cuBLASLt path twice).
      if CANDLE_FASTPATH_CUTLASS=1 "$bin"/test-linear --test-threads=1 >> "$out/tests.log" 2>&1; then
        note "PASS test-linear (CANDLE_FASTPATH_CUTLASS=1)"; else note "FAIL test-linear (CANDLE_FASTPATH_CUTLASS=1)"; status=1; fi
      # And with the GELU in its former erff form (CANDLE_FASTPATH_GELU=erf; the default is x·Φ(x)),
      # in both GELU paths.
      if CANDLE_FASTPATH_GELU=erf CANDLE_FASTPATH_CUTLASS=1 "$bin"/test-linear --test-threads=1 >> "$out/tests.log" 2>&1 \
          && CANDLE_FASTPATH_GELU=erf CANDLE_FASTPATH_CUTLASS=0 "$bin"/test-linear --test-threads=1 >> "$out/tests.log" 2>&1; then
        note "PASS test-linear (CANDLE_FASTPATH_GELU=erf)"; else note "FAIL test-linear (CANDLE_FASTPATH_GELU=erf)"; status=1; fi
    fi
    grep -E "^test result|panicked" "$out/tests.log" | sort | uniq -c
    ;;
  sanitizer)
    # memcheck over every GPU test the bundle holds (not the CUDA-graph ones: graph, paths;
    # gelu_phi runs no kernel); racecheck (much slower) over the kernels' shapes that matter.
    for t in "$bin"/test-*; do
      name=$(basename "$t")
      case $name in test-paths_agreement | test-graph | test-gelu_phi) continue ;; esac
      if compute-sanitizer --tool memcheck --error-exitcode 9 "$t" --test-threads=1 >> "$out/sanitizer.log" 2>&1; then
        note "memcheck clean $name"; else note "memcheck FAIL $name"; status=1; fi
    done
    if [[ -x $bin/test-linear ]]; then
      if CANDLE_FASTPATH_CUTLASS=1 compute-sanitizer --tool memcheck --error-exitcode 9 "$bin"/test-linear --test-threads=1 >> "$out/sanitizer.log" 2>&1; then
        note "memcheck clean test-linear (CANDLE_FASTPATH_CUTLASS=1)"; else note "memcheck FAIL test-linear (CANDLE_FASTPATH_CUTLASS=1)"; status=1; fi
    fi
    # race NAME [FILTER...]: racecheck of test-NAME (those tests), any hazard a failure.
    race() {
      local name=$1; shift
      [[ -x $bin/test-$name ]] || return 0
      if compute-sanitizer --tool racecheck --error-exitcode 9 "$bin/test-$name" --test-threads=1 "$@" >> "$out/sanitizer.log" 2>&1; then
        note "racecheck clean $name"; else note "racecheck FAIL $name"; status=1; fi
    }
    # race_ours NAME FILTER: the same for tests whose reference steps run cuBLASLt, whose own
    # `nvjet` kernels racecheck reports: only a log line naming our kernels (fastpath_*, ragged_*)
    # fails (lib.sh's racecheck_ours). Their quick forms (env below) keep racecheck's thousands-fold slowdown in bounds.
    race_ours() {
      local name=$1 filter=$2
      [[ -x $bin/test-$name ]] || return 0
      local failed=0
      C="$out/sanitizer.log" racecheck_ours "$name" "$filter" 'fastpath_\|ragged_' 3600 || failed=1
      cat /tmp/race.log >> "$out/sanitizer.log"
      if [[ $failed -eq 0 ]]; then note "racecheck clean $name $filter (ours)"; else
        note "racecheck FAIL $name $filter (the run failed or a report names our kernels)"; status=1; fi
    }
    race attention odd_lengths_every_dtype every_head_dim mixed_lengths_in_one_batch
    race pack
    race select
    race select_rule every_rule_once
    race select_bounded
    race sequence_mean
    race step_scores
    race small_block repeated
    NORM_LINEAR_TEST_QUICK=1 race_ours norm_linear _matches_the_steps
    ATTENTION_RNL_TEST_QUICK=1 race_ours attention_norm_linear matches
    ATTENTION_RNL_TEST_QUICK=1 race_ours attention_lrn matches
    race_ours linear thin_gemm_matches_reference_at_batch_one_rows
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race" "$out/sanitizer.log" | sort | uniq -c | head -20
    ;;
  parity)
    work=/tmp/parity
    mkdir -p "$work"
    if python3 scripts/gpu/timm_parity.py "$work" "$bin/classify" > "$out/parity.log" 2>&1; then
      note "parity ok (timm vs ours on cpu and cuda)"; else note "parity FAIL"; status=1; fi
    tail -25 "$out/parity.log"
    ;;
  paths)
    # Full-size DeiT-T/S/B agreement of the padded and ragged paths on the GPU.
    if PATHS_DEVICE=cuda PATHS_MODELS=${PATHS_MODELS:-deit-tiny,deit-small,deit-base} PATHS_BATCH=${PATHS_BATCH:-32} \
        "$bin"/test-paths_agreement --ignored --test-threads=1 --nocapture > "$out/paths.log" 2>&1; then
      note "paths agreement ok (full size, cuda)"; else note "paths agreement FAIL"; status=1; fi
    grep -E "test |result|max|agree" "$out/paths.log" | tail -30
    ;;
  e2e)
    if "$bin/bench" --device cuda --out "$out/h100-e2e.json" ${E2E_ARGS:-} > "$out/e2e.log" 2>&1; then
      note "e2e bench ok"; else note "e2e bench FAIL"; status=1; fi
    tail -80 "$out/e2e.log"
    ;;
  ncu)
    # Where the attention kernel's time goes at the size the HBM-floor target is set for.
    ncu --kernel-name regex:ragged_attn --launch-skip 20 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        "$bin/bench-attention" --heads 12 --batch 256 --keep 0.7 --dtype f16 --host-calls 10 --gpu-reps 3 \
        --out /tmp/ncu-bench.json > "$out/ncu.log" 2>&1 && note "ncu ok" || { note "ncu FAIL"; status=1; }
    grep -E "Duration|Throughput|Occupancy|Registers|Stall|Warp Cycles|Issued|Eligible|L2|DRAM|Block Limit" "$out/ncu.log" | head -60
    ;;
  peers)
    # PyTorch peers (timm DeiT eager / CUDA graph / torch.compile) next to our own bench, same run.
    if PYTHONUNBUFFERED=1 python3 scripts/peers/timm_deit.py --out "$out/h100-peers.json" ${PEERS_ARGS:-} > "$out/peers.log" 2>&1; then
      note "peers ok"; else note "peers FAIL"; status=1; fi
    tail -40 "$out/peers.log"
    ;;
  eval)
    # eval on a generated labelled folder with timm's DeiT-S (random weights) on CUDA, every
    # pruner x mode x path; JSON, CSV and chart to $out.
    python3 scripts/gpu/make_labelled_folder.py /tmp/eval-images --images ${EVAL_IMAGES:-3000} --classes 10 > "$out/eval.log" 2>&1
    python3 -c "import timm, torch; from safetensors.torch import save_file; torch.manual_seed(0); m = timm.create_model('deit_small_patch16_224'); save_file({k: v.contiguous() for k, v in m.state_dict().items()}, '/tmp/deit_small_random.safetensors')" >> "$out/eval.log" 2>&1
    settings=none
    for p in threshold-l2 threshold-l2-adaptive dynamicvit dynamicvit-adaptive evit evit-adaptive ats ats-adaptive; do
      settings="$settings,$p:padded,$p:ragged"
    done
    if "$bin/eval" /tmp/eval-images --model deit-small --weights /tmp/deit_small_random.safetensors --device cuda \
        --dtype ${EVAL_DTYPE:-f32} --batch-size 64 --settings "$settings" --json "$out/h100-eval.json" \
        --csv "$out/h100-eval.csv" --chart "$out/h100-eval.svg" >> "$out/eval.log" 2>&1; then
      note "eval ok"; else note "eval FAIL"; status=1; fi
    tail -60 "$out/eval.log"
    ;;
  bench)
    if "$bin/bench-attention" --out "$out/h100-attention.json" \
        --command "bench-attention --out docs/benchmarks/h100-attention.json (scripts/gpu/device-checks.sh, STAGES=bench)" \
        > "$out/bench.log" 2>&1; then note "bench ok"; else note "bench FAIL"; status=1; fi
    cat "$out/bench.log" | tail -110
    ;;
  *) echo "unknown stage $stage"; status=1 ;;
  esac
done
echo
printf '%s\n' "${summary[@]}"
exit $status
