// thin_gemm: y = x·Wᵀ + b (then the exact GELU) for the few rows of a batch-1 forward, on
// Hopper's tensor-memory accelerator (TMA) and warpgroup MMA (wgmma) — lever 100 in
// docs/LEVERS.md. Compiled for compute_90a only (wgmma has no other target); build.rs makes
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
// zero-filled), or, with `weights_first` (lever 124: the host sets it where the kernel gets a
// programmatic graph edge, so it may start while the one producing x still runs;
// dependent_launch.cuh), all of W's first and, past `griddepcontrol.wait`, all of x's; the
// warpgroup runs the block's four m64n64k16 wgmmas as soon as it has landed, while the later
// blocks still arrive. The epilogue is norm_linear's (epilogue.cuh): bias,
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
#include "cluster_exchange.cuh"
#include "dependent_launch.cuh"
#include "epilogue.cuh"
#include "layer_norm_row.cuh"
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

// One m64nNk16 wgmma by storage type and accumulator width (N = 64 here, 96 below).
__device__ __forceinline__ void tg_mma(__half, float (&d)[32], uint64_t da, uint64_t db) { tg_wgmma_f16(d, da, db, 1); }
__device__ __forceinline__ void tg_mma(__nv_bfloat16, float (&d)[32], uint64_t da, uint64_t db) {
    tg_wgmma_bf16(d, da, db, 1);
}

// The aligned start of the dynamic shared memory: the swizzle works on address bits, so the
// tiles start 1024-byte aligned (the hosts' sizes include 1024 bytes of slack).
__device__ __forceinline__ unsigned char* tg_smem() {
    extern __shared__ unsigned char tg_raw[];
    return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(tg_raw) + 1023) & ~uintptr_t(1023));
}

// `bytes` more expected on the CTA-local transaction barrier at `bar` (its one arrival).
__device__ __forceinline__ void tg_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// The TMA box of `map` at (column `col`, row `row`) into shared memory at `dst`, counted on `bar`.
__device__ __forceinline__ void tg_load_box(uint32_t dst, const CUtensorMap* map, int col, int row, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            dst),
        "l"(map), "r"(col), "r"(row), "r"(bar)
        : "memory");
}

// Until the phase of parity `parity` of the CTA-local barrier at `bar` has completed.
__device__ __forceinline__ void tg_wait_parity(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
}

// Until the first phase (parity 0) of the CTA-local barrier at `bar` has completed (its TMA
// bytes have landed): the barriers armed once per launch.
__device__ __forceinline__ void tg_wait(uint32_t bar) { tg_wait_parity(bar, 0); }

// Thread 0's first steps in every kernel here: both tensor maps prefetched, and the COUNT
// one-arrival barriers at `bars` initialised (the caller arms any of them and issues
// fence.mbarrier_init before they are used).
template <int COUNT>
__device__ __forceinline__ void tg_start(const CUtensorMap* ta, const CUtensorMap* tb, uint32_t bars) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(ta) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(tb) : "memory");
#pragma unroll
    for (int b = 0; b < COUNT; ++b) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bars + 8 * b));
}

