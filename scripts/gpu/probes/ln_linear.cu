// Lever 58's probe: a LayerNorm fused into the prologue of the GEMM that reads it (qkv after
// norm1, fc1 + GELU after norm2), for the few-hundred-row problems of batch 1, against what the
// model's graph runs today (our LayerNorm kernel, cuBLASLt's GEMM with the bias epilogue, our
// GELU kernel), in a graph chain. The fused kernel: one CTA per BM x BN output tile; its BM input
// rows (whole, K = C) and its BN weight rows land in shared memory by cp.async, the rows are
// normalised in place there by LNW warps (the arithmetic and lane order of our LayerNorm kernel,
// so the normalised rows are its output bit for bit) while the weight rows are still arriving,
// then mma.sync m16n8k16 (f32 accumulation) over K, bias (+ GELU) in registers, f16 store.
// Checked against the separate kernels' output on random data with the output poisoned first
// (max |difference| printed: 0 in every run so far), then timed: each problem alone (NODES
// dependent launches in one graph), the fused qkv kernel's cost broken down (without its
// LayerNorm, without its MMAs, loads and store alone, no shuffles), and a DeiT-S and a DeiT-T
// block with the fused kernels (5 launches) against the model's 8, three rounds alternated.
// Results and reading: docs/LEVERS.md, lever 58. Run on the GPU from the repo root:
//   nvcc -O3 -std=c++17 -arch=sm_90a -I candle-ragged/kernels -o /tmp/ln_linear scripts/gpu/probes/ln_linear.cu \
//     -lcublasLt -lcuda
//   /tmp/ln_linear FASTPATH_PTX RAGGED_PTX        (the .ptx files of a cargo build with --features cuda)
//   ncu --kernel-name regex:ln_linear /tmp/ln_linear FASTPATH_PTX RAGGED_PTX ncu   (one eager launch
//   of the whole kernel, of loads + store only, and of the LayerNorm without its MMAs)
//   LN_LINEAR_MC_ONLY=1 /tmp/ln_linear FASTPATH_PTX RAGGED_PTX   (lever 60: ln_linear_mc, the
//   weight tile multicast across a cluster of row tiles, against the plain kernel and the
//   separate ones; it assumes N is a multiple of 128)
#include <cuda_fp16.h>

#include <cmath>
#include <cooperative_groups.h>

// The kernels' shared pieces (cp.async, ldmatrix, mma.sync, the LayerNorm row, the warp's
// 16 x 32 MMA tile, the GELU) from the model's own kernel file.
#include "../../../candle-fastpath/kernels/fastpath.cu"
#include "probe_common.cuh"

constexpr int NODES = 96, REPS = 200;

// MODE (cost breakdown of the probe): 0 the kernel; 1 no LayerNorm (raw rows into the MMAs);
// 2 no MMAs (zeros into the epilogue); 3 neither (loads, bias, store); 4 as 2 with each lane's
// statistics its own (no shuffle reductions).
// LNW: warps of the CTA for the loads and the LayerNorm (at least the MMA warps; the rest leave
// before the MMAs). The LayerNorm is a dependent chain per row, so rows per warp set its time.
__host__ __device__ constexpr int ln_linear_threads(int BM, int BN, int LNW) {
    return 32 * ((BM / 16) * (BN / 32) > LNW ? (BM / 16) * (BN / 32) : LNW);
}

