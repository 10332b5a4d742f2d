// Lever 61's probe: where the time of residual_norm_linear (the attention's proj + residual,
// norm2, fc1 and GELU as one kernel, a cluster of six CTAs per 16-row tile splitting the
// projection) goes, against what it replaces (cuBLASLt's proj with the residual epilogue, then
// lever 58's norm_linear), at DeiT-T's shapes (C = 192, N = 768), f16, in graph chains:
//   sep       proj (cuBLASLt) + norm_linear, the two launches the model ran before
//   proj      cuBLASLt's proj alone;  nl   norm_linear alone
//   nl_cl     norm_linear's kernel launched in clusters of 6 (what a cluster costs by itself)
//   rnl       the fused kernel as shipped (its projection split over six warps along K; the
//             first version, one warp, measured 6.85 µs at M = 197: docs/BENCHMARKS.md, lever 61)
//   rnl breakdown: rnl_mode, a copy of the fused kernel as it stood before its start-of-kernel
//             cluster arrive (the wait for the whole cluster to be running before its DSMEM
//             stores; racecheck flagged every remote store without it): MODE 0 that copy;
//             without its DSMEM stores (MODE 1: to its own rows only), also without the
//             cluster barrier (3: __syncthreads), without the projection's MMA
//             (4: zeros), or none of these (7); MODE 8: x1's pairs sent by st.async completing
//             bytes on each receiver's mbarrier, which it waits on, instead of the cluster barrier
//   rnl_flat  the fused kernel without a cluster: each CTA computes all 192 columns of its rows'
//             projection (6 warps, the whole Wp through shared memory), nothing shared
// Checked first: rnl's and rnl_flat's x1 and y against sep's (max |difference| printed).
// Then the other boundary (fc2 + residual in front of the next block's norm1 + qkv, the kernel's
// _k768 form) against cuBLASLt's fc2 followed by norm_linear, checked and timed the same way.
// Run on the GPU from the repo root:
//   nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -o /tmp/rnl scripts/gpu/probes/rnl.cu -lcublasLt -lcuda && /tmp/rnl
//   RNL_CHECK_ONLY=1 compute-sanitizer --tool racecheck /tmp/rnl   (the checks alone: 0 hazards in
//   the shipped kernel; MODE 8's mbarrier use draws racecheck warnings, not errors)
#include <cuda_fp16.h>

#include <cmath>

#include "../../../candle-fastpath/kernels/fastpath.cu"
#include "probe_common.cuh"

constexpr int C = 192, N = 768, NODES = 48, REPS = 200;
constexpr int LDS = C + 8;

extern "C" __global__ void __cluster_dims__(6, 1, 1) __launch_bounds__(NL_WARPS * 32)
    nl_clustered(const __half* x, const __half* ln_w, const __half* ln_b, const __half* w, const __half* bias,
                 __half* y, int M, int Nn, float eps) {
    norm_linear_tile<__half, C, true>(x, ln_w, ln_b, w, bias, y, M, Nn, eps);
}