template <typename T, bool GELU>
__device__ void thin_gemm_tile(const CUtensorMap* tx, const CUtensorMap* tw, const T* __restrict__ bias,
                               T* __restrict__ y, int M, int N, int weights_first) {
    const uint32_t tiles = smem_addr(tg_smem()), bars = tiles + TG_BAR_OFFSET;
    const int m0 = blockIdx.y * TG_TILE, n0 = blockIdx.x * TG_TILE;
    dl_launch_dependents();
    // weights_first (a programmatic graph edge in, dependent_launch.cuh): W's boxes, which no
    // kernel writes, asked for before the kernel this one depends on has finished, x's once it
    // has. Else each block's two boxes together (x's first: no wait to overlap, and W's 48 KB
    // ahead of x's would only delay the first block).
    if (threadIdx.x == 0) {
        tg_start<TG_BLOCKS>(tx, tw, bars);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#pragma unroll
        for (int b = 0; b < TG_BLOCKS; ++b) {
            const uint32_t xs = tiles + 2 * b * TG_TILE_BYTES;
            tg_expect(bars + 8 * b, 2 * TG_TILE_BYTES);
            if (!weights_first) tg_load_box(xs, tx, b * TG_TILE, m0, bars + 8 * b);
            tg_load_box(xs + TG_TILE_BYTES, tw, b * TG_TILE, n0, bars + 8 * b);
        }
    }
    // The bias of this thread's accumulator columns, loaded while the tiles arrive.
    const int warp = threadIdx.x / 32;
    float bias_lo[4][2], bias_hi[4][2];
    nl_load_bias(bias_lo, bias, n0, N);
    nl_load_bias(bias_hi, bias, n0 + 32, N);
    dl_wait();
    if (weights_first && threadIdx.x == 0) {
#pragma unroll
        for (int b = 0; b < TG_BLOCKS; ++b) tg_load_box(tiles + 2 * b * TG_TILE_BYTES, tx, b * TG_TILE, m0, bars + 8 * b);
    }
    // The barriers' init is visible to every thread before any waits on them.
    __syncthreads();
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
#pragma unroll
    for (int b = 0; b < TG_BLOCKS; ++b) {
        tg_wait(bars + 8 * b);
        const uint32_t xs = tiles + 2 * b * TG_TILE_BYTES, ws = xs + TG_TILE_BYTES;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < TG_TILE / 16; ++kk) tg_mma(T{}, d, desc_k_major(xs + kk * 32), desc_k_major(ws + kk * 32));
        wg_commit();
    }
    wg_wait0();
    pin(d);
    // Per warp, d is the m16n8 accumulators of rows 16·warp.. and eight 8-column groups: two of
    // norm_linear's 16 × 32 epilogue tiles.
    nl_store_tile<T, GELU>(*reinterpret_cast<const float(*)[4][4]>(&d[0]), bias_lo, y, m0 + 16 * warp, n0, M, N);
    nl_store_tile<T, GELU>(*reinterpret_cast<const float(*)[4][4]>(&d[16]), bias_hi, y, m0 + 16 * warp, n0 + 32, M, N);
}

// The thin GEMM's entries at width K, one per storage type and epilogue, each running TILE (the
// tile function for that width) with launch bounds BOUNDS, named as the Rust side's
// THIN_GEMM_NAMES expects.
#define THIN_GEMM_ENTRY(K, BOUNDS, TILE, SUFFIX, T, GELU, TAIL)                                           \
    extern "C" __global__ void __launch_bounds__ BOUNDS fastpath_thin_gemm_##SUFFIX##_k##K##TAIL(          \
        const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap tw, const T* bias, T* y, \
        int M, int N, int weights_first) {                                                                  \
        TILE<T, GELU>(&tx, &tw, bias, y, M, N, weights_first);                                              \
    }
#define THIN_GEMM_ENTRIES(K, BOUNDS, TILE)                                \
    THIN_GEMM_ENTRY(K, BOUNDS, TILE, f16, __half, false, )                \
    THIN_GEMM_ENTRY(K, BOUNDS, TILE, f16, __half, true, _gelu)            \
    THIN_GEMM_ENTRY(K, BOUNDS, TILE, bf16, __nv_bfloat16, false, )        \
    THIN_GEMM_ENTRY(K, BOUNDS, TILE, bf16, __nv_bfloat16, true, _gelu)
THIN_GEMM_ENTRIES(384, (128), thin_gemm_tile)

