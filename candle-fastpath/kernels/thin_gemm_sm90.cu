// thin_gemm: y = x·Wᵀ + b (then the exact GELU) for the few rows of a batch-1 forward, on
// Hopper's tensor-memory accelerator (TMA) and warpgroup MMA (wgmma) — lever 100 in
// docs/BENCHMARKS.md. Compiled for compute_90a only (wgmma has no other target); build.rs makes
// it a PTX module of its own, loaded on compute capability 9.0.
//
// Lever 99 wrote this GEMM with cp.async and mma.sync and found its body (the cycles its SMs are
// busy) twice as long as cuBLASLt's `nvjet` kernel for DeiT-S's fc1 (197 × 1536 × 384): 28
// copy instructions a thread with their address arithmetic, then 16 × 64 warp slices that read
// their operands from shared memory through ldmatrix. `nvjet` does neither: one thread asks the
// TMA for whole tiles (one instruction a tile, already in the 128-byte swizzle wgmma reads), and
// wgmma reads both operands from shared memory itself, 64 rows at a time.
//
// Each CTA is one warpgroup computing a 64 × 64 tile of y over the whole of K (fc1 at 197 rows:
// 4 × 24 = 96 CTAs, one wave). Thread 0 arms one transaction barrier per 64-wide block of K
// and issues that block's two TMA copies (64 rows of x, 64 rows of W; rows past M or N arrive
// zero-filled); the warpgroup runs the block's four m64n64k16 wgmmas as soon as it has landed,
// while the later blocks still arrive. The epilogue is norm_linear's (epilogue.cuh): bias,
// rounding to the storage type, then x·Φ(x) of the rounded value, rounded again — what cuBLASLt's
// bias epilogue followed by the GELU pass computes.
//
// Constraints (checked by the host, FusedLinear in candle-fastpath): x [M, K] and W [N, K]
// contiguous, 16-byte aligned rows (TMA), N even, K = TG_K; the tensor maps describe them with
// 64 × 64 boxes and the 128-byte swizzle. Grid (ceil(N / 64), ceil(M / 64)), 128 threads,
// TG_BAR_OFFSET + 8 · TG_BLOCKS + 1024 bytes of dynamic shared memory.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// candle-ragged's kernel folder (its build metadata puts it on the include path): smem_addr, and
// the wgmma descriptors and fences.
#include "attention_common.cuh"
#include "epilogue.cuh"
#include "wgmma_common.cuh"

constexpr int TG_K = 384, TG_TILE = 64, TG_BLOCKS = TG_K / TG_TILE;
constexpr int TG_TILE_BYTES = TG_TILE * TG_TILE * 2;  // 64 rows of one 128-byte swizzle row each
// The tiles (1024-byte aligned for the swizzle), x's then W's per block of K, then the barriers.
constexpr int TG_BAR_OFFSET = 2 * TG_BLOCKS * TG_TILE_BYTES;
// Dynamic shared memory: the tiles, the barriers and 1024 bytes of alignment slack (the host's
// thin_gemm_smem_bytes).

// d (64 × 64 f32, the warpgroup's accumulator layout) += A (64 × 16) · B (16 × 64), both from
// shared memory through descriptors, K-major.
#define TG_WGMMA(NAME, TYPE)                                                                         \
    __device__ __forceinline__ void NAME(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {     \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                   \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                  \
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "        \
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
                     "%32, %33, p, 1, 1, 0, 0;\n}\n"                                                 \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),         \
                       "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),       \
                       "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),   \
                       "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),   \
                       "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),   \
                       "+f"(d[30]), "+f"(d[31])                                                        \
                     : "l"(da), "l"(db), "r"(scale_d));                                               \
    }
TG_WGMMA(tg_wgmma_f16, "f16")
TG_WGMMA(tg_wgmma_bf16, "bf16")

__device__ __forceinline__ void tg_mma(__half, float (&d)[32], uint64_t da, uint64_t db, int s) {
    tg_wgmma_f16(d, da, db, s);
}
__device__ __forceinline__ void tg_mma(__nv_bfloat16, float (&d)[32], uint64_t da, uint64_t db, int s) {
    tg_wgmma_bf16(d, da, db, s);
}

