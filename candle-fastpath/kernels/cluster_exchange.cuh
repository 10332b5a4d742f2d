// The thread-block cluster's exchanges through distributed shared memory (lever 68; see
// fastpath.cu's comment above RNL_BAR_BYTES): st.async pushes counted on the receiver's
// transaction barrier. Shared by fastpath.cu's cluster kernels and thin_gemm_sm90.cu. sm_90+.
#pragma once

#include <stdint.h>
#include <string.h>

#include "attention_common.cuh"
#include "epilogue.cuh"

// (smem_addr, a generic pointer's shared-memory address: attention_common.cuh.)
// The same shared-memory offset in cluster CTA `rank` (a shared::cluster address).
__device__ __forceinline__ uint32_t cluster_addr(uint32_t local, uint32_t rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    return remote;
}
// The first `count` barriers at `bars` armed for one phase each of `bytes[i]` transactions, by
// warp 0 before the kernel's entry cluster arrive: lane 0 initialises them (one arrival each),
// the warp syncs (the init may run on the warp's uniform datapath), lane 0 makes the expected
// arrival with the byte count, and fence.mbarrier_init makes them visible to the cluster.
template <int COUNT>
__device__ __forceinline__ void xbar_arm(uint32_t bars, const uint32_t (&bytes)[COUNT]) {
    if (threadIdx.x >= 32) return;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < COUNT; ++i) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bars + 8 * i));
    }
    __syncwarp();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < COUNT; ++i)
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bars + 8 * i), "r"(bytes[i])
                         : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
}
// 4 bytes into cluster CTA `rank`'s shared memory at the local offset `local`, counted on that
// CTA's barrier `bar` (a local barrier address).
__device__ __forceinline__ void xbar_push(uint32_t local, uint32_t bar, uint32_t rank, uint32_t v) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                     cluster_addr(local, rank)),
                 "r"(v), "r"(cluster_addr(bar, rank))
                 : "memory");
}
// Until every byte of this CTA's exchange on `bar` has landed.
__device__ __forceinline__ void xbar_wait(uint32_t bar) {
    uint32_t done = 0;
    while (!done)
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(bar)
            : "memory");
}
template <typename T>
__device__ __forceinline__ uint32_t pair_bits(NlPair<T> p) {
    uint32_t v;
    memcpy(&v, &p, 4);
    return v;
}