// thin_gemm_wide (lever 130): the same GEMM at DeiT-B's width, K = 768, where all twelve 64-wide
// blocks of K as 64 × 64 tiles (192 KB) would allow one CTA per SM and two waves for fc1's 192
// tiles, and lever 101's ring of four slots at two CTAs per SM serialised loads behind MMAs
// (9.4 µs for fc1 + GELU against cuBLASLt's 7.0 + the GELU pass's 3.0). Here a CTA computes a
// 64 × 128 tile (fc1 at 197 rows: 4 × 24 = 96 CTAs, qkv 4 × 18, one wave at one CTA per SM) as
// two warpgroups, each 64 of its columns, sharing x's tile; the twelve blocks of K go through
// TGW_STAGES = 8 slots of x's 64 rows and W's 128 rows (24 KB a slot): eight blocks in flight from
// the start, and the slots of blocks 0–3 refilled with blocks 8–11 as soon as both warpgroups'
// wgmmas on them are done (early in the loop, while the later blocks still arrive). A CTA reads
// 288 KB against 2 · 192 KB on an SM of the two-wave layout. The epilogue is thin_gemm_tile's, per
// warpgroup. weights_first: W's boxes of the first eight blocks before `griddepcontrol.wait`,
// x's after it (the refills need the wait anyway).
//
// Constraints (checked by the host): as thin_gemm_tile's, K = TGW_K; W's tensor map in boxes of
// 128 rows. Grid (ceil(N / 128), ceil(M / 64)), 256 threads, TGW_SMEM bytes of dynamic shared
// memory (the host's ThinGemmWidth::smem_bytes for K768).
constexpr int TGW_K = 768, TGW_BN = 128, TGW_STAGES = 8, TGW_BLOCKS = TGW_K / TG_TILE;
constexpr int TGW_W_BYTES = TGW_BN * TG_TILE * 2;
constexpr int TGW_SLOT_BYTES = TG_TILE_BYTES + TGW_W_BYTES;
constexpr int TGW_BAR_OFFSET = TGW_STAGES * TGW_SLOT_BYTES;
constexpr int TGW_SMEM = TGW_BAR_OFFSET + 8 * TGW_STAGES + 1024;
static_assert(TGW_STAGES < TGW_BLOCKS && TGW_BLOCKS <= 2 * TGW_STAGES, "each slot refilled at most once");
static_assert(TGW_SMEM <= 227 * 1024, "one CTA per SM");

