// The GEMM epilogue shared by fastpath.cu's kernels, small_block.cu and thin_gemm_sm90.cu (with
// convert_f32.cuh's storage-type conversions): each output pair's bias, its rounding to the
// storage type, then (GELU) x·Φ(x) of that rounded value, rounded again — what cuBLASLt's bias
// epilogue followed by the GELU pass computes — from an m16n8 accumulator layout (mma.sync's,
// and wgmma's per warp).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// candle-ragged's kernel folder (on the include path): to_f32 / from_f32.
#include "convert_f32.cuh"
#include "gelu_phi.cuh"


template <typename T>
struct __align__(4) NlPair {
    T a, b;
};

// The bias pairs of a warp's 16 × 32 accumulator tile starting at column `col0` (zero past N).
template <typename T>
__device__ __forceinline__ void nl_load_bias(float (&bias_f)[4][2], const T* __restrict__ bias, int col0, int N) {
    const unsigned lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int col = col0 + j * 8 + (lane % 4) * 2;
        bias_f[j][0] = col < N ? to_f32(bias[col]) : 0.f;
        bias_f[j][1] = col + 1 < N ? to_f32(bias[col + 1]) : 0.f;
    }
}

// A warp's 16 × 32 tile (rows row0.., columns col0..) of an [M, N] result from its accumulators:
// bias, rounding to the storage type, then (GELU) x·Φ(x) of that rounded value, rounded again;
// pairs of adjacent columns, rows lane / 4 and lane / 4 + 8, each handed to store(row, col, pair);
// nothing past M or N.
template <typename T, bool GELU, typename Store>
__device__ __forceinline__ void nl_epilogue_tile(const float (&acc)[4][4], const float (&bias_f)[4][2], int row0,
                                                 int col0, int M, int N, Store store) {
    const unsigned lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int col = col0 + j * 8 + (lane % 4) * 2;
        if (col >= N) continue;  // N is even: col < N means the pair is inside
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + lane / 4 + h * 8;
            if (row >= M) continue;
            T o0 = from_f32<T>(acc[j][2 * h] + bias_f[j][0]), o1 = from_f32<T>(acc[j][2 * h + 1] + bias_f[j][1]);
            if (GELU) {
                o0 = from_f32<T>(gelu_phi(to_f32(o0)));
                o1 = from_f32<T>(gelu_phi(to_f32(o1)));
            }
            store(row, col, NlPair<T>{o0, o1});
        }
    }
}

// nl_epilogue_tile into y [M, N] in global memory.
template <typename T, bool GELU>
__device__ __forceinline__ void nl_store_tile(const float (&acc)[4][4], const float (&bias_f)[4][2],
                                              T* __restrict__ y, int row0, int col0, int M, int N) {
    nl_epilogue_tile<T, GELU>(acc, bias_f, row0, col0, M, N, [&](int row, int col, NlPair<T> p) {
        *reinterpret_cast<NlPair<T>*>(y + (size_t)row * N + col) = p;
    });
}

// A split-K GEMM's output pair at (row, col): the PARTS partial sums in `part` ([PARTS][ROWS][LD]
// f32) added in order, then the residual, then the bias, rounded once. Step 3 of fastpath.cu's
// cluster kernels (front_partials' sums) and thin_gemm_sm90.cu's fc2 kernel (its slices of K).
template <typename T, int PARTS, int ROWS, int LD>
__device__ __forceinline__ NlPair<T> front_pair(const float* part, int row, int col, const float (&res)[2],
                                                const float (&bias)[2]) {
    float2 sum = make_float2(0.f, 0.f);
#pragma unroll
    for (int q = 0; q < PARTS; ++q) {
        const float2 v = *reinterpret_cast<const float2*>(part + (q * ROWS + row) * LD + col);
        sum.x += v.x;
        sum.y += v.y;
    }
    return NlPair<T>{from_f32<T>((sum.x + res[0]) + bias[0]), from_f32<T>((sum.y + res[1]) + bias[1])};
}