// Until the phase of the CTA-local barrier at `bar` has completed (its TMA bytes have landed).
__device__ __forceinline__ void tg_wait(uint32_t bar) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(bar)
                     : "memory");
}

template <typename T, bool GELU>
__device__ void thin_gemm_tile(const CUtensorMap* tx, const CUtensorMap* tw, const T* __restrict__ bias,
                               T* __restrict__ y, int M, int N) {
    extern __shared__ unsigned char tg_raw[];
    // The swizzle works on address bits: the tiles start 1024-byte aligned.
    unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(tg_raw) + 1023) & ~uintptr_t(1023));
    const uint32_t tiles = smem_addr(smem), bars = tiles + TG_BAR_OFFSET;
    const int m0 = blockIdx.y * TG_TILE, n0 = blockIdx.x * TG_TILE;
    if (threadIdx.x == 0) {
        asm volatile("prefetch.tensormap [%0];" ::"l"(tx) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(tw) : "memory");
#pragma unroll
        for (int b = 0; b < TG_BLOCKS; ++b) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bars + 8 * b));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#pragma unroll
        for (int b = 0; b < TG_BLOCKS; ++b) {
            const uint32_t bar = bars + 8 * b, xs = tiles + 2 * b * TG_TILE_BYTES, ws = xs + TG_TILE_BYTES;
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(2 * TG_TILE_BYTES)
                         : "memory");
            asm volatile(
                "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
                    xs),
                "l"(tx), "r"(b * TG_TILE), "r"(m0), "r"(bar)
                : "memory");
            asm volatile(
                "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
                    ws),
                "l"(tw), "r"(b * TG_TILE), "r"(n0), "r"(bar)
                : "memory");
        }
    }
    // The barriers' init is visible to every thread before any waits on them.
    __syncthreads();
    // The bias of this thread's accumulator columns, loaded while the tiles arrive.
    const int warp = threadIdx.x / 32;
    float bias_lo[4][2], bias_hi[4][2];
    nl_load_bias(bias_lo, bias, n0, N);
    nl_load_bias(bias_hi, bias, n0 + 32, N);
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
#pragma unroll
    for (int b = 0; b < TG_BLOCKS; ++b) {
        tg_wait(bars + 8 * b);
        const uint32_t xs = tiles + 2 * b * TG_TILE_BYTES, ws = xs + TG_TILE_BYTES;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < TG_TILE / 16; ++kk) tg_mma(T{}, d, desc_k_major(xs + kk * 32), desc_k_major(ws + kk * 32), 1);
        wg_commit();
    }
    wg_wait0();
    pin(d);
    // Per warp, d is the m16n8 accumulators of rows 16·warp.. and eight 8-column groups: two of
    // norm_linear's 16 × 32 epilogue tiles.
    nl_store_tile<T, GELU>(*reinterpret_cast<const float(*)[4][4]>(&d[0]), bias_lo, y, m0 + 16 * warp, n0, M, N);
    nl_store_tile<T, GELU>(*reinterpret_cast<const float(*)[4][4]>(&d[16]), bias_hi, y, m0 + 16 * warp, n0 + 32, M, N);
}

// One entry per storage type and epilogue, named as the Rust side's THIN_GEMM_NAMES expects.
#define THIN_GEMM_ENTRY(SUFFIX, T, GELU, TAIL)                                                              \
    extern "C" __global__ void __launch_bounds__(128)                                                      \
        fastpath_thin_gemm_##SUFFIX##_k384##TAIL(const __grid_constant__ CUtensorMap tx,                    \
                                                 const __grid_constant__ CUtensorMap tw, const T* bias, T* y, \
                                                 int M, int N) {                                             \
        thin_gemm_tile<T, GELU>(&tx, &tw, bias, y, M, N);                                                    \
    }
THIN_GEMM_ENTRY(f16, __half, false, )
THIN_GEMM_ENTRY(f16, __half, true, _gelu)
THIN_GEMM_ENTRY(bf16, __nv_bfloat16, false, )
THIN_GEMM_ENTRY(bf16, __nv_bfloat16, true, _gelu)