template <typename T, bool GELU>
__device__ void thin_gemm_wide_tile(const CUtensorMap* tx, const CUtensorMap* tw, const T* __restrict__ bias,
                                    T* __restrict__ y, int M, int N, int weights_first) {
    const uint32_t tiles = smem_addr(tg_smem()), bars = tiles + TGW_BAR_OFFSET;
    const int m0 = blockIdx.y * TG_TILE, n0 = blockIdx.x * TGW_BN;
    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4;
    dl_launch_dependents();
    // Slot s holds x's tile at tiles + s · SLOT, W's 128 rows right after it.
    auto x_at = [&](int slot) { return tiles + slot * TGW_SLOT_BYTES; };
    if (threadIdx.x == 0) {
        tg_start<TGW_STAGES>(tx, tw, bars);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#pragma unroll
        for (int s = 0; s < TGW_STAGES; ++s) {
            tg_expect(bars + 8 * s, TGW_SLOT_BYTES);
            if (!weights_first) tg_load_box(x_at(s), tx, s * TG_TILE, m0, bars + 8 * s);
            tg_load_box(x_at(s) + TG_TILE_BYTES, tw, s * TG_TILE, n0, bars + 8 * s);
        }
    }
    // The bias of this thread's accumulator columns (its warpgroup's 64), loaded while the tiles
    // arrive.
    const int nw = n0 + 64 * wg;
    float bias_lo[4][2], bias_hi[4][2];
    nl_load_bias(bias_lo, bias, nw, N);
    nl_load_bias(bias_hi, bias, nw + 32, N);
    dl_wait();
    if (weights_first && threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < TGW_STAGES; ++s) tg_load_box(x_at(s), tx, s * TG_TILE, m0, bars + 8 * s);
    }
    // The barriers' init is visible to every thread before any waits on them.
    __syncthreads();
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
#pragma unroll
    for (int b = 0; b < TGW_BLOCKS; ++b) {
        const int slot = b % TGW_STAGES;
        tg_wait_parity(bars + 8 * slot, (b / TGW_STAGES) & 1);
        const uint32_t xs = x_at(slot), ws = xs + TG_TILE_BYTES + wg * TG_TILE_BYTES;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < TG_TILE / 16; ++kk) tg_mma(T{}, d, desc_k_major(xs + kk * 32), desc_k_major(ws + kk * 32));
        wg_commit();
        // Block b − 1's slot refilled with block b − 1 + STAGES once both warpgroups' wgmmas on it
        // are done (b's may still run).
        if (b >= 1 && b - 1 + TGW_STAGES < TGW_BLOCKS) {
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            __syncthreads();
            if (threadIdx.x == 0) {
                const int s = (b - 1) % TGW_STAGES, nb = b - 1 + TGW_STAGES;
                tg_expect(bars + 8 * s, TGW_SLOT_BYTES);
                tg_load_box(x_at(s), tx, nb * TG_TILE, m0, bars + 8 * s);
                tg_load_box(x_at(s) + TG_TILE_BYTES, tw, nb * TG_TILE, n0, bars + 8 * s);
            }
        }
    }
    wg_wait0();
    pin(d);
    nl_store_tile<T, GELU>(*reinterpret_cast<const float(*)[4][4]>(&d[0]), bias_lo, y, m0 + 16 * warp, nw, M, N);
    nl_store_tile<T, GELU>(*reinterpret_cast<const float(*)[4][4]>(&d[16]), bias_hi, y, m0 + 16 * warp, nw + 32, M, N);
}

THIN_GEMM_ENTRIES(768, (256, 1), thin_gemm_wide_tile)

// d (64 × 96 f32) += A (64 × 16) · B (16 × 96), both from shared memory through descriptors,
// K-major: the fc2 kernel's 96-column tiles.
#define TR_WGMMA96(NAME, TYPE)                                                                        \
    __device__ __forceinline__ void NAME(float (&d)[48], uint64_t da, uint64_t db) {                   \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                     \
                     "wgmma.mma_async.sync.aligned.m64n96k16.f32." TYPE "." TYPE " "                  \
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                       \
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                 \
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, "                \
                     "%48, %49, p, 1, 1, 0, 0;\n}\n"                                               \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),   \
                       "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),   \
                       "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),   \
                       "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),   \
                       "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),   \
                       "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),   \
                       "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),   \
                       "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])   \
                     : "l"(da), "l"(db));                                                              \
    }
TR_WGMMA96(tr_wgmma96_f16, "f16")
TR_WGMMA96(tr_wgmma96_bf16, "bf16")

