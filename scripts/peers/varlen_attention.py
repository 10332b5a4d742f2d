#!/usr/bin/env python3
"""The attention peers `bench-attention` is measured against: PyTorch's own fused kernels on the
same GPU, same call, same shapes.

Methods (JSON "method"):
- torch-flash-varlen: `torch.ops.aten._flash_attention_forward` with cu_seqlens, the
  FlashAttention-2 varlen kernel PyTorch ships (what `flash_attn_varlen_func` runs), on the
  packed q, k, v: exactly our op's inputs and output, no padding;
- torch-sdpa-padded: `F.scaled_dot_product_attention` on the batch already padded to its longest
  sequence, `[B, H, L, D]`, with a boolean key-padding mask (PyTorch picks its memory-efficient
  kernel; the flash one takes no mask). The padding copies are NOT timed: only the attention.

The lengths are `bench-attention`'s, drawn the same way in the same order (splitmix64 from
--seed, 196 * keep patch tokens spread +-15 % per image plus the class token, loops dtype ->
heads -> batch -> keep), and q, k, v are strided views of one `[total, 3, heads, head_dim]`
tensor (its default `--qkv-layout fused`), so each row's shapes are those of its row.
Timing as `bench-attention` does it: host µs per call = `--host-calls` calls without a
synchronisation, divided (fewer where they would queue over half a second of GPU work:
`host_and_gpu`); GPU µs per call = the median of `--gpu-reps` CUDA event pairs, each
around one call, queued in chunks of 25 behind enough matmuls that the host's launch gaps are
hidden. Every method's output is checked against an f32 softmax(QK^T scale)V of the padded batch
before it is timed (max |diff| over the real tokens, in the JSON; the run fails past 2e-2).

usage: python3 scripts/peers/varlen_attention.py --out peers-attention.json
"""
import argparse
import itertools
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

MASK64 = (1 << 64) - 1


class Lengths:
    """bench-attention's `Lengths`: splitmix64 -> f64 in [0, 1), the same draws in the same order."""

    def __init__(self, seed):
        self.state = seed

    def next_f64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return ((z ^ (z >> 31)) >> 11) / float(1 << 53)

    def draw(self, batch, keep):
        out = []
        for _ in range(batch):
            spread = 1.0 + 0.3 * (self.next_f64() - 0.5)
            # Rust's f64::round rounds halves away from zero; Python's round() to even.
            n = math.floor(196.0 * keep * spread + 0.5)
            out.append(min(max(n, 1), 196) + 1)
        return out


class Timer:
    def __init__(self):
        self.busy = torch.randn(4096, 4096, device="cuda", dtype=torch.half)
        for _ in range(3):
            self.busy @ self.busy
        self.busy_us = statistics.median(self.event_times(5, 0.0, lambda: self.busy @ self.busy, queue=False))

    def host_us(self, calls, f):
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        el = time.perf_counter() - t0
        torch.cuda.synchronize()
        return el * 1e6 / calls

    def event_times(self, reps, host_us, f, queue=True):
        chunk, times = 25, []
        while len(times) < reps:
            if queue:
                need = (host_us * 2.0 + 20.0) * chunk
                for _ in range(math.ceil(need / self.busy_us)):
                    self.busy @ self.busy
            pending = []
            for _ in range(min(chunk, reps - len(times))):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = f()
                b.record()
                pending.append((a, b, out))
            torch.cuda.synchronize()
            times += [a.elapsed_time(b) * 1e3 for a, b, _ in pending]
        return times

    def gpu_us(self, reps, host_us, f):
        return statistics.median(self.event_times(reps, host_us, f))