// rnl_flat: no cluster; warps 0..5 each compute 32 of the 192 projection columns of the tile's
// 16 rows from the whole Wp in shared memory, then norm_linear as before.
extern "C" __global__ void __launch_bounds__(NL_WARPS * 32)
    rnl_flat(const __half* o, const __half* wp, const __half* bp, const __half* r, const __half* ln_w,
             const __half* ln_b, const __half* w, const __half* bias, __half* x1, __half* y, int M, int Nn,
             float eps) {
    using T = __half;
    constexpr int K = C, THREADS = NL_WARPS * 32, VECS = K / 8, CHUNKS = (VECS + 31) / 32;
    constexpr int WARPS_N = NL_BN / 32;
    extern __shared__ __align__(16) unsigned char flat_smem[];
    T* sa = reinterpret_cast<T*>(flat_smem);
    T* sb = sa + NL_BM * LDS;
    T* so = sb + NL_BN * LDS;
    T* sp = so + NL_BM * LDS;  // all C rows of Wp
    const int m0 = blockIdx.y * NL_BM, n0 = blockIdx.x * NL_BN;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    for (int i = tid; i < NL_BM * VECS; i += THREADS) {
        const int rr = i / VECS, c = i % VECS;
        const bool ok = m0 + rr < M;
        nl_cp_async16(so + rr * LDS + c * 8, o + (size_t)(ok ? m0 + rr : 0) * K + c * 8, ok);
    }
    for (int i = tid; i < K * VECS; i += THREADS) {
        const int rr = i / VECS, c = i % VECS;
        nl_cp_async16(sp + rr * LDS + c * 8, wp + (size_t)rr * K + c * 8, true);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    for (int i = tid; i < NL_BN * VECS; i += THREADS) {
        const int rr = i / VECS, c = i % VECS;
        const bool ok = n0 + rr < Nn;
        nl_cp_async16(sb + rr * LDS + c * 8, w + (size_t)(ok ? n0 + rr : 0) * K + c * 8, ok);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    uint4 wraw[CHUNKS], braw[CHUNKS];
    layer_norm_params<CHUNKS>(ln_w, ln_b, wraw, braw, VECS, lane);
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    float bias_f[4][2];
    nl_load_bias(bias_f, bias, n0 + wn * 32, Nn);
    float pbias[4][2], res[4][2][2];
    const int c0 = warp * 32;
    if (warp < 6) {
        nl_load_bias(pbias, bp, c0, K);
        for (int j = 0; j < 4; ++j) {
            const int col = c0 + j * 8 + (lane % 4) * 2;
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + lane / 4 + h * 8;
                NlPair<T> p{__float2half(0.f), __float2half(0.f)};
                if (row < M) p = *reinterpret_cast<const NlPair<T>*>(r + (size_t)row * K + col);
                res[j][h][0] = to_f32(p.a);
                res[j][h][1] = to_f32(p.b);
            }
        }
    }
    asm volatile("cp.async.wait_group 1;" ::: "memory");
    __syncthreads();
    if (warp < 6) {
        float acc[4][4] = {};
        nl_warp_mma_16x32<T, K, LDS>(acc, so, sp + c0 * LDS);
        for (int j = 0; j < 4; ++j) {
            const int col = c0 + j * 8 + (lane % 4) * 2;
            for (int h = 0; h < 2; ++h) {
                const int rl = lane / 4 + h * 8;
                const NlPair<T> p{from_f32<T>((acc[j][2 * h] + res[j][h][0]) + pbias[j][0]),
                                  from_f32<T>((acc[j][2 * h + 1] + res[j][h][1]) + pbias[j][1])};
                *reinterpret_cast<NlPair<T>*>(sa + rl * LDS + col) = p;
                if (m0 + rl < M && blockIdx.x == 0) *reinterpret_cast<NlPair<T>*>(x1 + (size_t)(m0 + rl) * K + col) = p;
            }
        }
    }
    __syncthreads();
    if (warp < NL_BM) {
        uint4* row = reinterpret_cast<uint4*>(sa + warp * LDS);
        layer_norm_warp_row<CHUNKS, T>(row, row, wraw, braw, VECS, K, eps, lane);
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    if (warp >= WARPS_N) return;
    float acc[4][4] = {};
    nl_warp_mma_16x32<T, K, LDS>(acc, sa + wm * 16 * LDS, sb + wn * 32 * LDS);
    nl_store_tile<T, true>(acc, bias_f, y, m0 + wm * 16, n0 + wn * 32, M, Nn);
}

// MODE 8's pieces: x1's pairs reach the other CTAs by st.async, each completing bytes on the
// receiver's mbarrier, which the receiver waits on (instead of a cluster barrier after the stores).
__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ unsigned mapa_u32(unsigned addr, unsigned rank) {
    unsigned out;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
    return out;
}
__device__ __forceinline__ void st_async_b32(unsigned remote, unsigned value, unsigned remote_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(remote), "r"(value),
                 "r"(remote_bar)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], 0;\n"
        "@!p bra WAIT_%=;\n}" ::"r"(bar)
        : "memory");
}

