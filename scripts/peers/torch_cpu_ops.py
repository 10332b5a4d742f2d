#!/usr/bin/env python3
"""PyTorch's counterpart of our `bench-cpu-ops`: the CPU time of each operation of a DeiT block on
the model's shapes, one at a time (random weights, inference mode; f32 unless --dtype), printed in
the same lines,
so that the two outputs compare op by op on the same machine.

Operations: ln (F.layer_norm), qkv (F.linear), attn (F.scaled_dot_product_attention on q, k, v
views of the fused projection, [B, heads, 197, 64]), proj+res, fc1+gelu (F.linear then the exact
F.gelu), fc1, fc2+res. Each: three untimed calls, then the median of --reps. Threads: --threads
(default: torch's, the physical cores); give RAYON_NUM_THREADS the same count for ours.

usage: python3 scripts/peers/torch_cpu_ops.py [--models deit-tiny,deit-small] [--batch 1,8]
       [--reps 30] [--threads 16] [--dtype f32|f16|bf16]
"""
import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"deit-tiny": (192, 3), "deit-small": (384, 6), "deit-base": (768, 12)}
TOKENS, HEAD_DIM = 197, 64


def median_us(reps, call):
    for _ in range(3):
        call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    times.sort()
    return times[reps // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="deit-tiny,deit-small")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"])
    args = ap.parse_args()
    dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with torch.inference_mode():
        for model in args.models.split(","):
            c, heads = SHAPES[model]
            for b in (int(v) for v in args.batch.split(",")):
                rows = b * TOKENS
                x = torch.randn(b, TOKENS, c).to(dt)
                hidden = torch.randn(b, TOKENS, 4 * c).to(dt)

                def layer(i, o):
                    return (torch.randn(o, i) * 0.02).to(dt), (torch.randn(o) * 0.02).to(dt)

                qkv, proj, fc1, fc2 = layer(c, 3 * c), layer(c, c), layer(c, 4 * c), layer(4 * c, c)
                weight, bias = torch.ones(c, dtype=dt), torch.zeros(c, dtype=dt)
                fused = F.linear(x, *qkv).reshape(b, TOKENS, 3, heads, HEAD_DIM).permute(2, 0, 3, 1, 4)
                q, k, v = fused.unbind(0)

                def flops(i, o):
                    return 2 * rows * i * o

                ops = [
                    ("ln", 0, lambda: F.layer_norm(x, (c,), weight, bias, 1e-6)),
                    ("qkv", flops(c, 3 * c), lambda: F.linear(x, *qkv)),
                    ("attn", 4 * b * heads * TOKENS * TOKENS * HEAD_DIM,
                     lambda: F.scaled_dot_product_attention(q, k, v)),
                    ("proj+res", flops(c, c), lambda: x + F.linear(x, *proj)),
                    ("fc1+gelu", flops(c, 4 * c), lambda: F.gelu(F.linear(x, *fc1))),
                    ("fc1", flops(c, 4 * c), lambda: F.linear(x, *fc1)),
                    ("fc2+res", flops(4 * c, c), lambda: x + F.linear(hidden, *fc2)),
                ]
                block = 0.0
                for name, f, call in ops:
                    us = median_us(args.reps, call)
                    block += {"ln": 2 * us, "fc1": 0.0}.get(name, us)
                    print(f"{model} {args.dtype} b{b} {name:10} {us:9.1f} us  {f / us / 1e3:7.1f} GFLOPS")
                print(f"{model} {args.dtype} b{b} block(2 ln) {block:.1f} us; x12 = {block * 12 / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