def host_and_gpu(timer, args, f):
    """(host µs, GPU µs) per call of f. Where --host-calls calls would take the GPU over half a
    second, the launch queue fills and the host loop measures the GPU (as `bench-attention`'s
    rows at batch >= 64 do): the host loop is then cut to ~0.5 s of GPU work (at least 100 calls)
    so that the script fits one device call."""
    host = timer.host_us(min(args.host_calls, 100), f)
    gpu = timer.gpu_us(args.gpu_reps, host, f)
    calls = min(args.host_calls, max(100, int(0.5e6 / gpu)))
    if calls > 100:
        host = timer.host_us(calls, f)
    return host, gpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", default="3,6,12")
    ap.add_argument("--batch", default="1,8,64,256")
    ap.add_argument("--keep", default="1.0,0.7,0.5,0.3")
    ap.add_argument("--dtype", default="f16,bf16")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--host-calls", type=int, default=2000)
    ap.add_argument("--gpu-reps", type=int, default=200)
    ap.add_argument("--hbm-tbps", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0x5EED)
    args = ap.parse_args()
    dtypes = {"f16": torch.half, "bf16": torch.bfloat16}
    if not torch.cuda.is_available():
        raise SystemExit("varlen_attention.py times CUDA kernels: no CUDA device is visible to PyTorch")
    if not hasattr(torch.ops.aten, "_flash_attention_forward") or torch.cuda.get_device_capability(0) < (8, 0):
        raise SystemExit("this PyTorch has no FlashAttention-2 kernel for this GPU "
                         "(torch.ops.aten._flash_attention_forward needs a build with flash attention and compute capability 8.0+)")
    torch.manual_seed(0)
    timer = Timer()
    rng = Lengths(args.seed)
    rows = []
    d = args.head_dim
    scale = 1.0 / math.sqrt(d)
    worst = 0.0
    print(f"{'dtype':>5} {'heads':>5} {'batch':>5} {'keep':>4} {'total':>6} | {'varlen host':>11} {'varlen gpu':>10} | "
          f"{'sdpa host':>9} {'sdpa gpu':>8} | {'diff':>8}", flush=True)
    for dname in args.dtype.split(","):
        dtype = dtypes[dname]
        for heads in map(int, args.heads.split(",")):
            for b in map(int, args.batch.split(",")):
                for keep in map(float, args.keep.split(",")):
                    lengths = rng.draw(b, keep)
                    total, max_len = sum(lengths), max(lengths)
                    offsets = list(itertools.accumulate(lengths, initial=0))
                    cu = torch.tensor(offsets, device="cuda", dtype=torch.int32)
                    qkv = torch.randn(total, 3, heads, d, device="cuda").to(dtype)
                    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
                    # The padded batch [B, H, L, D] and its key-padding mask, built once, untimed.
                    pad = torch.zeros(b, max_len, 3, heads, d, device="cuda", dtype=dtype)
                    valid = torch.zeros(b, max_len, dtype=torch.bool, device="cuda")
                    for i, (s, n) in enumerate(zip(offsets, lengths)):
                        pad[i, :n] = qkv[s:s + n]
                        valid[i, :n] = True
                    pq, pk, pv = (pad[:, :, j].transpose(1, 2).contiguous() for j in range(3))
                    mask = valid[:, None, None, :]

                    def varlen():
                        return torch.ops.aten._flash_attention_forward(
                            q, k, v, cu, cu, max_len, max_len, 0.0, False, False, scale=scale)[0]

                    def sdpa():
                        return F.scaled_dot_product_attention(pq, pk, pv, attn_mask=mask, scale=scale)

                    # Reference: f32 softmax(Q K^T scale) V of the padded batch, real rows only.
                    s_ref = (pq.float() @ pk.float().transpose(-1, -2)) * scale
                    ref = torch.softmax(s_ref.masked_fill(~mask, float("-inf")), -1) @ pv.float()
                    ref = ref.transpose(1, 2)[valid]  # [total, H, D] in packed order
                    diff_varlen = (varlen().float() - ref).abs().max().item()
                    diff_sdpa = (sdpa().transpose(1, 2)[valid].float() - ref).abs().max().item()
                    worst = max(worst, diff_varlen, diff_sdpa)
                    del s_ref, ref

                    v_host, v_gpu = host_and_gpu(timer, args, varlen)
                    s_host, s_gpu = host_and_gpu(timer, args, sdpa)
                    floor = 4.0 * total * heads * d * qkv.element_size() / (args.hbm_tbps * 1e6)
                    for method, host, gpu, diff in (("torch-flash-varlen", v_host, v_gpu, diff_varlen),
                                                    ("torch-sdpa-padded", s_host, s_gpu, diff_sdpa)):
                        rows.append({"method": method, "heads": heads, "batch": b, "keep": keep, "dtype": dname,
                                     "total_tokens": total, "max_len": max_len, "host_us": host, "gpu_us": gpu,
                                     "floor_us": floor, "max_abs_diff_vs_f32": diff})
                    print(f"{dname:>5} {heads:>5} {b:>5} {keep:>4} {total:>6} | {v_host:>11.2f} {v_gpu:>10.2f} | "
                          f"{s_host:>9.2f} {s_gpu:>8.2f} | {max(diff_varlen, diff_sdpa):>8.1e}", flush=True)
                    del pad, pq, pk, pv, qkv
    json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "command": "python3 scripts/peers/varlen_attention.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
               "hbm_tbps": args.hbm_tbps, "host_calls": args.host_calls, "gpu_reps": args.gpu_reps,
               "rows": rows}, open(args.out, "w"), indent=1)
    print(f"wrote {len(rows)} rows to {args.out}; worst |diff| vs f32 {worst:.2e}")
    if worst > 2e-2:
        raise SystemExit(f"a peer's output is off by {worst:.2e} (> 2e-2)")


if __name__ == "__main__":
    main()
