#!/usr/bin/env python3
"""Markdown tables from the benchmark JSON files (docs/benchmarks/*.json), for docs/BENCHMARKS.md.

usage: scripts/bench_tables.py attention docs/benchmarks/h100-attention.json
       scripts/bench_tables.py e2e docs/benchmarks/h100-e2e.json
       scripts/bench_tables.py e2e-summary docs/benchmarks/h100-e2e.json
       scripts/bench_tables.py peers docs/benchmarks/h100-e2e.json docs/benchmarks/h100-peers.json
       scripts/bench_tables.py attention-peers docs/benchmarks/h200-attention.json docs/benchmarks/h200-peers-attention.json
"""
import json
import sys
from collections import defaultdict


def attention(path):
    r = json.load(open(path))
    aff = r["candle_affine"]
    print(f"GPU: {r['gpu']}. Command: `{r['command']}`.\n")
    print(f"Dispatch yardstick of the same run (`candle_affine`, 1024 f32): host {aff['host_us']:.2f} µs, GPU {aff['gpu_us']:.2f} µs.\n")
    print("| dtype | heads | batch | keep | tokens | floor µs | ragged host µs | host / affine | ragged GPU µs | GPU / floor | padded host µs | padded GPU µs | padded / ragged (GPU) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = defaultdict(dict)
    for x in r["rows"]:
        rows[(x["dtype"], x["heads"], x["batch"], x["keep"])][x["method"]] = x
    for (dt, h, b, k), m in rows.items():
        rg, pd = m["ragged"], m["padded"]
        print(f"| {dt} | {h} | {b} | {k:.1f} | {rg['total_tokens']} | {rg['floor_us']:.1f} | {rg['host_us']:.1f} | "
              f"{rg['host_vs_affine']:.2f} | {rg['gpu_us']:.1f} | {rg['gpu_us'] / rg['floor_us']:.2f} | {pd['host_us']:.1f} | "
              f"{pd['gpu_us']:.1f} | {pd['gpu_us'] / rg['gpu_us']:.1f} |")


def e2e(path):
    """Every row; `vs dense` compares like with like: eager rows against the eager dense row,
    CUDA-graph rows against the CUDA-graph dense row (same model, batch, dtype, run)."""
    r = json.load(open(path))
    print(f"GPU: {r['gpu']}. Command: `{r['command']}`.\n")
    dense = {(x["model"], x["batch"], x["dtype"], x.get("cuda_graph", False)): x
             for x in r["rows"] if x["path"] == "dense"}
    print("| model | dtype | batch | pruner | mode | path | decisions | CUDA graph | img/s | latency ms | kept tokens | peak MiB | vs dense |")
    print("| --- | --- | ---: | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for x in r["rows"]:
        g = x.get("cuda_graph", False)
        d = dense.get((x["model"], x["batch"], x["dtype"], g))
        ratio = f"{x['img_s'] / d['img_s']:.2f}" if d else ""
        peak = x.get("peak_mem_mb")
        dec = x.get("decisions", "host") if x["pruner"] != "none" else ""
        print(f"| {x['model']} | {x['dtype']} | {x['batch']} | {x['pruner']} | {x['mode']} | {x['path']} | {dec} | "
              f"{'yes' if g else ''} | {x['img_s']:.0f} | {x['latency_ms']:.3f} | {x['mean_kept_tokens']:.1f} | "
              f"{'' if peak is None else f'{peak:.0f}'} | {ratio} |")


def e2e_summary(path):
    """Per dtype x model x batch: dense (eager, graph) and, per pruner x mode, the best
    pruned-ragged row over its variants against dense (graph rows against the graph dense row);
    and how many pruner x mode cells reach >= 1."""
    r = json.load(open(path))
    rows = r["rows"]
    dense = {(x["model"], x["batch"], x["dtype"], x.get("cuda_graph", False)): x["img_s"]
             for x in rows if x["path"] == "dense"}
    pruners = ["threshold-l2", "dynamicvit", "evit", "ats"]
    for dtype in ["f16", "bf16", "f32"]:
        if not any(x["dtype"] == dtype for x in rows):
            continue
        print(f"\n**{dtype}**: best pruned-ragged img/s over its variants (host decisions eager; device "
              "decisions eager or replayed as a CUDA graph) / dense img/s (eager against eager, graph against graph)\n")
        print("| model | batch | dense img/s | dense, graph img/s | " + " | ".join(f"{p} {m}" for p in pruners for m in ["fixed", "adaptive"]) + " |")
        print("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in range(8)) + " |")
        met, total = 0, 0
        for model in ["deit-tiny", "deit-small", "deit-base"]:
            for b in [1, 8, 64, 256]:
                de, dg = dense.get((model, b, dtype, False)), dense.get((model, b, dtype, True))
                if de is None:
                    continue
                cells = []
                for p in pruners:
                    for m in ["fixed", "adaptive"]:
                        best = None
                        for x in rows:
                            if (x["model"], x["batch"], x["dtype"], x["pruner"], x["mode"], x["path"]) != (model, b, dtype, p, m, "ragged"):
                                continue
                            ref = dg if x.get("cuda_graph") else de
                            if ref:
                                ratio = x["img_s"] / ref
                                best = ratio if best is None else max(best, ratio)
                        if best is None:
                            cells.append("")
                            continue
                        total += 1
                        met += best >= 1.0
                        cells.append(f"**{best:.2f}**" if best >= 1.0 else f"{best:.2f}")
                print(f"| {model} | {b} | {de:.0f} | {'' if dg is None else f'{dg:.0f}'} | " + " | ".join(cells) + " |")
        print(f"\n{dtype}: {met} of {total} pruner x mode x model x batch cells reach >= 1.00.")


def peers(path, peers_path):
    """f16, per model x batch: our dense (eager, graph), our best pruned-ragged row of the issue's
    default schedule (EViT or Threshold-L2, fixed keep 0.7, any variant), timm in eager and the best
    PyTorch mode of the same device call, the ratios, and peak memory padded / ragged of the
    pruner of that best row."""
    ours = [x for x in json.load(open(path))["rows"] if x["dtype"] == "f16"]
    theirs = json.load(open(peers_path))["rows"]
    print("| model | batch | ours dense, eager | ours dense, CUDA graph | ours best pruned-ragged (EViT / Threshold-L2, keep 0.7) "
          "| torch eager | best PyTorch (mode) | dense / best PyTorch | pruned / best PyTorch | peak MiB, padded / ragged |")
    print("| --- | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: |")
    cell = lambda x: f"{x['img_s']:.0f} img/s, {x['latency_ms']:.3f} ms"
    for model in ["deit-tiny", "deit-small", "deit-base"]:
        for b in [1, 8, 64, 256]:
            dense = {x.get("cuda_graph", False): x for x in ours
                     if (x["model"], x["batch"], x["path"]) == (model, b, "dense")}
            pruned = [x for x in ours if (x["model"], x["batch"], x["path"], x["mode"]) == (model, b, "ragged", "fixed")
                      and x["pruner"] in ("evit", "threshold-l2")]
            peer = [x for x in theirs if (x["model"], x["batch"]) == (model, b)]
            if not dense or not pruned or not peer:
                continue
            best = max(pruned, key=lambda x: x["img_s"])
            eager = next((x for x in peer if x["path"] == "torch-eager"), None)
            top = max(peer, key=lambda x: x["img_s"])
            top_dense = max(dense.values(), key=lambda x: x["img_s"])
            how = ", ".join(v for v in [best["pruner"], best.get("decisions", "host"), "graph" if best.get("cuda_graph") else ""] if v)
            mem = lambda p: max((x.get("peak_mem_mb") or 0) for x in ours
                                if (x["model"], x["batch"], x["pruner"], x["mode"], x["path"]) == (model, b, best["pruner"], "fixed", p))
            print(f"| {model} | {b} | {cell(dense[False])} | {cell(dense[True]) if True in dense else ''} | {cell(best)} ({how}) | "
                  f"{cell(eager) if eager else ''} | {cell(top)} ({top['path']}) | {top_dense['img_s'] / top['img_s']:.2f} | "
                  f"{best['img_s'] / top['img_s']:.2f} | {mem('padded'):.0f} / {mem('ragged'):.0f} |")


def attention_peers(path, peers_path):
    """Our ragged rows next to PyTorch's kernels on the same shapes (scripts/peers/varlen_attention.py,
    same device call): GPU µs, host µs, and the peers' times over ours."""
    r, p = json.load(open(path)), json.load(open(peers_path))
    print(f"GPU: {r['gpu']}; PyTorch {p['torch']}. Commands: `{r['command']}`, then `{p['command']}`.\n")
    print("| dtype | heads | batch | keep | tokens | ragged GPU µs | FA2 varlen GPU µs | padded SDPA GPU µs | FA2 / ragged (GPU) | SDPA / ragged (GPU) | ragged host µs | FA2 varlen host µs | FA2 / ragged (host) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    ours = {(x["dtype"], x["heads"], x["batch"], x["keep"]): x for x in r["rows"] if x["method"] == "ragged"}
    theirs = defaultdict(dict)
    for x in p["rows"]:
        theirs[(x["dtype"], x["heads"], x["batch"], x["keep"])][x["method"]] = x
    for key, o in ours.items():
        fa, sd = theirs[key]["torch-flash-varlen"], theirs[key]["torch-sdpa-padded"]
        if fa["total_tokens"] != o["total_tokens"]:
            sys.exit(f"{key}: the peers' lengths differ from ours ({fa['total_tokens']} against {o['total_tokens']} tokens)")
        dt, h, b, k = key
        print(f"| {dt} | {h} | {b} | {k:.1f} | {o['total_tokens']} | {o['gpu_us']:.1f} | {fa['gpu_us']:.1f} | {sd['gpu_us']:.1f} | "
              f"{fa['gpu_us'] / o['gpu_us']:.2f} | {sd['gpu_us'] / o['gpu_us']:.2f} | {o['host_us']:.1f} | {fa['host_us']:.1f} | "
              f"{fa['host_us'] / o['host_us']:.2f} |")


{"attention": attention, "attention-peers": attention_peers, "e2e": e2e, "e2e-summary": e2e_summary, "peers": peers}[sys.argv[1]](*sys.argv[2:])
