#!/usr/bin/env python3
"""The kernels of one CUDA-graph replay from `ncu --graph-profiling node --metrics
gpu__time_duration.sum --csv --print-units base` output of a `bench` run whose last launches are
that replay: the last K profiled launches (K = the graph's kernel nodes, from `bench
--graph-anatomy`), in launch order, then summed by kernel name.

  scripts/gpu/ncu_last_replay.py NCU.csv K LABEL
"""
import collections
import csv
import sys


def main():
    path, k, label = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    hdr, data = rows[0], rows[1:]
    ki, vi, ii = hdr.index("Kernel Name"), hdr.index("Metric Value"), hdr.index("ID")
    data.sort(key=lambda r: int(r[ii]))
    last = [(r[ki][:70], float(r[vi].replace(",", "")) / 1000) for r in data[-k:]]
    total = sum(t for _, t in last)
    print(f"== ncu, one replay, {label}: {len(last)} kernels, {total:.1f} us (serialised)")
    for i, (name, t) in enumerate(last):
        print(f"{i:4d} {t:8.2f}  {name}")
    agg = collections.OrderedDict()
    for name, t in last:
        a = agg.setdefault(name, [0, 0.0])
        a[0] += 1
        a[1] += t
    print("launches   us   us/launch  share  kernel")
    for name, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"{n:6d} {t:8.1f} {t / n:8.2f} {100 * t / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
