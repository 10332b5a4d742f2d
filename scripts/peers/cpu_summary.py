#!/usr/bin/env python3
"""The table of scripts/peers/cpu-same-run.sh: per (model, dtype, batch), the median latency over
the rounds of our dense forward, our pruned ones and timm's in PyTorch (eager, torch.compile), and
timm's latency over ours (above 1: ours is faster), each ratio taken within a round first.

usage: scripts/peers/cpu_summary.py OUT_DIR   (reads OUT_DIR/ours-N.json and OUT_DIR/peers-N.json)
"""
import glob
import json
import os
import statistics
import sys
from collections import defaultdict


def load(path):
    r = json.load(open(path))
    rows = {}
    for x in r["rows"]:
        if x.get("cuda_graph"):
            continue
        if x["pruner"] != "none":
            if x.get("decisions", "host") != "host":
                continue  # the same forward with its keep decisions in device code: one row a pruner
            name = f"{x['pruner']}-{x['mode']}"
        else:
            name = x["path"] if x["path"].startswith("torch-") else "dense"
        rows[(x["model"], x["dtype"], x["batch"], name)] = x["latency_ms"]
    return r, rows


def main():
    out = sys.argv[1]
    rounds = []
    for ours in sorted(glob.glob(os.path.join(out, "ours-*.json"))):
        peers = ours.replace("ours-", "peers-")
        if not os.path.exists(peers):
            continue
        (ro, a), (rp, b) = load(ours), load(peers)
        rounds.append({**a, **b})
    if not rounds:
        sys.exit(f"no rounds in {out}")
    print(f"Ours: `{ro['command']}`; peers: `{rp['command']}` ({rp['gpu']}; torch {rp['torch']}, timm {rp['timm']}); "
          f"{len(rounds)} rounds, interleaved. Latency per batch, ms: the median over the rounds; ratios: "
          "the median over the rounds of each round's own ratio.\n")
    keys = sorted({k[:3] for r in rounds for k in r})
    names = sorted({k[3] for r in rounds for k in r})
    ours_names = ["dense"] + [n for n in names if n not in ("dense", "torch-eager", "torch-compile")]
    peer_names = [n for n in ("torch-eager", "torch-compile") if n in names]
    head = ours_names + peer_names + [f"{p} / dense" for p in peer_names] + [f"{p} / {o}" for p in peer_names[:1] for o in ours_names[1:]]
    print("| model | dtype | batch | " + " | ".join(head) + " |")
    print("| --- | --- | ---: | " + " | ".join("---:" for _ in head) + " |")

    def med(key, name):
        v = [r[key + (name,)] for r in rounds if key + (name,) in r]
        return statistics.median(v) if v else None

    def ratio(key, num, den):
        v = [r[key + (num,)] / r[key + (den,)] for r in rounds if key + (num,) in r and key + (den,) in r]
        return statistics.median(v) if v else None

    def fmt(x, digits):
        return "–" if x is None else f"{x:.{digits}f}"

    for key in keys:
        cells = [fmt(med(key, n), 1) for n in ours_names + peer_names]
        cells += [fmt(ratio(key, p, "dense"), 2) for p in peer_names]
        cells += [fmt(ratio(key, p, o), 2) for p in peer_names[:1] for o in ours_names[1:]]
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
