#!/usr/bin/env python3
"""Markdown tables from the benchmark JSON files (docs/benchmarks/*.json), for docs/BENCHMARKS.md.

usage: scripts/bench_tables.py attention docs/benchmarks/h100-attention.json
       scripts/bench_tables.py e2e docs/benchmarks/h100-e2e.json
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
    r = json.load(open(path))
    print(f"GPU: {r['gpu']}. Command: `{r['command']}`.\n")
    dense = {(x["model"], x["batch"], x["dtype"]): x for x in r["rows"] if x["path"] == "dense"}
    print("| model | dtype | batch | pruner | mode | path | img/s | latency ms | kept tokens | vs dense |")
    print("| --- | --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for x in r["rows"]:
        d = dense.get((x["model"], x["batch"], x["dtype"]))
        ratio = f"{x['img_s'] / d['img_s']:.2f}" if d else ""
        print(f"| {x['model']} | {x['dtype']} | {x['batch']} | {x['pruner']} | {x['mode']} | {x['path']} | "
              f"{x['img_s']:.0f} | {x['latency_ms']:.3f} | {x['mean_kept_tokens']:.1f} | {ratio} |")


{"attention": attention, "e2e": e2e}[sys.argv[1]](sys.argv[2])
