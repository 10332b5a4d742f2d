#!/usr/bin/env bash
# Lever 22 on the GPU machine: patchify walking the pixels in image order, 4 at a time, against the
# binary before it (one thread per run of p pixels in output order). Two binaries, one call:
#   .gpu/bench.xz            this bundle (scripts/gpu/bundle.sh)
#   .gpu-prev/bench-prev.xz  the bundle of the commit before the change (same GELU / LayerNorm /
#                            embedding defaults)
# plus .gpu/{test-patch,test-linear,test-paths_agreement}.xz for the checks. From the repo root.
# STAGES (default "checks ab ncu"):
#   checks  test-patch and its memcheck, test-linear (default switches), paths at DeiT-S
#   ab      bench dense, T/S/B, batch 1/8/64/256, f16 and f32, prev / new interleaved, twice;
#           per-row prev/new latency ratios
#   ncu     the patchify kernel alone, prev vs new, DeiT-S batch 256 and 64 (f16) and batch 256 f32
set -u
stages=${STAGES:-checks ab ncu}
. scripts/gpu/lib.sh
unpack bench test-patch test-linear test-paths_agreement
unpack_prev bench || exit 1
start_log patchify.txt
if has checks; then
  echo "== test-patch" >> "$C"; $B/test-patch --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  echo "== memcheck test-patch" >> "$C"
  compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-patch --test-threads=1 2>&1 | grep -E "ERROR SUMMARY|test result" >> "$C"
  echo "== test-linear (defaults)" >> "$C"; $B/test-linear --test-threads=1 2>&1 | grep -E "test result|panicked" >> "$C"
  paths_check deit-small 32
fi
if has ab; then
  for r in 1 2; do
    for a in prev new; do
      bin=$B/bench; [ $a = prev ] && bin=$B/bench-prev
      for d in f16 f32; do
        $bin --device cuda --models deit-tiny,deit-small,deit-base --dtype $d --batch 1,8,64,256 --pruners none --paths ragged --reps 10 --out "$out/patchify-$a-$d-$r.json" > /dev/null 2>&1
        echo "bench $a $d round $r rc=$?" >> "$C"
      done
    done
  done
  python3 scripts/gpu/ab_ratios.py "$out/patchify" prev new >> "$C"
fi
if has ncu; then
  for a in prev new; do
    bin=$B/bench; [ $a = prev ] && bin=$B/bench-prev
    for md in deit-small:256:f16 deit-small:64:f16 deit-small:256:f32; do
      IFS=: read m b d <<< "$md"
      echo "== ncu patchify $a $m batch $b $d" >> "$C"
      ncu -k regex:patchify --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv --print-units base $bin --device cuda --models $m --dtype $d --batch $b --pruners none --paths ragged --reps 1 --warmup 1 --cuda-graph false --out /tmp/x.json 2>/dev/null \
        | python3 -c 'import csv, sys; [print(r[4][:40], r[-3], r[-1]) for r in csv.reader(sys.stdin) if len(r) > 10 and "patchify" in r[4]]' >> "$C"
    done
  done
fi
pack patchify-json.tgz 'patchify-*.json'
cat "$C"
