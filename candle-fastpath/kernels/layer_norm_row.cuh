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
