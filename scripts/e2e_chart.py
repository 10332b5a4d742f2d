#!/usr/bin/env python3
"""img/s vs batch per execution path, one panel per model, from docs/benchmarks/h100-e2e.json.

usage: scripts/e2e_chart.py docs/benchmarks/h100-e2e.json docs/benchmarks/h100-e2e.svg   (needs matplotlib)
"""
import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src, dst = sys.argv[1], sys.argv[2]
report = json.load(open(src))
models = sorted({r["model"] for r in report["rows"]}, key=["deit-tiny", "deit-small", "deit-base"].index)
fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.2), squeeze=False)
# Row kinds: path, plus (ragged) whether decisions ran on the device, plus whether the forward was
# replayed from a CUDA graph. Older JSON files have neither key: host decisions, no graph.
styles = {
    "dense": ("black", "-"),
    "dense, CUDA graph": ("black", ":"),
    "padded": ("tab:orange", "--"),
    "ragged": ("tab:blue", "-"),
    "ragged, device decisions, CUDA graph": ("tab:green", "-"),
}


def kind(r):
    if r["path"] == "dense":
        return "dense, CUDA graph" if r.get("cuda_graph") else "dense"
    if r["path"] == "ragged" and r.get("decisions") == "device":
        return "ragged, device decisions, CUDA graph" if r.get("cuda_graph") else None
    return r["path"]


for ax, model in zip(axes[0], models):
    series = defaultdict(list)
    for r in report["rows"]:
        if r["model"] != model or r["dtype"] != "f16":
            continue
        k = kind(r)
        if k is None:
            continue
        series[(k, f"{r['pruner']} {r['mode']}")].append((r["batch"], r["img_s"]))
    for (k, _), pts in sorted(series.items()):
        pts.sort()
        color, ls = styles[k]
        dense = k.startswith("dense")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=color, alpha=1.0 if dense else 0.55,
                lw=2.5 if dense else 1.2, marker="o", ms=3)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"{model}, f16")
    ax.set_xlabel("batch")
    ax.set_ylabel("images / s")
    ax.grid(True, which="both", alpha=0.3)
handles = [plt.Line2D([], [], color=c, ls=l, lw=2) for c, l in styles.values()]
fig.legend(handles, ["dense", "dense, CUDA graph", "pruned, padded (each pruner x mode)",
                     "pruned, ragged, host decisions (each pruner x mode)",
                     "pruned, ragged, device decisions + CUDA graph (fixed modes)"],
           loc="lower center", ncol=3, fontsize=8)
fig.suptitle(f"End-to-end DeiT throughput, {report['gpu']}")
fig.tight_layout(rect=(0, 0.12, 1, 0.95))
fig.savefig(dst)
print(f"wrote {dst}")
