// The arithmetic of a token row's L2 norm (Threshold-L2's scores), one definition for the two
// kernel files that compute it: candle-ragged's selection kernels (ragged_attention.cu) and
// candle-fastpath's attention_block, which hands a pruning step the norms it would otherwise
// compute (lever 77), so both must give the same bits. Each lane squares its elements and adds
// them into its sum in column order from 0 (row_norm_sq_add), a butterfly over the 32 lanes adds
// the lanes' sums (row_norm_lane_sum), the norm is the square root (row_norm_sqrt). Written as
// the instructions --use_fast_math makes of fmaf, + and sqrtf (denormals flushed, the square
// root approximate): candle-ragged builds with that flag, candle-fastpath without it.
#pragma once

// acc + v·v, one rounding, denormals flushed.
__device__ __forceinline__ float row_norm_sq_add(float v, float acc) {
    float d;
    asm("fma.rn.ftz.f32 %0, %1, %1, %2;" : "=f"(d) : "f"(v), "f"(acc));
    return d;
}

// The sum of `acc` over the warp's 32 lanes, every lane getting it: xor 16, 8, 4, 2, 1.
__device__ __forceinline__ float row_norm_lane_sum(float acc) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, acc, o);
        asm("add.ftz.f32 %0, %0, %1;" : "+f"(acc) : "f"(other));
    }
    return acc;
}

// sqrtf as fast math computes it.
__device__ __forceinline__ float row_norm_sqrt(float ss) {
    float d;
    asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(d) : "f"(ss));
    return d;
}
