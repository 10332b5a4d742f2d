#!/usr/bin/env python3
"""The peers our DeiT is measured against: timm's DeiT-T/S/B in PyTorch on the same GPU, same run.
With --device cpu, the same on the CPU (our `bench --device cpu` beside it; see "The CPU path" in
docs/BENCHMARKS.md).

Modes (JSON "path"): torch-eager; torch-cudagraph (eager forward captured once in a CUDA graph and
replayed); torch-compile-ro (torch.compile mode="reduce-overhead"); torch-compile-max
(mode="max-autotune", with --compile max or --max-autotune; it compiles for minutes). Random weights, f16,
inference mode, input already on the GPU; per batch: warm-up, then the median of --reps timed
forwards, each synchronised (the same rule as our `bench`). Compilation stops once --budget-s is
spent, so the script fits in one device call; rows that were skipped are listed in "skipped". The
JSON is rewritten after every row, so a run stopped by a time limit keeps what it measured.

On the CPU (--device cpu): modes torch-eager and torch-compile (torch.compile's default mode:
inductor's C++ code; reduce-overhead means CUDA graphs, which a CPU has not), in --dtype f32 and / or
bf16, torch's default thread count (the physical cores), the input in the row's dtype.

usage: python3 scripts/peers/timm_deit.py --out peers.json [--batch 1,8,64,256] [--budget-s 300]
       python3 scripts/peers/timm_deit.py --device cpu --dtype f32,bf16 --batch 1,8 --out cpu.json
Rows use the format of docs/benchmarks/h100-e2e.json (pruner "none", mode "none").
"""
import argparse
import json
import statistics
import time

import timm
import torch

NAMES = {"deit-tiny": "deit_tiny_patch16_224", "deit-small": "deit_small_patch16_224", "deit-base": "deit_base_patch16_224"}


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps, warmup=5, device="cuda"):
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def save(args, rows, skipped):
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU: {cpu_name()}, {torch.get_num_threads()} threads"
    json.dump({"gpu": where,
               "command": "python3 scripts/peers/timm_deit.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
               "torch": torch.__version__, "timm": timm.__version__, "rows": rows, "skipped": skipped}, open(args.out, "w"), indent=1)


def add_row(args, rows, skipped, model, path, b, dtype, sec):
    """One result row (the format of our bench's JSON), saved at once so that a run cut short by a
    time limit keeps its rows."""
    r = {"model": model, "pruner": "none", "mode": "none", "path": path, "batch": b, "dtype": dtype,
         "img_s": b / sec, "latency_ms": sec * 1e3, "mean_kept_tokens": 197.0}
    rows.append(r)
    save(args, rows, skipped)
    print(f"{model:10} {path:17} {dtype:4} b={b:<4} {r['img_s']:10.2f} img/s {r['latency_ms']:9.3f} ms", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="deit-tiny,deit-small,deit-base")
    ap.add_argument("--batch", default="1,8,64,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop compiling once this much time is spent")
    ap.add_argument("--max-autotune", action="store_true")
    ap.add_argument("--compile", default="ro", help="compile modes to run: ro, max, or ro,max (--max-autotune adds max); on the CPU any value runs the default mode, `none` none")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="f16", help="dtypes (f16, bf16, f32) on the CPU; the GPU rows run in f16 only")
    args = ap.parse_args()
    if args.device == "cpu":
        return cpu_main(args)
    if args.dtype != "f16":
        ap.error("on the GPU the peers run in f16 only (--dtype f16)")
    start = time.time()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    rows, skipped = [], []
    batches = [int(b) for b in args.batch.split(",")]

    def row(model, path, b, sec):
        add_row(args, rows, skipped, model, path, b, "f16", sec)

    for model in args.models.split(","):
        m = timm.create_model(NAMES[model], pretrained=False).cuda().half().eval()
        for b in batches:
            x = torch.randn(b, 3, 224, 224, device="cuda", dtype=torch.half)
            with torch.inference_mode():
                row(model, "torch-eager", b, timed(lambda: m(x), args.reps))
                # Eager forward captured in a CUDA graph (warm-up on a side stream, as PyTorch asks).
                static_x = x.clone()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        m(static_x)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    m(static_x)
                row(model, "torch-cudagraph", b, timed(g.replay, args.reps))
                del g
        wanted = set(args.compile.split(",")) | ({"max"} if args.max_autotune else set())
        modes = [(p, m) for key, p, m in (("ro", "torch-compile-ro", "reduce-overhead"), ("max", "torch-compile-max", "max-autotune")) if key in wanted]
        for path, mode in modes:
            torch._dynamo.reset()
            cm = torch.compile(m, mode=mode, dynamic=False)
            for b in batches:
                if time.time() - start > args.budget_s:
                    skipped.append({"model": model, "path": path, "batch": b, "why": "time budget"})
                    continue
                x = torch.randn(b, 3, 224, 224, device="cuda", dtype=torch.half)
                with torch.inference_mode():
                    row(model, path, b, timed(lambda: cm(x), args.reps, warmup=5))
    save(args, rows, skipped)
    print(f"wrote {len(rows)} rows to {args.out}; skipped {len(skipped)}")


TORCH_DTYPES = {"f16": torch.half, "bf16": torch.bfloat16, "f32": torch.float32}


def cpu_main(args):
    """Eager and torch.compile'd timm DeiTs on the CPU, per dtype and batch."""
    start = time.time()
    torch.manual_seed(0)
    rows, skipped = [], []
    batches = [int(b) for b in args.batch.split(",")]

    def row(model, path, b, dtype, sec):
        add_row(args, rows, skipped, model, path, b, dtype, sec)

    for model in args.models.split(","):
        for dtype in args.dtype.split(","):
            m = timm.create_model(NAMES[model], pretrained=False).to(TORCH_DTYPES[dtype]).eval()
            compiled = None if args.compile == "none" else torch.compile(m, dynamic=False)
            for b in batches:
                x = torch.randn(b, 3, 224, 224, dtype=TORCH_DTYPES[dtype])
                with torch.inference_mode():
                    row(model, "torch-eager", b, dtype, timed(lambda: m(x), args.reps, warmup=2, device="cpu"))
                    if compiled is None:
                        continue
                    if time.time() - start > args.budget_s:
                        skipped.append({"model": model, "path": "torch-compile", "batch": b, "dtype": dtype, "why": "time budget"})
                        continue
                    row(model, "torch-compile", b, dtype, timed(lambda: compiled(x), args.reps, warmup=2, device="cpu"))
            torch._dynamo.reset()
    save(args, rows, skipped)
    print(f"wrote {len(rows)} rows to {args.out}; skipped {len(skipped)}")


if __name__ == "__main__":
    main()