template <typename T, int K, bool GELU, int MODE>
__device__ void rnl_mode_tile(const T* __restrict__ o, const T* __restrict__ wp,
                                          const T* __restrict__ bp, const T* __restrict__ r,
                                          const T* __restrict__ ln_w, const T* __restrict__ ln_b,
                                          const T* __restrict__ w, const T* __restrict__ bias, T* __restrict__ x1,
                                          T* __restrict__ y, int M, int N, float eps) {
    constexpr int THREADS = NL_WARPS * 32, LDS = K + 8, VECS = K / 8, CHUNKS = (VECS + 31) / 32;
    constexpr int WARPS_N = NL_BN / 32, MMA_WARPS = (NL_BM / 16) * WARPS_N, SLICE = K / RNL_SPLIT;
    // The projection's K is split over RNL_KWARPS warps (a 12-step dependent MMA chain in one
    // warp cost ~1 µs, the probe's breakdown), then RNL_PAIRS threads sum the partials in a fixed
    // order, one pair of adjacent x1 elements each.
    constexpr int RNL_KWARPS = 6, KSLICE = K / RNL_KWARPS, RNL_PAIRS = NL_BM * SLICE / 2;
    static_assert(K % 16 == 0 && MMA_WARPS <= NL_WARPS && NL_BM <= NL_WARPS && SLICE == 32 && NL_BM == 16 &&
                      KSLICE % 16 == 0 && RNL_KWARPS <= NL_WARPS && RNL_PAIRS <= THREADS,
                  "tile shape");
    extern __shared__ __align__(16) unsigned char mode_smem[];
    T* sa = reinterpret_cast<T*>(mode_smem);  // NL_BM rows of x1 (filled by the cluster), then normalised
    T* sb = sa + NL_BM * LDS;                // NL_BN rows of W
    T* so = sb + NL_BN * LDS;                // NL_BM rows of o
    T* sp = so + NL_BM * LDS;                // this rank's SLICE rows of Wp
    // The projection's partial sums, [RNL_KWARPS][NL_BM][SLICE] f32.
    float* spart = reinterpret_cast<float*>(sp + SLICE * LDS);
    // The cluster spans the grid's x (RNL_SPLIT CTAs), so a CTA's rank is its blockIdx.x.
    const int rank = blockIdx.x;
    const int m0 = blockIdx.y * NL_BM, n0 = blockIdx.x * NL_BN, c0 = rank * SLICE;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    __shared__ __align__(8) unsigned long long x1_bar;
    if (MODE & 8) {
        if (tid == 0) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&x1_bar)) : "memory");
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&x1_bar)),
                         "r"(RNL_SPLIT * NL_BM * SLICE * (int)sizeof(T))
                         : "memory");
        }
        // Every CTA's barrier is initialised before any other CTA signals it (waited on below,
        // right before the stores, long after every CTA has arrived).
        asm volatile("barrier.cluster.arrive.release;" ::: "memory");
    }

    // 1. The projection's operands first (o's rows, this rank's Wp rows), then W's rows.
    for (int i = tid; i < NL_BM * VECS; i += THREADS) {
        const int rr = i / VECS, c = i % VECS;
        const bool ok = m0 + rr < M;
        nl_cp_async16(so + rr * LDS + c * 8, o + (size_t)(ok ? m0 + rr : 0) * K + c * 8, ok);
    }
    for (int i = tid; i < SLICE * VECS; i += THREADS) {
        const int rr = i / VECS, c = i % VECS;
        nl_cp_async16(sp + rr * LDS + c * 8, wp + (size_t)(c0 + rr) * K + c * 8, true);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    for (int i = tid; i < NL_BN * VECS; i += THREADS) {
        const int rr = i / VECS, c = i % VECS;
        const bool ok = n0 + rr < N;
        nl_cp_async16(sb + rr * LDS + c * 8, w + (size_t)(ok ? n0 + rr : 0) * K + c * 8, ok);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    uint4 wraw[CHUNKS], braw[CHUNKS];
    layer_norm_params<CHUNKS>(ln_w, ln_b, wraw, braw, VECS, lane);
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    float bias_f[4][2];
    nl_load_bias(bias_f, bias, n0 + wn * 32, N);
    // The pair of x1 this thread finishes (threads below RNL_PAIRS): its row and column, and
    // the residual and bias it adds (zero past M).
    const int prow = tid / (SLICE / 2), pcol = c0 + (tid % (SLICE / 2)) * 2;
    float res[2] = {0.f, 0.f}, pbias[2] = {0.f, 0.f};
    if (tid < RNL_PAIRS) {
        if (m0 + prow < M) {
            const NlPair<T> p = *reinterpret_cast<const NlPair<T>*>(r + (size_t)(m0 + prow) * K + pcol);
            res[0] = to_f32(p.a);
            res[1] = to_f32(p.b);
        }
        pbias[0] = to_f32(bp[pcol]);
        pbias[1] = to_f32(bp[pcol + 1]);
    }
    asm volatile("cp.async.wait_group 1;" ::: "memory");
    __syncthreads();

    // 2. This rank's 16 × 32 slice of o·Wpᵀ, K split over RNL_KWARPS warps into partials.
    if (warp < RNL_KWARPS) {
        float acc[4][4] = {};
        if (!(MODE & 4)) nl_warp_mma_16x32<T, KSLICE, LDS>(acc, so + warp * KSLICE, sp + warp * KSLICE);
        float* part = spart + warp * NL_BM * SLICE;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int rl = lane / 4 + h * 8, cl = j * 8 + (lane % 4) * 2;
                *reinterpret_cast<float2*>(part + rl * SLICE + cl) = make_float2(acc[j][2 * h], acc[j][2 * h + 1]);
            }
        }
    }
    __syncthreads();

    // 3. x1 = (o·Wpᵀ + r) + bp, rounded once, to global memory and to every cluster CTA's rows.
    if (MODE & 8) asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
    if ((MODE & 8) && tid < RNL_PAIRS) {
        float2 sum = make_float2(0.f, 0.f);
#pragma unroll
        for (int q = 0; q < RNL_KWARPS; ++q) {
            const float2 v = *reinterpret_cast<const float2*>(spart + (q * NL_BM + prow) * SLICE + (pcol - c0));
            sum.x += v.x;
            sum.y += v.y;
        }
        const NlPair<T> p{from_f32<T>((sum.x + res[0]) + pbias[0]), from_f32<T>((sum.y + res[1]) + pbias[1])};
        const unsigned bits = *reinterpret_cast<const unsigned*>(&p);
        const unsigned la = smem_u32(sa + prow * LDS + pcol), lb = smem_u32(&x1_bar);
#pragma unroll
        for (int q = 0; q < RNL_SPLIT; ++q) st_async_b32(mapa_u32(la, q), bits, mapa_u32(lb, q));
        if (m0 + prow < M) *reinterpret_cast<NlPair<T>*>(x1 + (size_t)(m0 + prow) * K + pcol) = p;
    }
    if (!(MODE & 8) && tid < RNL_PAIRS) {
        float2 sum = make_float2(0.f, 0.f);
#pragma unroll
        for (int q = 0; q < RNL_KWARPS; ++q) {
            const float2 v = *reinterpret_cast<const float2*>(spart + (q * NL_BM + prow) * SLICE + (pcol - c0));
            sum.x += v.x;
            sum.y += v.y;
        }
        const NlPair<T> p{from_f32<T>((sum.x + res[0]) + pbias[0]), from_f32<T>((sum.y + res[1]) + pbias[1])};
#pragma unroll
        for (int q = 0; q < RNL_SPLIT; ++q)
            *reinterpret_cast<NlPair<T>*>(((MODE & 1) ? sa : cg::this_cluster().map_shared_rank(sa, q)) + prow * LDS + pcol) = p;
        if (m0 + prow < M) *reinterpret_cast<NlPair<T>*>(x1 + (size_t)(m0 + prow) * K + pcol) = p;
    }
    // Every rank's stores into this CTA's rows are visible after the barrier (release / acquire
    // at cluster scope); after it no CTA touches another's shared memory, so each may exit freely.
    if (MODE & 8) mbar_wait(smem_u32(&x1_bar));
    else if (MODE & 2) __syncthreads();
    else cg::this_cluster().sync();

    // 4. One warp per row, in place: the LayerNorm kernel's own row code.
    if (warp < NL_BM) {
        uint4* row = reinterpret_cast<uint4*>(sa + warp * LDS);
        layer_norm_warp_row<CHUNKS, T>(row, row, wraw, braw, VECS, K, eps, lane);
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    if (warp >= MMA_WARPS) return;

    // 5. A 16 × 32 slice of the tile per warp, then the epilogue.
    float acc[4][4] = {};
    nl_warp_mma_16x32<T, K, LDS>(acc, sa + wm * 16 * LDS, sb + wn * 32 * LDS);
    nl_store_tile<T, GELU>(acc, bias_f, y, m0 + wm * 16, n0 + wn * 32, M, N);
}