// ---------------------------------------------------------------------------------------------
// thin_residual_norm (lever 103): fc2, the residual add and the next block's norm1 as one launch
// at DeiT-S's width for the few rows of a batch-1 forward:
//   x1 = (h·W2ᵀ + r) + b2   (h [M, 4C] fc1's GELU output, r [M, C] the residual, W2 [C, 4C]),
//   z = LayerNorm(x1),
// both written out (x1 is the residual stream, z the next qkv's input), where the graph ran
// cuBLASLt's GEMM with its residual epilogue (~6.4 µs, ncu) and then the LayerNorm kernel (~3.1).
// lever 98's cluster form of this (mma.sync, 16-row tiles, 148 KB of W2 per CTA) was slower
// than those two launches; this one is the thin GEMM's body (TMA boxes, one barrier per 64-wide
// block of K, wgmma from shared memory) with K split over the cluster, so that each CTA moves
// what a thin-GEMM CTA of qkv moves:
// - the CTAs sharing a 64-row tile form one cluster of NT × KS: NT column tiles BN wide (NT · BN
//   = C) times KS slices of K (1536 / KS each); the CTA at (column tile n, slice k) is rank
//   n + NT · k (the grid is (NT, ceil(M / 64), KS) and the cluster spans its x and z);
// - each CTA multiplies its 64 × BN tile over its slice of K, then pushes its f32 partial sums
//   of rows [R·k', R·k' + R) (R = 64 / KS) into CTA (n, k')'s buffer (st.async, counted on that
//   CTA's barrier);
// - CTA (n, k) sums the KS partials of its R rows in slice order, adds the residual, then the
//   bias, rounds once (rnl_finish's order), stores x1 and pushes each row's BN values into the
//   row buffer of the CTA that normalises that row (row i of the R: CTA (i mod NT, k));
// - each CTA normalises its rows with the LayerNorm kernel's own row code (layer_norm_row.cuh),
//   so z is that kernel's output for this x1 bit for bit.
// No CTA reads another's shared memory: each waits only for the bytes pushed into it (its
// partials, its rows), so it may exit once those have landed.
// Constraints (checked by the host, ThinResidualNormOp in candle-fastpath): h [M, TR_K] and W2
// [TR_C, TR_K] contiguous with 16-byte aligned rows (TMA), r, x1, z [M, TR_C] contiguous, the
// tensor maps in 64-wide boxes (64 rows of h, BN rows of W2) with the 128-byte swizzle; grid
// (NT, ceil(M / 64), KS) in clusters of (NT, 1, KS) (non-portable sizes: the host opts in), 128
// threads, TrShape<BN, KS>::SMEM bytes of dynamic shared memory (the host's
// ThinResidualNormTiles::smem_bytes).
constexpr int TR_C = 384, TR_K = 1536;

template <int BN, int KS>
struct TrShape {
    static constexpr int NT = TR_C / BN;                  // column tiles
    static constexpr int KB = TR_K / KS / TG_TILE;        // 64-wide blocks of K per CTA
    static constexpr int R = TG_TILE / KS;                // x1 rows a CTA finishes
    static constexpr int WT = BN * 128;                   // one W2 box: BN rows of 128 bytes
    static constexpr int TILES = KB * (TG_TILE_BYTES + WT);
    static constexpr int PART = KS * R * BN * 4;          // partials received: [KS][R][BN] f32
    static constexpr int OWN = (R + NT - 1) / NT;         // rows a CTA normalises (at most)
    static constexpr int LDR = TR_C + 8;                  // row buffer stride (elements)
    static constexpr int ROWS = OWN * LDR * 2;
    static constexpr int BARS = TILES + PART + ROWS;      // KB barriers, then partials', rows'
    static constexpr int SMEM = BARS + 8 * (KB + 2) + 1024;
    static constexpr int PAIRS = R * BN / 2 / 128;        // x1 pairs a thread finishes
    static_assert(TR_C % BN == 0 && (TR_K / KS) % TG_TILE == 0 && TG_TILE % KS == 0 && R % 16 == 0 &&
                      (R * BN / 2) % 128 == 0 && BN % 16 == 0 && WT % 1024 == 0 && ROWS % 16 == 0,
                  "thin_residual_norm shape");
};

__device__ __forceinline__ void tg_mma(__half, float (&d)[48], uint64_t da, uint64_t db) { tr_wgmma96_f16(d, da, db); }
__device__ __forceinline__ void tg_mma(__nv_bfloat16, float (&d)[48], uint64_t da, uint64_t db) {
    tr_wgmma96_bf16(d, da, db);
}

// 8 bytes into cluster CTA `rank`'s shared memory at the local offset `local`, counted on that
// CTA's barrier `bar`.
__device__ __forceinline__ void tr_push2(uint32_t local, uint32_t bar, uint32_t rank, float a, float b) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(
                     cluster_addr(local, rank)),
                 "f"(a), "f"(b), "r"(cluster_addr(bar, rank))
                 : "memory");
}

