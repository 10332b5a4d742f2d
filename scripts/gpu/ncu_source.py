#!/usr/bin/env python3
"""Summary of ncu's source page (`--section SourceCounters --page source --print-source sass --csv`):
the SASS lines with the most warp stall samples, the code around the hottest, and the samples by
stall column when the page has them.

usage: scripts/gpu/ncu_source.py SRC.csv [--top N] [--context K]
  --top N      how many lines to list (default 30)
  --context K  print the 14 lines before and 2 after each of the K hottest (default 0)
"""
import argparse
import collections
import csv

ap = argparse.ArgumentParser()
ap.add_argument("csv")
ap.add_argument("--top", type=int, default=30)
ap.add_argument("--context", type=int, default=0)
args = ap.parse_args()
rows = list(csv.reader(open(args.csv)))
hdr_i = next((i for i, r in enumerate(rows) if "Source" in r and any("Warp Stall Sampling (All" in c for c in r)), None)
if hdr_i is None:
    print("no source table")
    raise SystemExit
hdr = rows[hdr_i]
src = hdr.index("Source")
allc = next(i for i, c in enumerate(hdr) if c.startswith("Warp Stall Sampling (All"))
stall_cols = [i for i, c in enumerate(hdr) if c.startswith("stall_") or c.startswith("smsp__pcsamp")]
body = [r for r in rows[hdr_i + 1:] if len(r) == len(hdr)]


def num(v):
    v = v.replace(",", "")
    return float(v) if v.replace(".", "").isdigit() else 0.0


total = sum(num(r[allc]) for r in body)
print(f"samples {total:.0f} over {len(body)} SASS lines")
top = sorted(enumerate(body), key=lambda t: -num(t[1][allc]))[: args.top]
for idx, r in top:
    print(f"{idx:5d} {num(r[allc]):7.0f} {100 * num(r[allc]) / max(total, 1):5.1f}%  {r[src][:100]}")
# The instructions just before a stall are what it waits on.
for idx, _ in top[: args.context]:
    print(f"-- around line {idx}")
    for k in range(max(0, idx - 14), min(len(body), idx + 3)):
        print(f"{k:5d} {num(body[k][allc]):7.0f}  {body[k][src][:100]}")
if stall_cols:
    agg = collections.Counter()
    for r in body:
        for i in stall_cols:
            agg[hdr[i]] += num(r[i])
    print("by column:", ", ".join(f"{k} {v:.0f}" for k, v in agg.most_common(14)))