template <int K, int BM, int BN, bool GELU, int MODE = 0, int LNW = 4>
__global__ void __launch_bounds__(ln_linear_threads(BM, BN, LNW))
    ln_linear(const __half* __restrict__ x, const __half* __restrict__ lnw, const __half* __restrict__ lnb,
              const __half* __restrict__ w, const __half* __restrict__ bias, __half* __restrict__ y, int M, int N,
              float eps) {
    constexpr int WARPS_N = BN / 32, MMA_WARPS = (BM / 16) * WARPS_N;
    constexpr int THREADS = ln_linear_threads(BM, BN, LNW), WARPS = THREADS / 32;
    constexpr int LDS = K + 8;  // smem row stride in halves
    constexpr int VECS = K / 8;  // 16-byte vectors per row
    constexpr int CHUNKS = (VECS + 31) / 32;
    extern __shared__ __align__(16) unsigned char smem[];
    __half* sa = reinterpret_cast<__half*>(smem);
    __half* sb = sa + BM * LDS;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

    // Input rows first (the LayerNorm waits on them), then the weight rows.
    for (int i = tid; i < BM * VECS; i += THREADS) {
        const int r = i / VECS, c = i % VECS;
        const bool ok = m0 + r < M;
        nl_cp_async16(sa + r * LDS + c * 8, x + (size_t)(ok ? m0 + r : 0) * K + c * 8, ok);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    for (int i = tid; i < BN * VECS; i += THREADS) {
        const int r = i / VECS, c = i % VECS;
        const bool ok = n0 + r < N;
        nl_cp_async16(sb + r * LDS + c * 8, w + (size_t)(ok ? n0 + r : 0) * K + c * 8, ok);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    // LayerNorm parameters of this lane's chunks, and this thread's bias pair, beside the loads.
    uint4 wraw[CHUNKS], braw[CHUNKS];
    layer_norm_params<CHUNKS>(lnw, lnb, wraw, braw, VECS, lane);
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    float bias_f[4][2];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int col = n0 + wn * 32 + j * 8 + (lane % 4) * 2;
        bias_f[j][0] = col < N ? __half2float(bias[col]) : 0.f;
        bias_f[j][1] = col + 1 < N ? __half2float(bias[col + 1]) : 0.f;
    }
    asm volatile("cp.async.wait_group 1;" ::: "memory");
    __syncthreads();
    // Normalise the tile's rows in place: one warp per row with the lane order of
    // layer_norm_rows (so the result is its bit for bit), G rows of a warp at once so that their
    // shuffle reductions overlap (a warp walking its rows one by one was most of the kernel).
    constexpr int ROWS_PER_WARP = BM / WARPS, G = ROWS_PER_WARP < 4 ? ROWS_PER_WARP : 4;
    if (MODE == 0 || MODE == 2 || MODE == 4) {
        for (int r0 = warp * G; r0 < BM; r0 += WARPS * G) {
            float v[G][CHUNKS][8];
            float sum[G], mean[G], sq[G], rstd[G];
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const uint4* row = reinterpret_cast<const uint4*>(sa + (r0 + g) * LDS);
                sum[g] = 0.f;
#pragma unroll
                for (int t = 0; t < CHUNKS; ++t) {
                    const int c = lane + 32 * t;
                    if (c < VECS) {
                        const uint4 raw = row[c];
                        const __half* e = reinterpret_cast<const __half*>(&raw);
#pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            v[g][t][j] = __half2float(e[j]);
                            sum[g] += v[g][t][j];
                        }
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < G; ++g) mean[g] = (MODE == 4 ? sum[g] : warp_sum(sum[g])) / (float)K;
#pragma unroll
            for (int g = 0; g < G; ++g) {
                sq[g] = 0.f;
#pragma unroll
                for (int t = 0; t < CHUNKS; ++t) {
                    if (lane + 32 * t < VECS) {
#pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            const float d = v[g][t][j] - mean[g];
                            sq[g] += d * d;
                        }
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < G; ++g) rstd[g] = 1.0f / sqrtf((MODE == 4 ? sq[g] : warp_sum(sq[g])) / (float)K + eps);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                uint4* row = reinterpret_cast<uint4*>(sa + (r0 + g) * LDS);
#pragma unroll
                for (int t = 0; t < CHUNKS; ++t) {
                    const int c = lane + 32 * t;
                    if (c < VECS) {
                        uint4 out;
                        const __half* we = reinterpret_cast<const __half*>(&wraw[t]);
                        const __half* be = reinterpret_cast<const __half*>(&braw[t]);
                        __half* oe = reinterpret_cast<__half*>(&out);
#pragma unroll
                        for (int j = 0; j < 8; ++j)
                            oe[j] = __float2half((v[g][t][j] - mean[g]) * rstd[g] * __half2float(we[j]) +
                                                 __half2float(be[j]));
                        row[c] = out;
                    }
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    if (warp >= MMA_WARPS) return;

    float acc[4][4] = {};
    if (MODE != 2 && MODE != 3 && MODE != 4) nl_warp_mma_16x32<__half, K, LDS>(acc, sa + wm * 16 * LDS, sb + wn * 32 * LDS);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int col = n0 + wn * 32 + j * 8 + (lane % 4) * 2;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = m0 + wm * 16 + lane / 4 + h * 8;
            float v0 = acc[j][2 * h] + bias_f[j][0], v1 = acc[j][2 * h + 1] + bias_f[j][1];
            if (GELU) {
                // The model's GELU pass reads fc1's f16 output: round first, as it does.
                v0 = gelu_phi(__half2float(__float2half(v0)));
                v1 = gelu_phi(__half2float(__float2half(v1)));
            }
            if (row < M && col + 1 < N) {
                *reinterpret_cast<__half2*>(y + (size_t)row * N + col) = __floats2half2_rn(v0, v1);
            } else if (row < M && col < N) {
                y[(size_t)row * N + col] = __float2half(v0);
            }
        }
    }
}

__global__ void fill_random(__half* p, size_t n, unsigned seed, float scale, float offset) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 13;
        h *= 0x5bd1e995u;
        h ^= h >> 15;
        const float u = (h & 0xffffff) / 16777216.0f - 0.5f;  // [-0.5, 0.5)
        p[i] = __float2half(offset + scale * u);
    }
}

static void* drandom(size_t halves, unsigned seed, float scale, float offset = 0.f) {
    void* p = dalloc(halves * 2);
    fill_random<<<256, 256>>>((__half*)p, halves, seed, scale, offset);
    CK(cudaGetLastError());
    return p;
}

struct Ctx {
    cudaStream_t s;
    CUstream cs;
    cublasLtHandle_t lt;
    void* ws;
    size_t ws_bytes;
    CUfunction ln[3], gelu;  // ln[i]: the size class for C = 192 << i
};

template <int K, int BM, int BN, bool GELU, int MODE = 0, int LNW = 4>
static void launch_fused(const Ctx& c, const void* x, const void* lnw, const void* lnb, const void* w,
                         const void* b, void* y, int M, int N) {
    constexpr int threads = ln_linear_threads(BM, BN, LNW);
    constexpr int smem = (BM + BN) * (K + 8) * 2;
    static bool configured = false;
    if (!configured) {
        CK(cudaFuncSetAttribute(ln_linear<K, BM, BN, GELU, MODE, LNW>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        configured = true;
    }
    const dim3 grid((N + BN - 1) / BN, (M + BM - 1) / BM);
    ln_linear<K, BM, BN, GELU, MODE, LNW><<<grid, threads, smem, c.s>>>((const __half*)x, (const __half*)lnw,
                                                              (const __half*)lnb, (const __half*)w,
                                                              (const __half*)b, (__half*)y, M, N, 1e-6f);
}

static void run_ln(const Ctx& c, int ci, const void* x, const void* lnw, const void* lnb, void* y, unsigned rows,
                   unsigned C) {
    float eps = 1e-6f;
    void* args[] = {&x, &lnw, &lnb, &y, &rows, &C, &eps};
    CU(cuLaunchKernel(c.ln[ci], (rows + 7) / 8, 1, 1, 256, 1, 1, 0, c.cs, args, nullptr));
}

static void run_gelu(const Ctx& c, void* h, unsigned long long n) {
    void* args[] = {&h, &n};
    const unsigned blocks = std::min<unsigned long long>((n / 8 + 255) / 256, 132 * 16);
    CU(cuLaunchKernel(c.gelu, blocks, 1, 1, 256, 1, 1, 0, c.cs, args, nullptr));
}

static void run_gemm(const Ctx& c, const Gemm& g, const void* in, void* out, const void* res) {
    run_gemm(c.lt, g, in, out, res, c.ws, c.ws_bytes, c.s);
}

static double max_abs_diff(const void* a, const void* b, size_t n, double* max_ref) {
    std::vector<__half> ha(n), hb(n);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(ha.data(), a, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb.data(), b, n * 2, cudaMemcpyDeviceToHost));
    double m = 0, r = 0;
    for (size_t i = 0; i < n; ++i) {
        const double x = __half2float(ha[i]), y = __half2float(hb[i]);
        if (!std::isfinite(x) || !std::isfinite(y)) return INFINITY;
        m = std::max(m, std::fabs(x - y));
        r = std::max(r, std::fabs(y));
    }
    *max_ref = r;
    return m;
}

// One (C, M) problem pair: norm + qkv, norm + fc1 + GELU, separate and fused in each tiling.
// One (C, M) problem pair on random data: the rows and LayerNorm parameters, qkv's and fc1's
// weights, the separate kernels' outputs (yq, h) and a fused kernel's (yq2, h2); the separate
// chains, and the check of a fused kernel's outputs against theirs.
template <int K>
struct Problem {
    const Ctx& c;
    const int M, N_qkv = 3 * K, N_fc1 = 4 * K, ci = K == 192 ? 0 : K == 384 ? 1 : 2;
    void* x = drandom((size_t)M * K, 11, 4.f, 0.3f);
    void* lnw = drandom(K, 12, 0.4f, 1.f);
    void* lnb = drandom(K, 13, 0.2f);
    void* wq = drandom((size_t)N_qkv * K, 14, 0.1f);
    void* bq = drandom(N_qkv, 15, 0.2f);
    void* w1 = drandom((size_t)N_fc1 * K, 16, 0.1f);
    void* b1 = drandom(N_fc1, 17, 0.2f);
    void* xn = dalloc((size_t)M * K * 2);
    void* yq = dalloc((size_t)M * N_qkv * 2);
    void* yq2 = dalloc((size_t)M * N_qkv * 2);
    void* h = dalloc((size_t)M * N_fc1 * 2);
    void* h2 = dalloc((size_t)M * N_fc1 * 2);
    const Gemm gq = make_gemm(c.lt, M, N_qkv, K, wq, bq, c.ws_bytes);
    const Gemm g1 = make_gemm(c.lt, M, N_fc1, K, w1, b1, c.ws_bytes);

    Problem(const Ctx& ctx, int rows) : c(ctx), M(rows) {}
    ~Problem() {
        for (void* p : {x, lnw, lnb, wq, bq, w1, b1, xn, yq, yq2, h, h2}) CK(cudaFree(p));
    }
    void sep_qkv() const {
        run_ln(c, ci, x, lnw, lnb, xn, M, K);
        run_gemm(c, gq, xn, yq, nullptr);
    }
    void sep_fc1() const {
        run_ln(c, ci, x, lnw, lnb, xn, M, K);
        run_gemm(c, g1, xn, h, nullptr);
        run_gelu(c, h, (unsigned long long)M * N_fc1);
    }
    // Poisons the fused outputs, runs both chains and `fused_qkv` / `fused_fc1`, and prints the
    // largest differences under `label`.
    void check(const char* label, const std::function<void()>& fused_qkv, const std::function<void()>& fused_fc1) {
        CK(cudaMemset(yq2, 0xff, (size_t)M * N_qkv * 2));  // NaN: every output must be written
        CK(cudaMemset(h2, 0xff, (size_t)M * N_fc1 * 2));
        sep_qkv();
        sep_fc1();
        fused_qkv();
        fused_fc1();
        double rq, r1;
        const double dq = max_abs_diff(yq2, yq, (size_t)M * N_qkv, &rq);
        const double d1 = max_abs_diff(h2, h, (size_t)M * N_fc1, &r1);
        printf("check C %d M %4d %s: qkv max |fused - separate| %.3g (max |separate| %.3g); fc1+GELU %.3g (%.3g)\n",
               K, M, label, dq, rq, d1, r1);
    }
};

template <int K, int BM, int BN, int LNW>
static void problem(const Ctx& c, int M, const char* tiling, bool check) {
    Problem<K> pr(c, M);
    const int N_qkv = pr.N_qkv, N_fc1 = pr.N_fc1;
    auto sep_qkv = [&] { pr.sep_qkv(); };
    auto sep_fc1 = [&] { pr.sep_fc1(); };
    auto fused_qkv = [&] { launch_fused<K, BM, BN, false, 0, LNW>(c, pr.x, pr.lnw, pr.lnb, pr.wq, pr.bq, pr.yq2, M, N_qkv); };
    auto fused_fc1 = [&] { launch_fused<K, BM, BN, true, 0, LNW>(c, pr.x, pr.lnw, pr.lnb, pr.w1, pr.b1, pr.h2, M, N_fc1); };
    if (check) pr.check(tiling, fused_qkv, fused_fc1);
    const double t_sep_q = graph_us_per_call(c.s, NODES / 2, REPS, sep_qkv);
    const double t_fus_q = graph_us_per_call(c.s, NODES, REPS, fused_qkv);
    const double t_sep_1 = graph_us_per_call(c.s, NODES / 3, REPS, sep_fc1);
    const double t_fus_1 = graph_us_per_call(c.s, NODES, REPS, fused_fc1);
    printf("C %d M %4d %-8s norm+qkv: separate %.2f, fused %.2f (%.2fx) | norm+fc1+GELU: separate %.2f, fused %.2f (%.2fx)\n",
           K, M, tiling, t_sep_q, t_fus_q, t_sep_q / t_fus_q, t_sep_1, t_fus_1, t_sep_1 / t_fus_1);
    // Where the fused qkv kernel's time goes: without its LayerNorm, without its MMAs, neither.
    const double t_no_ln = graph_us_per_call(c.s, NODES, REPS, [&] {
        launch_fused<K, BM, BN, false, 1, LNW>(c, pr.x, pr.lnw, pr.lnb, pr.wq, pr.bq, pr.yq2, M, N_qkv);
    });
    const double t_no_mma = graph_us_per_call(c.s, NODES, REPS, [&] {
        launch_fused<K, BM, BN, false, 2, LNW>(c, pr.x, pr.lnw, pr.lnb, pr.wq, pr.bq, pr.yq2, M, N_qkv);
    });
    const double t_loads = graph_us_per_call(c.s, NODES, REPS, [&] {
        launch_fused<K, BM, BN, false, 3, LNW>(c, pr.x, pr.lnw, pr.lnb, pr.wq, pr.bq, pr.yq2, M, N_qkv);
    });
    const double t_no_shfl = graph_us_per_call(c.s, NODES, REPS, [&] {
        launch_fused<K, BM, BN, false, 4, LNW>(c, pr.x, pr.lnw, pr.lnb, pr.wq, pr.bq, pr.yq2, M, N_qkv);
    });
    printf("C %d M %4d %-8s fused qkv breakdown: whole %.2f, no LayerNorm %.2f, no MMA %.2f, loads + store only %.2f, "
           "no MMA and no shuffles %.2f\n",
           K, M, tiling, t_fus_q, t_no_ln, t_no_mma, t_loads, t_no_shfl);
}

template <int K>
static void problems(const Ctx& c, int M, bool check) {
    problem<K, 32, 64, 4>(c, M, "32x64w4", check);
    problem<K, 32, 64, 16>(c, M, "32x64w16", check);
    problem<K, 16, 128, 4>(c, M, "16x128w4", check);
    problem<K, 16, 128, 8>(c, M, "16x128w8", check);
    problem<K, 16, 128, 16>(c, M, "16x128w16", check);
    problem<K, 16, 64, 8>(c, M, "16x64w8", check);
}

// The same kernel with the weight tile shared by a cluster of CM CTAs along M (row tiles that
// need the same 128 weight rows): each CTA fetches every CM-th weight row by a 1-D bulk copy
// multicast to the whole cluster, so L2 serves each weight row once per cluster instead of once
// per CTA; completion is counted on each CTA's own mbarrier. 16 × 128 tiles, 16 warps, N a
// multiple of 128. Launched with cudaLaunchKernelEx and a cluster dimension of CM along y.
namespace cg = cooperative_groups;
template <int K, bool GELU, int CM>
__global__ void __launch_bounds__(512) ln_linear_mc(const __half* __restrict__ x, const __half* __restrict__ lnw,
                                                    const __half* __restrict__ lnb, const __half* __restrict__ w,
                                                    const __half* __restrict__ bias, __half* __restrict__ y, int M,
                                                    int N, float eps) {
    constexpr int BM = 16, BN = 128, THREADS = 512, WARPS_N = BN / 32;
    constexpr int LDS = K + 8, VECS = K / 8, CHUNKS = (VECS + 31) / 32;
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bar;
    __half* sa = reinterpret_cast<__half*>(smem);
    __half* sb = sa + BM * LDS;
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank();
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const unsigned bar_addr = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
    if (tid == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_addr));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        // Every byte of the weight tile lands here, from this CTA's copies and the others'.
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_addr), "r"(BN * K * 2)
                     : "memory");
    }
    // Every CTA's barrier is initialised and expecting before any copy targets it.
    cluster.sync();
    for (int i = rank + CM * tid; i < BN; i += CM * THREADS) {
        const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(sb + i * LDS));
        const unsigned short mask = (unsigned short)((1u << CM) - 1);
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;" ::"r"(dst),
            "l"(w + (size_t)(n0 + i) * K), "r"(K * 2), "r"(bar_addr), "h"(mask)
            : "memory");
    }
    for (int i = tid; i < BM * VECS; i += THREADS) {
        const int r = i / VECS, c = i % VECS;
        const bool ok = m0 + r < M;
        nl_cp_async16(sa + r * LDS + c * 8, x + (size_t)(ok ? m0 + r : 0) * K + c * 8, ok);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    uint4 wraw[CHUNKS], braw[CHUNKS];
    layer_norm_params<CHUNKS>(lnw, lnb, wraw, braw, VECS, lane);
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    float bias_f[4][2];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int col = n0 + wn * 32 + j * 8 + (lane % 4) * 2;
        bias_f[j][0] = __half2float(bias[col]);
        bias_f[j][1] = __half2float(bias[col + 1]);
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    if (warp < BM) {  // one warp per row, in place: the model's LayerNorm row code
        uint4* row = reinterpret_cast<uint4*>(sa + warp * LDS);
        layer_norm_warp_row<CHUNKS, __half>(row, row, wraw, braw, VECS, K, eps, lane);
    }
    // The weight tile: phase 0 of this CTA's barrier completes once all BN · K · 2 bytes landed.
    {
        unsigned done = 0;
        while (!done) {
            asm volatile(
                "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                : "=r"(done)
                : "r"(bar_addr)
                : "memory");
        }
    }
    __syncthreads();
    if (warp < (BM / 16) * WARPS_N) {
        float acc[4][4] = {};
        nl_warp_mma_16x32<__half, K, LDS>(acc, sa + wm * 16 * LDS, sb + wn * 32 * LDS);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = n0 + wn * 32 + j * 8 + (lane % 4) * 2;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + wm * 16 + lane / 4 + h * 8;
                float v0 = acc[j][2 * h] + bias_f[j][0], v1 = acc[j][2 * h + 1] + bias_f[j][1];
                if (GELU) {
                    v0 = gelu_phi(__half2float(__float2half(v0)));
                    v1 = gelu_phi(__half2float(__float2half(v1)));
                }
                if (row < M) *reinterpret_cast<__half2*>(y + (size_t)row * N + col) = __floats2half2_rn(v0, v1);
            }
        }
    }
    // No CTA leaves while a copy it issued may still be landing in another's shared memory.
    cluster.sync();
}

