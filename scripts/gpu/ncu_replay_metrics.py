#!/usr/bin/env python3
"""The last K launches of an ncu CSV (`--csv --print-units base`, several --metrics) as one row per
launch: duration (us), DRAM bytes read (KB) and L2 hit rate (%), then the sums. K: the graph's
kernel nodes (bench --graph-anatomy), so that the rows are the last replay. ncu-graph-replay.sh
runs it with DRAM=1.

  scripts/gpu/ncu_replay_metrics.py NCU.csv K LABEL
"""
import collections
import csv
import sys


def main():
    path, k, label = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    hdr, data = rows[0], rows[1:]
    ki, mi, vi, ii = (hdr.index(h) for h in ("Kernel Name", "Metric Name", "Metric Value", "ID"))
    by_id = collections.OrderedDict()
    for r in sorted(data, key=lambda r: int(r[ii])):
        e = by_id.setdefault(int(r[ii]), {"name": r[ki][:70]})
        e[r[mi]] = float(r[vi].replace(",", "") or 0)
    last = list(by_id.values())[-k:]
    t = lambda e: e.get("gpu__time_duration.sum", 0) / 1000
    d = lambda e: e.get("dram__bytes_read.sum", 0) / 1024
    h = lambda e: e.get("lts__t_sector_hit_rate.pct", 0)
    print(f"== ncu, one replay, {label}: {len(last)} kernels, {sum(map(t, last)):.1f} us serialised, "
          f"{sum(map(d, last)) / 1024:.2f} MB read from DRAM")
    print(f"{'#':>4} {'us':>8} {'DRAM KB':>9} {'L2 hit%':>8}  kernel")
    for i, e in enumerate(last):
        print(f"{i:4d} {t(e):8.2f} {d(e):9.1f} {h(e):8.1f}  {e['name']}")


if __name__ == "__main__":
    main()
