#!/usr/bin/env bash
# Levers 43-44 on the GPU machine, from the repo root: pruners whose counts come from the scores
# (adaptive modes, ATS) replayed as CUDA graphs with a read of one step's total between them
# (models::StagedGraph; bench rows with decisions "two-stage": a read after the first step only,
# "staged": after every step), next to the one capacity-sized graph (decisions "device", CUDA
# graph) and dense, in the same bench run.
# Needs .gpu/{bench,test-graph,test-paths_agreement}.xz (scripts/gpu/bundle.sh).
# STAGES (default "e2e checks"):
#   e2e     bench dense + Threshold-L2 / DynamicViT / EViT adaptive + ATS fixed / adaptive,
#           ragged, T/S/B, batch 1/8/64/256, f16 (E2E_ARGS overrides); a second run if the
#           first left time (ROUNDS, default 2, at most 420 s in all)
#   checks  test-graph (capture_many), memcheck of it, paths T/S/B at batch 32 (the split
#           forwards and both staged graphs against the capturable forward, f32), memcheck of
#           paths DeiT-T batch 8
set -u
stages=${STAGES:-e2e checks}
. scripts/gpu/lib.sh
unpack bench test-graph test-paths_agreement
start_log two-stage.txt
if has e2e; then
  for r in $(seq 1 "${ROUNDS:-2}"); do
    [ "$r" -gt 1 ] && [ $SECONDS -gt ${ROUND2_BEFORE:-200} ] && { echo "e2e round $r skipped (time)" >> "$C"; break; }
    t0=$SECONDS
    timeout 400 $B/bench --device cuda ${E2E_ARGS:---models deit-tiny,deit-small,deit-base --dtype f16 --batch 1,8,64,256 --pruners none,threshold-l2-adaptive,dynamicvit-adaptive,evit-adaptive,ats --paths ragged --reps 10} --out "$out/e2e-$r.json" > "$out/e2e-$r.log" 2>&1
    echo "e2e round $r rc=$? $((SECONDS - t0)) s" >> "$C"
  done
  python3 - "$out" >> "$C" <<'PY'
import glob, json, sys
for path in sorted(glob.glob(sys.argv[1] + "/e2e-*.json")):
    rows = json.load(open(path))["rows"]
    print("==", path.rsplit("/", 1)[1], "| latency ms: dense graph | device graph | two-stage | staged | device eager || device graph / two-stage, / staged; dense graph / staged | peak MiB device graph / two-stage / staged")
    dense = {(r["model"], r["batch"]): r for r in rows if r["path"] == "dense" and r["cuda_graph"]}
    keys = sorted({(r["model"], r["batch"], r["pruner"], r["mode"]) for r in rows if r["path"] == "ragged"})
    for k in keys:
        pick = lambda dec, g: next((r for r in rows if (r["model"], r["batch"], r["pruner"], r["mode"]) == k and r["decisions"] == dec and r["cuda_graph"] == g), None)
        dg, ts, st, de, dn = pick("device", True), pick("two-stage", True), pick("staged", True), pick("device", False), dense.get(k[:2])
        if not ts or not dg or not dn or not st:
            continue
        f = lambda r: f"{r['latency_ms']:.3f}" if r else "-"
        q = lambda a, b: f"{a['latency_ms'] / b['latency_ms']:.3f}"
        m = lambda r: f"{r.get('peak_mem_mb') or 0:.0f}"
        print(*k, "|", f(dn), f(dg), f(ts), f(st), f(de), "||", q(dg, ts), q(dg, st), q(dn, st), "|", m(dg), "/", m(ts), "/", m(st), f"kept {st['mean_kept_tokens']:.1f}")
PY
fi
if has checks; then
  echo "== test-graph" >> "$C"
  timeout 120 $B/test-graph --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "== memcheck test-graph" >> "$C"
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-graph --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  echo "== paths (cuda, T/S/B, batch 32)" >> "$C"
  PATHS_DEVICE=cuda PATHS_MODELS=deit-tiny,deit-small,deit-base PATHS_BATCH=32 timeout 240 $B/test-paths_agreement --ignored --test-threads=1 > "$out/paths.log" 2>&1
  echo "paths rc=$?" >> "$C"
  grep -E "test result|panicked|two-stage" "$out/paths.log" | head -20 >> "$C"
  left=$((570 - SECONDS))
  if [ $left -gt 60 ]; then
    echo "== memcheck paths (cuda, DeiT-T, batch 8), ${left} s" >> "$C"
    PATHS_DEVICE=cuda PATHS_MODELS=deit-tiny PATHS_BATCH=8 timeout $left compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-paths_agreement --ignored --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result|panicked" >> "$C"
    echo "memcheck paths rc=${PIPESTATUS[0]}" >> "$C"
  fi
fi
pack two-stage-json.tgz 'e2e-*.json' 'e2e-*.log' 'paths.log'
cat "$C"
