#!/usr/bin/env bash
# Issue 4's rule (pruned-ragged at least as fast as our own dense) at small batches, on the GPU
# machine: bench T/S/B, batch RULE_BATCH (default 1,8), f16, every pruner in both modes, ragged
# path (every decision mode and graph kind bench has), RULE_ROUNDS (default 2) runs; per run and
# cell, the best ragged row against the best dense row. Needs .gpu/bench.xz; repo root.
set -u
. scripts/gpu/lib.sh
unpack bench
start_log rule-small-batches.txt
for r in $(seq 1 "${RULE_ROUNDS:-2}"); do
  timeout 280 $B/bench --device cuda --models deit-tiny,deit-small,deit-base --dtype f16 --batch "${RULE_BATCH:-1,8}" \
    --pruners none,threshold-l2,dynamicvit,evit,ats --paths ragged --reps 20 --out "$out/rule-$r.json" > /dev/null 2>&1
  echo "bench round $r rc=$?" >> "$C"
done
python3 - "$out"/rule-*.json >> "$C" <<'PY'
import json, sys
from collections import defaultdict
cells = defaultdict(list)
for f in sys.argv[1:]:
    best = {}
    for r in json.load(open(f))["rows"]:
        key = (r["model"], r["batch"], r["pruner"], r["mode"])
        best[key] = max(best.get(key, 0.0), r["img_s"])
    for (m, b, p, mo), v in best.items():
        if p != "none":
            cells[(m, b, p, mo)].append(v / best[(m, b, "none", "none")])
print("model batch pruner mode | best ragged / best dense, per run")
ok = 0
for k in sorted(cells):
    rs = cells[k]
    ok += min(rs) >= 1.0
    print(*k, "|", " ".join(f"{x:.3f}" for x in rs))
print(f"cells at >= 1.0 in every run: {ok} / {len(cells)}")
PY
pack rule-json.tgz 'rule-*.json'
cat "$C"
