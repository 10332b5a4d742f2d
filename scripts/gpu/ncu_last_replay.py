#!/usr/bin/env python3
"""The kernels of one CUDA-graph replay from `ncu --graph-profiling node --metrics
gpu__time_duration.sum --csv --print-units base` output of a `bench` run whose last launches are
that replay: the last K profiled launches (K = the graph's kernel nodes, from `bench
--graph-anatomy`), in launch order, then summed by kernel name (ncu_kernels.py's table, one
forward).

  scripts/gpu/ncu_last_replay.py NCU.csv K LABEL
"""
import sys

from ncu_kernels import launches, print_by_name


def main():
    path, k, label = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    last = launches(path)[-k:]
    total = sum(t for _, t in last)
    print(f"== ncu, one replay, {label}: {len(last)} kernels, {total:.1f} us (serialised)")
    for i, (name, t) in enumerate(last):
        print(f"{i:4d} {t:8.2f}  {name}")
    print_by_name(last)


if __name__ == "__main__":
    main()
