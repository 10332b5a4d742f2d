// Small device helpers shared by ragged_attention.cu (mma.sync kernels) and
// ragged_attention_sm90.cu (wgmma kernel): packing two floats into a 16-bit pair, the shared-memory
// address of a generic pointer, and closing a cp.async group.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

template <typename T> struct Pack2;
template <> struct Pack2<__half> {
    static __device__ __forceinline__ uint32_t from_floats(float a, float b) {
        __half2 h = __floats2half2_rn(a, b);
        return *reinterpret_cast<uint32_t *>(&h);
    }
};
template <> struct Pack2<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t from_floats(float a, float b) {
        __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<uint32_t *>(&h);
    }
};

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Sequence b's first packed row and length: b · uniform_len and uniform_len when the host knows
// that every sequence has that length (uniform_len > 0), else from cu_seqlens. Every block's
// loads of Q, K and V wait on these two values; read from cu_seqlens they cost one more memory
// round trip at the head of that chain (lever 54).
__device__ __forceinline__ void sequence_span(const uint32_t *cu_seqlens, int uniform_len, int b, int &start, int &len) {
    if (uniform_len > 0) {
        start = b * uniform_len;
        len = uniform_len;
    } else {
        start = static_cast<int>(cu_seqlens[b]);
        len = static_cast<int>(cu_seqlens[b + 1]) - start;
    }
}

}  // namespace
