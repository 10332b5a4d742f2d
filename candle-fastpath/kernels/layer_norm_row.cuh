// One LayerNorm row per warp, the code every LayerNorm of ours runs (fastpath.cu's LayerNorm
// kernel, norm_linear's rows normalised in shared memory, the cluster kernels' rows and
// thin_gemm_sm90.cu's fc2 + residual + LayerNorm): one copy, so their outputs agree bit for bit.
#pragma once

#include <stdint.h>

#include "epilogue.cuh"

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One row normalised by one warp, from its 16-byte chunks `row[lane + 32 t]` (those below
// `chunks`), the weight and bias chunks of the same lanes already in registers, into
// `out[lane + 32 t]`. Each lane reads all its chunks before it writes any, so `out` may be `row`
// (norm_linear normalises rows in place in shared memory: its rows are this kernel's bit for bit).
template <int LN_MAX_CHUNKS, typename T>
__device__ __forceinline__ void layer_norm_warp_row(const uint4* row, uint4* out, const uint4 (&wraw)[LN_MAX_CHUNKS],
                                                    const uint4 (&braw)[LN_MAX_CHUNKS], unsigned chunks,
                                                    unsigned C, float eps, unsigned lane) {
    constexpr unsigned VEC = 16 / sizeof(T);
    float v[LN_MAX_CHUNKS][VEC];
    float sum = 0.f;
#pragma unroll
    for (int t = 0; t < LN_MAX_CHUNKS; ++t) {
        const unsigned c = lane + 32 * t;
        if (c < chunks) {
            uint4 raw = row[c];
            const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (unsigned j = 0; j < VEC; ++j) {
                v[t][j] = to_f32(e[j]);
                sum += v[t][j];
            }
        }
    }
    const float mean = warp_sum(sum) / (float)C;
    float sq = 0.f;
#pragma unroll
    for (int t = 0; t < LN_MAX_CHUNKS; ++t) {
        if (lane + 32 * t < chunks) {
#pragma unroll
            for (unsigned j = 0; j < VEC; ++j) {
                const float d = v[t][j] - mean;
                sq += d * d;
            }
        }
    }
    const float rstd = 1.0f / sqrtf(warp_sum(sq) / (float)C + eps);
#pragma unroll
    for (int t = 0; t < LN_MAX_CHUNKS; ++t) {
        const unsigned c = lane + 32 * t;
        if (c < chunks) {
            uint4 o;
            const T* we = reinterpret_cast<const T*>(&wraw[t]);
            const T* be = reinterpret_cast<const T*>(&braw[t]);
            T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
            for (unsigned j = 0; j < VEC; ++j) {
                oe[j] = from_f32<T>((v[t][j] - mean) * rstd * to_f32(we[j]) + to_f32(be[j]));
            }
            out[c] = o;
        }
    }
}

// This lane's chunks of the LayerNorm's weight and bias (those below `chunks`).
template <int LN_MAX_CHUNKS>
__device__ __forceinline__ void layer_norm_params(const void* w, const void* b, uint4 (&wraw)[LN_MAX_CHUNKS],
                                                  uint4 (&braw)[LN_MAX_CHUNKS], unsigned chunks, unsigned lane) {
    const uint4* wr = reinterpret_cast<const uint4*>(w);
    const uint4* br = reinterpret_cast<const uint4*>(b);
#pragma unroll
    for (int t = 0; t < LN_MAX_CHUNKS; ++t) {
        const unsigned c = lane + 32 * t;
        if (c < chunks) {
            wraw[t] = wr[c];
            braw[t] = br[c];
        }
    }
}

// The group's total of its lanes' slot partials `part` (slot m of lane g standing for the
// one-warp lane g + G·m): the one-warp butterfly's levels 16 .. G in registers (lane g + G·m adds
// lane g + G·(m ^ (16 / G)), ...), then levels G/2 .. 1 by shuffles inside the group.
template <int R, int G>
__device__ __forceinline__ float group_total(float (&part)[R]) {
#pragma unroll
    for (int step = R / 2; step >= 1; step /= 2) {
#pragma unroll
        for (int m = 0; m < step; ++m) part[m] = part[m] + part[m + step];
    }
    float total = part[0];
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    return total;
}

// The same row normalisation with a row to each group of G lanes (G = 8 or 16; 32 / G rows a
// warp), bit for bit layer_norm_warp_row's output. Lane g of a group holds what lanes g, g + G,
// g + 2G, ... hold in the one-warp form (chunks g + G·m + 32·t), adds each of those lanes' values
// in the same order into its own partial, then does the butterfly's levels 16 .. G in registers
// (the pairs those levels add are partials of the same lane here) and levels G/2 .. 1 by shuffles
// inside the group: the same additions of the same operands, so the same sums.
//
// Why: at ViT widths a row is a few 16-byte chunks (C = 192 in f16: 24), so one warp per row
// left a quarter of its lanes idle and, at DeiT-T's batch-64 rows (12,608), needed 1.5 waves of
// warps whose loads each waited alone; a group of 8 lanes keeps 3 loads a lane in flight.
// MAX_CHUNKS bounds the row's chunks at compile time, so the slots no row can reach (g + G·m +
// 32·t ≥ MAX_CHUNKS for every g < G) take no registers; the row stays in its 16-byte raw form
// (converted when used, exactly) to keep the registers low enough for a full SM of lanes.
//
// Every lane of the warp must call this (the shuffles name the whole warp); a group whose row is
// past the end passes valid = false: it loads nothing, stores nothing, and adds zeros.
template <int LN_MAX_CHUNKS, int G, int MAX_CHUNKS, typename T>
__device__ __forceinline__ void layer_norm_group_row(const uint4* row, uint4* out, const void* w, const void* b,
                                                     unsigned chunks, unsigned C, float eps, unsigned g,
                                                     bool valid) {
    static_assert(G == 8 || G == 16, "a group of 8 or 16 lanes");
    constexpr int R = 32 / G;  // one-warp lanes folded into each lane of the group
    constexpr unsigned VEC = 16 / sizeof(T);
    const uint4* wr = reinterpret_cast<const uint4*>(w);
    const uint4* br = reinterpret_cast<const uint4*>(b);
    // Whether slot (m, t) holds a chunk of this row: reachable at all, then below `chunks`.
    auto has = [&](int m, int t) { return G * m + 32 * t < MAX_CHUNKS && valid && g + G * m + 32 * t < chunks; };
    // Weight and bias beside the row (layer_norm_params' reason: off the reductions' path).
    uint4 wraw[R][LN_MAX_CHUNKS], braw[R][LN_MAX_CHUNKS], raw[R][LN_MAX_CHUNKS];
#pragma unroll
    for (int m = 0; m < R; ++m) {
#pragma unroll
        for (int t = 0; t < LN_MAX_CHUNKS; ++t) {
            if (has(m, t)) {
                const unsigned c = g + G * m + 32 * t;
                wraw[m][t] = wr[c];
                braw[m][t] = br[c];
                raw[m][t] = row[c];
            }
        }
    }
    // Each slot's running sum of term(x) over its chunk's elements, in the one-warp form's order.
    float part[R];
    auto accumulate = [&](auto term) {
#pragma unroll
        for (int m = 0; m < R; ++m) {
            part[m] = 0.f;
#pragma unroll
            for (int t = 0; t < LN_MAX_CHUNKS; ++t) {
                if (has(m, t)) {
                    const T* e = reinterpret_cast<const T*>(&raw[m][t]);
#pragma unroll
                    for (unsigned j = 0; j < VEC; ++j) part[m] += term(to_f32(e[j]));
                }
            }
        }
    };
    accumulate([](float x) { return x; });
    const float mean = group_total<R, G>(part) / (float)C;
    accumulate([&](float x) {
        const float d = x - mean;
        return d * d;
    });
    const float sq = group_total<R, G>(part);
    const float rstd = 1.0f / sqrtf(sq / (float)C + eps);
#pragma unroll
    for (int m = 0; m < R; ++m) {
#pragma unroll
        for (int t = 0; t < LN_MAX_CHUNKS; ++t) {
            if (has(m, t)) {
                uint4 o;
                const T* e = reinterpret_cast<const T*>(&raw[m][t]);
                const T* we = reinterpret_cast<const T*>(&wraw[m][t]);
                const T* be = reinterpret_cast<const T*>(&braw[m][t]);
                T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
                for (unsigned j = 0; j < VEC; ++j) {
                    oe[j] = from_f32<T>((to_f32(e[j]) - mean) * rstd * to_f32(we[j]) + to_f32(be[j]));
                }
                out[g + G * m + 32 * t] = o;
            }
        }
    }
}
