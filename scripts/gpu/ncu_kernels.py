#!/usr/bin/env python3
"""Per-kernel GPU time from `ncu --metrics gpu__time_duration.sum --csv --print-units base`
output: launches, time and share per kernel name (first 80 characters), largest first, per forward.

  scripts/gpu/ncu_kernels.py NCU.csv LABEL [--forwards 2] [--top N]

--forwards: how many forwards the profiled run made (bench --warmup 1 --reps 1: two); counts and
times are divided by it. `launches` and `print_by_name` serve ncu_last_replay.py too.
"""
import argparse
import collections
import csv


def launches(path):
    """(kernel name, µs) of every profiled launch of an ncu CSV, in launch order."""
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    hdr, data = rows[0], rows[1:]
    ki, vi, ii = hdr.index("Kernel Name"), hdr.index("Metric Value"), hdr.index("ID")
    data.sort(key=lambda r: int(r[ii]))
    return [(r[ki][:80], float(r[vi].replace(",", "")) / 1000) for r in data]


def print_by_name(launched, forwards=1, top=None):
    """Launches, time and share per kernel name, largest first, each divided by `forwards`."""
    agg = collections.OrderedDict()
    for name, t in launched:
        a = agg.setdefault(name, [0, 0.0])
        a[0] += 1
        a[1] += t
    total = sum(v[1] for v in agg.values())
    f = forwards
    print("launches/fwd  us/fwd  us/launch  share  kernel")
    for k, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{n / f:8.1f} {t / f:9.1f} {t / n:9.2f} {100 * t / total:5.1f}%  {k}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("label")
    ap.add_argument("--forwards", type=int, default=2)
    ap.add_argument("--top", type=int, help="print only the N largest kernels")
    args = ap.parse_args()
    launched = launches(args.csv)
    total = sum(t for _, t in launched)
    f = args.forwards
    print(f"== ncu {args.label}: per forward {len(launched) // f} kernels, {total / f:.1f} us")
    print_by_name(launched, f, args.top)


if __name__ == "__main__":
    main()
