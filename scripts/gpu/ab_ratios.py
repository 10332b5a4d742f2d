#!/usr/bin/env python3
"""Per-row A/B table of `bench` or `bench-attention` JSON, the arms side by side: the mean of each
arm's runs, then first-arm / arm ratios (above 1: the arm is faster).

  scripts/gpu/ab_ratios.py PREFIX ARM [ARM...]                 bench rows, mean latency_ms
  scripts/gpu/ab_ratios.py --attn PREFIX ARM [ARM...]          bench-attention ragged rows, gpu_us
  scripts/gpu/ab_ratios.py --attn --metric host_us PREFIX ...  the same, host time per call

Reads PREFIX-ARM-ROUND.json and PREFIX-ARM-DTYPE-ROUND.json (e.g. $OUT/e2e-base-1.json,
$OUT/e2e-off-f16-2.json). Names are matched whole, so arm `pingpong` does not also read
`pingpong-epi64`'s files. A row an arm lacks (a run that failed) shows as `-`.
"""
import argparse
import glob
import json
import os
import re

E2E_KEY = ("model", "dtype", "pruner", "mode", "batch", "decisions", "cuda_graph")
ATTN_KEY = ("dtype", "heads", "batch", "keep")


def runs(prefix, arm):
    pattern = re.compile(re.escape(os.path.basename(prefix)) + "-" + re.escape(arm) + r"(-(f16|bf16|f32))?-\d+\.json")
    return sorted(p for p in glob.glob(prefix + "-*.json") if pattern.fullmatch(os.path.basename(p)))


def load(prefix, arm, attn, metric):
    rows, floors = {}, {}
    for path in runs(prefix, arm):
        for r in json.load(open(path))["rows"]:
            if attn and r["method"] != "ragged":
                continue
            key = tuple(r[f] for f in (ATTN_KEY if attn else E2E_KEY))
            rows.setdefault(key, []).append(r[metric])
            if attn:
                floors[key] = r["floor_us"]
    return {k: sum(v) / len(v) for k, v in rows.items()}, floors


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attn", action="store_true", help="bench-attention JSON (ragged rows)")
    ap.add_argument("--metric", help="row field to average (default: latency_ms, or gpu_us with --attn)")
    ap.add_argument("prefix")
    ap.add_argument("arms", nargs="+")
    args = ap.parse_args()
    metric = args.metric or ("gpu_us" if args.attn else "latency_ms")
    data, floors = {}, {}
    for arm in args.arms:
        data[arm], f = load(args.prefix, arm, args.attn, metric)
        floors.update(f)
    base = data[args.arms[0]]
    fmt = (lambda x: f"{x:.1f}") if args.attn and metric != "host_us" else (lambda x: f"{x:.3f}")
    cell = lambda d, k: fmt(d[k]) if k in d else "-"
    ratio = lambda d, k: f"{base[k] / d[k]:.3f}" if k in d else "-"
    first, rest = args.arms[0], args.arms[1:]
    print(*(ATTN_KEY if args.attn else E2E_KEY), "|", *(["floor us |"] if args.attn else []),
          "mean", metric, *args.arms, "|", *(f"{first}/{a}" for a in rest))
    for k in sorted(base):
        print(*k, "|", *([f"{floors[k]:.1f} |"] if args.attn else []),
              *(cell(data[a], k) for a in args.arms), "|", *(ratio(data[a], k) for a in rest))


if __name__ == "__main__":
    main()