template <typename T, int BN, int KS>
__device__ void thin_residual_norm_tile(const CUtensorMap* th, const CUtensorMap* tw, const T* __restrict__ bias,
                                        const T* __restrict__ r, const T* __restrict__ ln_w,
                                        const T* __restrict__ ln_b, T* __restrict__ x1, T* __restrict__ z, int M,
                                        float eps, int weights_first) {
    using S = TrShape<BN, KS>;
    constexpr int NT = S::NT, KB = S::KB, R = S::R, CHUNKS = (TR_C / 8 + 31) / 32;
    unsigned char* smem = tg_smem();
    const uint32_t tiles = smem_addr(smem), parts = tiles + S::TILES, rows = parts + S::PART;
    const uint32_t bars = tiles + S::BARS, part_bar = bars + 8 * KB, row_bar = part_bar + 8;
    const float* part = reinterpret_cast<const float*>(smem + S::TILES);
    const T* rowbuf = reinterpret_cast<const T*>(smem + S::TILES + S::PART);
    const int n = blockIdx.x, k = blockIdx.z, m0 = blockIdx.y * TG_TILE, n0 = n * BN;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    // Rows [R·k, R·k + R) of the tile are this CTA's to finish; of those, i ≡ n (mod NT) its to
    // normalise.
    const int owned = (R - n + NT - 1) / NT;
    const int kbase = k * (TR_K / KS);
    dl_launch_dependents();
    // weights_first: W2's boxes first, h's once the kernel this one depends on has finished; else
    // each block's two together (as thin_gemm_tile).
    if (tid == 0) {
        tg_start<KB + 2>(th, tw, bars);
        // The exchanges' byte counts: KS partial slabs, and `owned` whole rows.
        tg_expect(part_bar, S::PART);
        tg_expect(row_bar, owned * TR_C * (int)sizeof(T));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#pragma unroll
        for (int b = 0; b < KB; ++b) {
            tg_expect(bars + 8 * b, TG_TILE_BYTES + S::WT);
            if (!weights_first) tg_load_box(tiles + b * TG_TILE_BYTES, th, kbase + b * TG_TILE, m0, bars + 8 * b);
            tg_load_box(tiles + KB * TG_TILE_BYTES + b * S::WT, tw, kbase + b * TG_TILE, n0, bars + 8 * b);
        }
    }
    // No remote push before the whole cluster runs with its barriers armed: every thread arrives
    // here and waits right before its first push.
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    // Meanwhile: the LayerNorm's parameters and the bias (weights: before the wait), then the
    // residual of the x1 pairs this thread finishes (pair p = tid + 128 i: row p / (BN / 2) of the
    // R, columns 2 (p mod (BN / 2)) + 0, 1).
    uint4 wraw[CHUNKS], braw[CHUNKS];
    layer_norm_params<CHUNKS>(ln_w, ln_b, wraw, braw, TR_C / 8, lane);
    float res[S::PAIRS][2], pb[S::PAIRS][2];
#pragma unroll
    for (int i = 0; i < S::PAIRS; ++i) {
        const int col = n0 + 2 * ((tid + 128 * i) % (BN / 2));
        pb[i][0] = to_f32(bias[col]);
        pb[i][1] = to_f32(bias[col + 1]);
    }
    dl_wait();
    if (weights_first && tid == 0) {
#pragma unroll
        for (int b = 0; b < KB; ++b) tg_load_box(tiles + b * TG_TILE_BYTES, th, kbase + b * TG_TILE, m0, bars + 8 * b);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < S::PAIRS; ++i) {
        const int p = tid + 128 * i, row = m0 + R * k + p / (BN / 2), col = n0 + 2 * (p % (BN / 2));
        res[i][0] = res[i][1] = 0.f;
        if (row < M) {
            const NlPair<T> v = *reinterpret_cast<const NlPair<T>*>(r + (size_t)row * TR_C + col);
            res[i][0] = to_f32(v.a);
            res[i][1] = to_f32(v.b);
        }
    }
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
#pragma unroll
    for (int b = 0; b < KB; ++b) {
        tg_wait(bars + 8 * b);
        const uint32_t xs = tiles + b * TG_TILE_BYTES, ws = tiles + KB * TG_TILE_BYTES + b * S::WT;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < TG_TILE / 16; ++kk) tg_mma(T{}, d, desc_k_major(xs + kk * 32), desc_k_major(ws + kk * 32));
        wg_commit();
    }
    wg_wait0();
    pin(d);

    // Partials out: warp w's rows 16w.. belong to slice k' = 16w / R; they land in CTA (n, k')'s
    // buffer as slab k (its [k][row - R·k'][col]).
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    {
        const int dest = 16 * warp / R, dest_rank = n + NT * dest;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = 16 * warp + lane / 4 + 8 * h - R * dest, col = 8 * j + (lane % 4) * 2;
                tr_push2(parts + 4 * ((k * R + row) * BN + col), part_bar, dest_rank, d[4 * j + 2 * h],
                         d[4 * j + 2 * h + 1]);
            }
        }
    }
    // x1 of this CTA's R rows: the KS partials in slice order, then the residual, then the bias,
    // rounded once; to global memory and into the normalising CTA's row buffer.
    xbar_wait(part_bar);
