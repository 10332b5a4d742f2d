// Hopper warpgroup-MMA (wgmma) helpers shared by ragged_attention_sm90.cu and candle-fastpath's
// thin_gemm_sm90.cu (which reaches this folder through candle-ragged's `include` metadata):
// shared-memory matrix descriptors for the 128-byte swizzle, and the fence / commit / wait around
// a batch of wgmmas, and `pin` for the accumulators around them. sm_90a only.
#pragma once

#include <stdint.h>

namespace {

// Shared-memory matrix descriptors (PTX ISA, "Matrix Descriptor Format"): start address, leading
// and stride byte offsets (all >> 4), 128-byte swizzle (mode 1 in bits 62-63).
__device__ __forceinline__ uint64_t desc_field(uint32_t x) { return static_cast<uint64_t>((x & 0x3FFFF) >> 4); }
// A K-major operand (the reduction dim contiguous: K rows as the B of S = Q K^T, or thin_gemm's
// x and W rows as its A and B): 8-row groups 1024 bytes apart (stride offset); the leading offset
// is unused with swizzling. A k-step of 16 elements moves the start 32 bytes within the swizzled
// row.
__device__ __forceinline__ uint64_t desc_k_major(uint32_t addr) {
    return desc_field(addr) | (desc_field(16) << 16) | (desc_field(1024) << 32) | (1ull << 62);
}
// V rows as the N-major B of O = P V (reduction over keys, N = head_dim contiguous): 8-key groups
// 1024 bytes apart (stride offset), 64-wide N blocks `lead` bytes apart (one block at head_dim
// 64). A k-step of 16 keys moves the start 2048 bytes.
__device__ __forceinline__ uint64_t desc_n_major(uint32_t addr, uint32_t lead) {
    return desc_field(addr) | (desc_field(lead) << 16) | (desc_field(1024) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// Keeps the compiler from moving accesses of accumulator registers across wgmma issue / wait.
template <int N> __device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void pin(uint32_t (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

}  // namespace