template <int K, bool GELU, int CM>
static void launch_mc(const Ctx& c, const void* x, const void* lnw, const void* lnb, const void* w, const void* b,
                      void* y, int M, int N) {
    constexpr int smem = (16 + 128) * (K + 8) * 2;
    static bool configured = false;
    if (!configured) {
        CK(cudaFuncSetAttribute(ln_linear_mc<K, GELU, CM>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        configured = true;
    }
    const int row_tiles = (M + 15) / 16;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(N / 128, (row_tiles + CM - 1) / CM * CM, 1);
    cfg.blockDim = dim3(512, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = c.s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 1;
    attr[0].val.clusterDim.y = CM;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, ln_linear_mc<K, GELU, CM>, (const __half*)x, (const __half*)lnw, (const __half*)lnb,
                          (const __half*)w, (const __half*)b, (__half*)y, M, N, 1e-6f));
}

// The multicast kernel against the separate kernels and the plain fused kernel (16 x 128, 16 warps).
template <int K, int CM>
static void problem_mc(const Ctx& c, int M) {
    Problem<K> pr(c, M);
    const int N_qkv = pr.N_qkv, N_fc1 = pr.N_fc1;
    auto sep_qkv = [&] { pr.sep_qkv(); };
    auto sep_fc1 = [&] { pr.sep_fc1(); };
    auto mc_qkv = [&] { launch_mc<K, false, CM>(c, pr.x, pr.lnw, pr.lnb, pr.wq, pr.bq, pr.yq2, M, N_qkv); };
    auto mc_fc1 = [&] { launch_mc<K, true, CM>(c, pr.x, pr.lnw, pr.lnb, pr.w1, pr.b1, pr.h2, M, N_fc1); };
    auto fu_qkv = [&] { launch_fused<K, 16, 128, false, 0, 16>(c, pr.x, pr.lnw, pr.lnb, pr.wq, pr.bq, pr.yq2, M, N_qkv); };
    auto fu_fc1 = [&] { launch_fused<K, 16, 128, true, 0, 16>(c, pr.x, pr.lnw, pr.lnb, pr.w1, pr.b1, pr.h2, M, N_fc1); };
    char label[32];
    snprintf(label, sizeof label, "multicast, cluster %d", CM);
    pr.check(label, mc_qkv, mc_fc1);
    for (int round = 0; round < 2; ++round) {
        const double s_q = graph_us_per_call(c.s, NODES / 2, REPS, sep_qkv);
        const double f_q = graph_us_per_call(c.s, NODES, REPS, fu_qkv);
        const double m_q = graph_us_per_call(c.s, NODES, REPS, mc_qkv);
        const double s_1 = graph_us_per_call(c.s, NODES / 3, REPS, sep_fc1);
        const double f_1 = graph_us_per_call(c.s, NODES, REPS, fu_fc1);
        const double m_1 = graph_us_per_call(c.s, NODES, REPS, mc_fc1);
        printf("C %d M %4d cluster %d round %d: norm+qkv separate %.2f, fused %.2f, multicast %.2f (%.2fx separate) | "
               "norm+fc1+GELU separate %.2f, fused %.2f, multicast %.2f (%.2fx)\n",
               K, M, CM, round, s_q, f_q, m_q, s_q / m_q, s_1, f_1, m_1, s_1 / m_1);
    }
}

// A DeiT block at batch 1 (C = 192: DeiT-T, 384: DeiT-S): the model's 8 launches against 5 with
// both norms fused (the attention launch as the resident plan gives it for DeiT-S).
template <int C>
static void block_probe(const Ctx& c, CUmodule ragged) {
    CUfunction attn;
    CU(cuModuleGetFunction(&attn, ragged, "ragged_attn_resident_f16_d64"));
    const int M = 197, H = C / 64, D = 64;
    const unsigned attn_smem = 2 * 208 * (D + 8) * 2 + 1 * 7 * (D / 2 + 4) * 32 * 4;
    CU(cuFuncSetAttribute(attn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, attn_smem));
    void* x = drandom((size_t)M * C, 21, 2.f);
    void* x2 = dalloc((size_t)M * C * 2);
    void* xn = dalloc((size_t)M * C * 2);
    void* qkv = dalloc((size_t)M * 3 * C * 2);
    void* o = dalloc((size_t)M * C * 2);
    void* h = dalloc((size_t)M * 4 * C * 2);
    void* lnw = drandom(C, 22, 0.2f, 1.f);
    void* lnb = drandom(C, 23, 0.1f);
    void* wq = drandom((size_t)3 * C * C, 24, 0.02f);
    void* wp = drandom((size_t)C * C, 25, 0.02f);
    void* w1 = drandom((size_t)4 * C * C, 26, 0.02f);
    void* w2 = drandom((size_t)4 * C * C, 27, 0.02f);
    void* bq = drandom(3 * C, 28, 0.02f);
    void* bp = drandom(C, 29, 0.02f);
    void* b1 = drandom(4 * C, 30, 0.02f);
    void* b2 = drandom(C, 31, 0.02f);
    unsigned* cu = (unsigned*)dalloc(8);
    const unsigned cu_host[2] = {0, (unsigned)M};
    CK(cudaMemcpy(cu, cu_host, 8, cudaMemcpyHostToDevice));
    const Gemm gq = make_gemm(c.lt, M, 3 * C, C, wq, bq, c.ws_bytes), gp = make_gemm(c.lt, M, C, C, wp, bp, c.ws_bytes),
               g1 = make_gemm(c.lt, M, 4 * C, C, w1, b1, c.ws_bytes),
               g2 = make_gemm(c.lt, M, C, 4 * C, w2, b2, c.ws_bytes);
    long long q_tok = 3 * C, q_head = D;
    int heads = H, uniform = M;
    float scale_log2 = 0.125f * 1.4426950408889634f;
    void* kp = (char*)qkv + C * 2;
    void* vp = (char*)qkv + 2 * C * 2;
    auto run_attn = [&] {
        void* args[] = {&qkv, &kp, &vp, &o, &cu, &q_tok, &q_head, &q_tok, &q_head, &q_tok, &q_head,
                        &heads, &scale_log2, &uniform};
        CU(cuLaunchKernel(attn, 13, H, 1, 32, 8, 1, attn_smem, c.cs, args, nullptr));
    };
    auto block8 = [&] {
        run_ln(c, C == 192 ? 0 : 1, x, lnw, lnb, xn, M, C);
        run_gemm(c, gq, xn, qkv, nullptr);
        run_attn();
        run_gemm(c, gp, o, x2, x);
        run_ln(c, C == 192 ? 0 : 1, x2, lnw, lnb, xn, M, C);
        run_gemm(c, g1, xn, h, nullptr);
        run_gelu(c, h, (unsigned long long)M * 4 * C);
        run_gemm(c, g2, h, x, x2);
    };
    auto block5 = [&] {
        launch_fused<C, 16, 128, false, 0, 16>(c, x, lnw, lnb, wq, bq, qkv, M, 3 * C);
        run_attn();
        run_gemm(c, gp, o, x2, x);
        launch_fused<C, 16, 128, true, 0, 16>(c, x2, lnw, lnb, w1, b1, h, M, 4 * C);
        run_gemm(c, g2, h, x, x2);
    };
    auto block5b = [&] {
        launch_fused<C, 32, 64, false, 0, 16>(c, x, lnw, lnb, wq, bq, qkv, M, 3 * C);
        run_attn();
        run_gemm(c, gp, o, x2, x);
        launch_fused<C, 32, 64, true, 0, 16>(c, x2, lnw, lnb, w1, b1, h, M, 4 * C);
        run_gemm(c, g2, h, x, x2);
    };
    // Three rounds, alternated, so that clock drift shows as spread rather than as a gain.
    for (int round = 0; round < 3; ++round) {
        const double t8 = graph_us_per_call(c.s, 12, REPS, block8);
        const double t5 = graph_us_per_call(c.s, 12, REPS, block5);
        const double t5b = graph_us_per_call(c.s, 12, REPS, block5b);
        printf("C %d block, batch 1, round %d: 8 launches %.2f us, 5 launches (fused 16x128w16) %.2f us (%.2fx), "
               "(fused 32x64w16) %.2f us (%.2fx)\n",
               C, round, t8, t5, t8 / t5, t5b, t8 / t5b);
    }
}

int main(int argc, char** argv) {
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: %s FASTPATH_PTX RAGGED_PTX [ncu]\n", argv[0]);
        return 2;
    }
    CK(cudaFree(0));
    CU(cuInit(0));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    CUmodule fast = load_ptx(argv[1]), ragged = load_ptx(argv[2]);
    Ctx c{};
    CU(cuModuleGetFunction(&c.ln[0], fast, "fastpath_layer_norm_f16_c1"));
    CU(cuModuleGetFunction(&c.ln[1], fast, "fastpath_layer_norm_f16_c2"));
    CU(cuModuleGetFunction(&c.ln[2], fast, "fastpath_layer_norm_f16_c4"));
    CU(cuModuleGetFunction(&c.gelu, fast, "fastpath_gelu_phi_f16"));
    CK(cudaStreamCreateWithFlags(&c.s, cudaStreamNonBlocking));
    c.cs = (CUstream)c.s;
    LT(cublasLtCreate(&c.lt));
    c.ws_bytes = 32 << 20;
    c.ws = dalloc(c.ws_bytes);
    printf("%s, %d SMs; us per launch or per chain, median of %d graph replays\n", p.name, p.multiProcessorCount,
           REPS);
    if (argc == 4) {  // one eager launch of each breakdown mode at DeiT-S's qkv shape, for ncu
        const int M = 197, K = 384, N = 3 * K;
        void* x = drandom((size_t)M * K, 11, 4.f, 0.3f);
        void* lnw = drandom(K, 12, 0.4f, 1.f);
        void* lnb = drandom(K, 13, 0.2f);
        void* w = drandom((size_t)N * K, 14, 0.1f);
        void* b = drandom(N, 15, 0.2f);
        void* y = dalloc((size_t)M * N * 2);
        launch_fused<384, 32, 64, false, 0>(c, x, lnw, lnb, w, b, y, M, N);
        launch_fused<384, 32, 64, false, 3>(c, x, lnw, lnb, w, b, y, M, N);
        launch_fused<384, 32, 64, false, 4>(c, x, lnw, lnb, w, b, y, M, N);
        CK(cudaDeviceSynchronize());
        return 0;
    }
    if (getenv("LN_LINEAR_MC_ONLY")) {  // lever 60's question alone: the multicast kernel
        for (int M : {197, 138}) {
            problem_mc<384, 2>(c, M);
            problem_mc<384, 4>(c, M);
        }
        problem_mc<192, 2>(c, 197);
        problem_mc<768, 2>(c, 197);
        problem_mc<768, 4>(c, 197);
        CK(cudaDeviceSynchronize());
        return 0;
    }
    for (int M : {197, 138}) problems<384>(c, M, M == 197);
    problems<192>(c, 197, true);
    problems<768>(c, 197, true);

    block_probe<384>(c, ragged);
    block_probe<192>(c, ragged);
    CK(cudaDeviceSynchronize());
    return 0;
}