#pragma unroll
    for (int i = 0; i < S::PAIRS; ++i) {
        const int p = tid + 128 * i, row = p / (BN / 2), col = 2 * (p % (BN / 2));
        const NlPair<T> o = front_pair<T, KS, R, BN>(part, row, col, res[i], pb[i]);
        const int grow = m0 + R * k + row;
        if (grow < M) *reinterpret_cast<NlPair<T>*>(x1 + (size_t)grow * TR_C + n0 + col) = o;
        const uint32_t dst = rows + 2 * ((row / NT) * S::LDR + n0 + col);
        xbar_push(dst, row_bar, row % NT + NT * k, pair_bits(o));
    }
    // This CTA's rows, whole, normalised one per warp.
    xbar_wait(row_bar);
    for (int s = warp; s < owned; s += 4) {
        const int grow = m0 + R * k + n + NT * s;
        if (grow < M)
            layer_norm_warp_row<CHUNKS, T>(reinterpret_cast<const uint4*>(rowbuf + s * S::LDR),
                                           reinterpret_cast<uint4*>(z + (size_t)grow * TR_C), wraw, braw, TR_C / 8,
                                           TR_C, eps, lane);
    }
}

// One entry per storage type and tile shape, named as the Rust side's THIN_RESIDUAL_NORM_NAMES
// expects: n96_s4 (clusters of 16, the default) and n64_s2 (clusters of 12).
#define THIN_RESIDUAL_NORM_ENTRY(SUFFIX, T, BN, KS)                                                           \
    extern "C" __global__ void __launch_bounds__(128) fastpath_thin_residual_norm_##SUFFIX##_n##BN##_s##KS(   \
        const __grid_constant__ CUtensorMap th, const __grid_constant__ CUtensorMap tw, const T* bias,        \
        const T* r, const T* ln_w, const T* ln_b, T* x1, T* z, int M, float eps, int weights_first) {         \
        thin_residual_norm_tile<T, BN, KS>(&th, &tw, bias, r, ln_w, ln_b, x1, z, M, eps, weights_first);      \
    }
THIN_RESIDUAL_NORM_ENTRY(f16, __half, 96, 4)
THIN_RESIDUAL_NORM_ENTRY(bf16, __nv_bfloat16, 96, 4)
THIN_RESIDUAL_NORM_ENTRY(f16, __half, 64, 2)
THIN_RESIDUAL_NORM_ENTRY(bf16, __nv_bfloat16, 64, 2)