template <int MODE>
__global__ void __cluster_dims__(6, 1, 1) __launch_bounds__(NL_WARPS * 32)
    rnl_mode(const __half* o, const __half* wp, const __half* bp, const __half* r, const __half* ln_w,
             const __half* ln_b, const __half* w, const __half* bias, __half* x1, __half* y, int M, int Nn, float eps) {
    rnl_mode_tile<__half, C, true, MODE>(o, wp, bp, r, ln_w, ln_b, w, bias, x1, y, M, Nn, eps);
}

static void* drandom(size_t n, unsigned seed, float scale, float offset = 0.f) {
    std::vector<__half> h(n);
    unsigned s = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; ++i) {
        s = s * 1664525u + 1013904223u;
        h[i] = __float2half(offset + scale * (((s >> 8) & 0xffff) / 32768.f - 1.f));
    }
    void* p = dalloc(n * 2);
    CK(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice));
    return p;
}

static float max_diff(const void* a, const void* b, size_t n) {
    std::vector<__half> x(n), y(n);
    CK(cudaMemcpy(x.data(), a, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(y.data(), b, n * 2, cudaMemcpyDeviceToHost));
    float m = 0.f;
    for (size_t i = 0; i < n; ++i) {
        const float d = fabsf(__half2float(x[i]) - __half2float(y[i]));
        m = std::isfinite(d) ? fmaxf(m, d) : INFINITY;
    }
    return m;
}

int main() {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cublasLtHandle_t lt;
    LT(cublasLtCreate(&lt));
    const size_t ws_bytes = 32 << 20;
    void* ws = dalloc(ws_bytes);
    const int nl_smem = (NL_BM + NL_BN) * LDS * 2, rnl_smem = (2 * NL_BM + NL_BN + 32) * LDS * 2 + 6 * NL_BM * 32 * 4,
              flat_smem = (2 * NL_BM + NL_BN + C) * LDS * 2;
    CK(cudaFuncSetAttribute(fastpath_norm_linear_f16_c192_gelu, cudaFuncAttributeMaxDynamicSharedMemorySize, nl_smem));
    CK(cudaFuncSetAttribute(nl_clustered, cudaFuncAttributeMaxDynamicSharedMemorySize, nl_smem));
    CK(cudaFuncSetAttribute(fastpath_residual_norm_linear_f16_c192_gelu, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            rnl_smem));
    CK(cudaFuncSetAttribute(rnl_flat, cudaFuncAttributeMaxDynamicSharedMemorySize, flat_smem));
    CK(cudaFuncSetAttribute(rnl_mode<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, rnl_smem));
    CK(cudaFuncSetAttribute(rnl_mode<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, rnl_smem));
    CK(cudaFuncSetAttribute(rnl_mode<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, rnl_smem));
    CK(cudaFuncSetAttribute(rnl_mode<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, rnl_smem));
    CK(cudaFuncSetAttribute(rnl_mode<7>, cudaFuncAttributeMaxDynamicSharedMemorySize, rnl_smem));
    CK(cudaFuncSetAttribute(rnl_mode<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, rnl_smem));
    printf("%s, %d SMs; us per launch (or per pair for sep), median of %d replays of %d-launch graph chains\n", p.name,
           p.multiProcessorCount, REPS, NODES);
    // RNL_CHECK_ONLY=1: the checks alone (one launch of each kernel), for compute-sanitizer.
    const bool check_only = getenv("RNL_CHECK_ONLY") != nullptr;
    for (int M : {197, 65}) {
        const float eps = 1e-6f;
        __half* o = (__half*)drandom((size_t)M * C, 1, 1.f);
        __half* r = (__half*)drandom((size_t)M * C, 2, 3.f, 0.5f);
        __half* wp = (__half*)drandom((size_t)C * C, 3, 0.07f);
        __half* bp = (__half*)drandom(C, 4, 0.2f);
        __half* lnw = (__half*)drandom(C, 5, 0.3f, 1.f);
        __half* lnb = (__half*)drandom(C, 6, 0.2f);
        __half* w = (__half*)drandom((size_t)N * C, 7, 0.07f);
        __half* b = (__half*)drandom(N, 8, 0.2f);
        __half *x1a = (__half*)dalloc((size_t)M * C * 2), *ya = (__half*)dalloc((size_t)M * N * 2);
        __half *x1b = (__half*)dalloc((size_t)M * C * 2), *yb = (__half*)dalloc((size_t)M * N * 2);
        Gemm proj = make_gemm(lt, M, C, C, wp, bp, ws_bytes);
        const dim3 grid(N / NL_BN, (M + NL_BM - 1) / NL_BM);
        auto sep = [&] {
            run_gemm(lt, proj, o, x1a, r, ws, ws_bytes, s);
            fastpath_norm_linear_f16_c192_gelu<<<grid, NL_WARPS * 32, nl_smem, s>>>(x1a, lnw, lnb, w, b, ya, M, N, eps);
        };
        auto projo = [&] { run_gemm(lt, proj, o, x1a, r, ws, ws_bytes, s); };
        auto nl = [&] {
            fastpath_norm_linear_f16_c192_gelu<<<grid, NL_WARPS * 32, nl_smem, s>>>(x1a, lnw, lnb, w, b, ya, M, N, eps);
        };
        auto nlc = [&] { nl_clustered<<<grid, NL_WARPS * 32, nl_smem, s>>>(x1a, lnw, lnb, w, b, ya, M, N, eps); };
        auto rnl = [&] {
            fastpath_residual_norm_linear_f16_c192_gelu<<<grid, NL_WARPS * 32, rnl_smem, s>>>(
                o, wp, bp, r, lnw, lnb, w, b, x1b, yb, M, N, eps);
        };
        auto flat = [&] {
            rnl_flat<<<grid, NL_WARPS * 32, flat_smem, s>>>(o, wp, bp, r, lnw, lnb, w, b, x1b, yb, M, N, eps);
        };
        sep();
        CK(cudaMemsetAsync(x1b, 0xff, (size_t)M * C * 2, s));
        CK(cudaMemsetAsync(yb, 0xff, (size_t)M * N * 2, s));
        rnl();
        CK(cudaStreamSynchronize(s));
        CK(cudaGetLastError());
        printf("check M %d rnl: x1 max |diff| %g, y %g\n", M, max_diff(x1a, x1b, (size_t)M * C),
               max_diff(ya, yb, (size_t)M * N));
        CK(cudaMemsetAsync(x1b, 0xff, (size_t)M * C * 2, s));
        CK(cudaMemsetAsync(yb, 0xff, (size_t)M * N * 2, s));
        flat();
        CK(cudaStreamSynchronize(s));
        CK(cudaGetLastError());
        printf("check M %d rnl_flat: x1 max |diff| %g, y %g\n", M, max_diff(x1a, x1b, (size_t)M * C),
               max_diff(ya, yb, (size_t)M * N));
        CK(cudaMemsetAsync(x1b, 0xff, (size_t)M * C * 2, s));
        CK(cudaMemsetAsync(yb, 0xff, (size_t)M * N * 2, s));
        rnl_mode<8><<<grid, NL_WARPS * 32, rnl_smem, s>>>(o, wp, bp, r, lnw, lnb, w, b, x1b, yb, M, N, eps);
        CK(cudaStreamSynchronize(s));
        CK(cudaGetLastError());
        printf("check M %d rnl st.async: x1 max |diff| %g, y %g\n", M, max_diff(x1a, x1b, (size_t)M * C),
               max_diff(ya, yb, (size_t)M * N));
        for (int round = 0; round < (check_only ? 0 : 2); ++round) {
            const double t_sep = graph_us_per_call(s, NODES / 2, REPS, sep);
            const double t_proj = graph_us_per_call(s, NODES, REPS, projo);
            const double t_nl = graph_us_per_call(s, NODES, REPS, nl);
            const double t_nlc = graph_us_per_call(s, NODES, REPS, nlc);
            const double t_rnl = graph_us_per_call(s, NODES, REPS, rnl);
            const double t_flat = graph_us_per_call(s, NODES, REPS, flat);
            printf("M %d round %d: sep %.2f | proj %.2f nl %.2f | nl_cl %.2f rnl %.2f rnl_flat %.2f\n", M, round,
                   t_sep, t_proj, t_nl, t_nlc, t_rnl, t_flat);
            auto mode = [&](auto kernel) {
                return graph_us_per_call(s, NODES, REPS, [&] {
                    kernel<<<grid, NL_WARPS * 32, rnl_smem, s>>>(o, wp, bp, r, lnw, lnb, w, b, x1b, yb, M, N, eps);
                });
            };
            printf("M %d round %d: rnl breakdown (wrong results but for 0): no DSMEM %.2f | no DSMEM, no cluster "
                   "barrier %.2f | no proj MMA %.2f | none of the three %.2f\n",
                   M, round, mode(rnl_mode<1>), mode(rnl_mode<3>), mode(rnl_mode<4>), mode(rnl_mode<7>));
            printf("M %d round %d: rnl with st.async + mbarrier (MODE 8) %.2f, plain %.2f\n", M, round, mode(rnl_mode<8>),
                   mode(rnl_mode<0>));
        }
    }
    // The block's other boundary: fc2 + residual (K = 768) in front of the next block's norm1 +
    // qkv (N = 576, 96-column tiles), against cuBLASLt's fc2 then norm_linear.
    {
        constexpr int KF = 4 * C, NQ = 3 * C, BNQ = 96, KWQ = 12;
        const int k768_smem = ((NL_BM + BNQ) * LDS + (NL_BM + 32) * (KF + 8)) * 2 + KWQ * NL_BM * 32 * 4;
        CK(cudaFuncSetAttribute(fastpath_residual_norm_linear_f16_c192_k768,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, k768_smem));
        CK(cudaFuncSetAttribute(fastpath_norm_linear_f16_c192, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                nl_smem));
        for (int M : {197, 65}) {
            const float eps = 1e-6f;
            __half* h = (__half*)drandom((size_t)M * KF, 21, 1.f);
            __half* r = (__half*)drandom((size_t)M * C, 22, 3.f, 0.5f);
            __half* w2 = (__half*)drandom((size_t)C * KF, 23, 0.036f);
            __half* b2 = (__half*)drandom(C, 24, 0.2f);
            __half* lnw = (__half*)drandom(C, 25, 0.3f, 1.f);
            __half* lnb = (__half*)drandom(C, 26, 0.2f);
            __half* wq = (__half*)drandom((size_t)NQ * C, 27, 0.07f);
            __half* bq = (__half*)drandom(NQ, 28, 0.2f);
            __half *x2a = (__half*)dalloc((size_t)M * C * 2), *qa = (__half*)dalloc((size_t)M * NQ * 2);
            __half *x2b = (__half*)dalloc((size_t)M * C * 2), *qb = (__half*)dalloc((size_t)M * NQ * 2);
            Gemm fc2 = make_gemm(lt, M, C, KF, w2, b2, ws_bytes);
            const dim3 gq((NQ + NL_BN - 1) / NL_BN, (M + NL_BM - 1) / NL_BM), g6(6, (M + NL_BM - 1) / NL_BM);
            auto sep = [&] {
                run_gemm(lt, fc2, h, x2a, r, ws, ws_bytes, s);
                fastpath_norm_linear_f16_c192<<<gq, NL_WARPS * 32, nl_smem, s>>>(x2a, lnw, lnb, wq, bq, qa, M, NQ, eps);
            };
            auto fc2o = [&] { run_gemm(lt, fc2, h, x2a, r, ws, ws_bytes, s); };
            auto nlq = [&] {
                fastpath_norm_linear_f16_c192<<<gq, NL_WARPS * 32, nl_smem, s>>>(x2a, lnw, lnb, wq, bq, qa, M, NQ, eps);
            };
            auto fused = [&] {
                fastpath_residual_norm_linear_f16_c192_k768<<<g6, NL_WARPS * 32, k768_smem, s>>>(
                    h, w2, b2, r, lnw, lnb, wq, bq, x2b, qb, M, NQ, eps);
            };
            sep();
            CK(cudaMemsetAsync(x2b, 0xff, (size_t)M * C * 2, s));
            CK(cudaMemsetAsync(qb, 0xff, (size_t)M * NQ * 2, s));
            fused();
            CK(cudaStreamSynchronize(s));
            CK(cudaGetLastError());
            printf("check M %d fc2 -> norm1 + qkv fused: x2 max |diff| %g, qkv %g\n", M,
                   max_diff(x2a, x2b, (size_t)M * C), max_diff(qa, qb, (size_t)M * NQ));
            for (int round = 0; round < (check_only ? 0 : 2); ++round) {
                printf("M %d round %d: fc2 + norm_linear(qkv) %.2f | fc2 %.2f norm_linear(qkv) %.2f | fused %.2f\n", M,
                       round, graph_us_per_call(s, NODES / 2, REPS, sep), graph_us_per_call(s, NODES, REPS, fc2o),
                       graph_us_per_call(s, NODES, REPS, nlq), graph_us_per_call(s, NODES, REPS, fused));
            }
        }
    }
    return 0;
}
