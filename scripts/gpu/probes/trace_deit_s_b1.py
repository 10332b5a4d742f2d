#!/usr/bin/env python3
"""Reads the TRACE lines of a bench run built with docs/benchmarks/history/stop52-trace.patch
(FASTPATH_TRACE=1 ... --graph-anatomy: per-CTA %globaltimer marks of DeiT-S's batch-1 kernels in
one graph replay) and prints, per launch in replay order, where its time went.

    python3 scripts/gpu/probes/trace_deit_s_b1.py LOG [LABEL_SUBSTRING] [ROUND]

Kinds and marks (t0..t5, ns): 1 qkv / 2 fc1 (thin GEMM: entry, after the wait, first block of x
landed, last block landed, MMAs done, stores done); 3 fc2 + norm1 (entry, after the wait, first
block of h landed, MMAs done, partials in, end); 4 / 5 attention + proj + norm2, ranks that attend
/ do not (entry, after the wait, K / V staged (4 only), attention tile complete, x1 rows in, end).
"""
import statistics
import sys
from collections import defaultdict

KIND = {1: "qkv", 2: "fc1", 3: "fc2+ln1", 4: "attn+proj+ln2", 5: "attn+proj+ln2"}


def load(path, want, rnd):
    recs = []
    for line in open(path):
        if not line.startswith("TRACE "):
            continue
        head, tail = line.split(" | ", 1)
        if head[len("TRACE "):] != want:
            continue
        f = [int(x) for x in tail.split()]
        if f[0] != rnd:
            continue
        # The first trace patch wrote 6 marks (the 6th the exit), the second 14 (the 14th the
        # exit): marks t0..t4 and the exit either way, t5..t9 the attention kernel's finer ones.
        marks = f[3:-1]
        fine = marks[5:10] if len(marks) == 14 else []
        recs.append({"kind": f[1], "block": f[2], "t": marks[:5] + [marks[-1]], "fine": fine, "sm": f[-1]})
    return recs


def launches(recs):
    """Records grouped into launches: same kind group, released from griddepcontrol.wait within
    3 µs of the previous record (a launch's CTAs enter as SMs free up, over several µs under
    programmatic launch, but leave the wait together)."""
    by = defaultdict(list)
    for r in recs:
        by[KIND[r["kind"]]].append(r)
    out = []
    for name, rs in by.items():
        rs.sort(key=lambda r: r["t"][1])
        cur = [rs[0]]
        for r in rs[1:]:
            if r["t"][1] - cur[-1]["t"][1] > 3000:
                out.append((name, cur))
                cur = []
            cur.append(r)
        out.append((name, cur))
    out.sort(key=lambda l: min(r["t"][1] for r in l[1]))
    return out


def med(v):
    return statistics.median(v) if v else float("nan")


def main():
    path = sys.argv[1]
    want = sys.argv[2] if len(sys.argv) > 2 else "deit-small F16 b1 dense"  # the exact label
    rnd = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    ls = launches(load(path, want, rnd))
    if not ls:
        print("no records")
        return
    t_base = min(r["t"][0] for _, rs in ls for r in rs)
    print(f"{want}, round {rnd}: {len(ls)} traced launches; µs from the first traced entry")
    print("launch | CTAs | first entry | wait released (first / last) | prev end -> first release | "
          "after wait: first data / all data / compute / end (medians) | end (median / last) | span")
    prev_end = None
    rows = defaultdict(list)
    for name, rs in ls:
        t = lambda i: [r["t"][i] - t_base for r in rs if r["t"][i]]
        e0, w, end = min(t(0)), t(1), t(5)
        rel = lambda i: [r["t"][i] - r["t"][1] for r in rs if r["t"][i] and r["t"][1]]
        gap = (min(w) - prev_end) if prev_end is not None else float("nan")
        d2, d3, d4 = med(rel(2)), med(rel(3)), med(rel(4))
        de = med(rel(5))
        print(f"{name:14s} | {len(rs):3d} | {e0/1e3:7.2f} | {min(w)/1e3:7.2f} / {max(w)/1e3:7.2f} | {gap/1e3:5.2f} | "
              f"{d2/1e3:5.2f} / {d3/1e3:5.2f} / {d4/1e3:5.2f} / {de/1e3:5.2f} | {med(end)/1e3:7.2f} / {max(end)/1e3:7.2f} | "
              f"{(max(end) - min(w))/1e3:5.2f}")
        rows[name].append((gap, d2, d3, d4, de, (max(end) - min(w)), max(end) - med(end)))
        prev_end = max(end)
    print("\nper kind, medians over its launches: prev end -> release | first data | all data / K,V | compute | "
          "end (after the wait) | release -> last end | last end - median end")
    for name, v in rows.items():
        cols = list(zip(*v))
        print(f"{name:14s} x{len(v):2d}: " + " | ".join(f"{med([c for c in col if c == c])/1e3:5.2f}" for col in cols))
    # The attention kernel's finer marks (second patch), ranks that attend, µs after the wait:
    # K / V staged, warp 0's keys done, every warp's keys done (its state saved), the merge and its
    # pushes issued, the attention tile complete, the projection's partials, x1's pushes issued,
    # x1's rows in, exit.
    fine = []
    for name, rs in ls:
        a = [r for r in rs if r["kind"] == 4 and r["fine"]]
        if not a:
            continue
        col = lambda get: med([get(r) - r["t"][1] for r in a])
        fine.append([col(lambda r: r["t"][2]), col(lambda r: r["fine"][0]), col(lambda r: r["fine"][1]),
                     col(lambda r: r["fine"][2]), col(lambda r: r["t"][3]), col(lambda r: r["fine"][3]),
                     col(lambda r: r["fine"][4]), col(lambda r: r["t"][4]), col(lambda r: r["t"][5])])
    if fine:
        print("\nattention kernel, attending ranks, medians over launches of the per-launch medians (µs after the wait):")
        names = ["K/V staged", "warp 0 keys", "all keys", "merge+push issued", "tile complete",
                 "proj partials", "x1 pushes issued", "x1 rows in", "exit"]
        for i, nm in enumerate(names):
            print(f"  {nm:18s} {med([row[i] for row in fine])/1e3:5.2f}")


main()
