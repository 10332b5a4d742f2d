// Levers 61 and 62's probe: residual_norm_linear (a Linear and its residual add in front of the
// LayerNorm and the Linear after it, as one kernel: a cluster of six CTAs per 16-row tile
// splitting the front Linear's columns) against the two launches it replaces (cuBLASLt's Linear
// with the residual epilogue, then lever 58's norm_linear), at DeiT-T's shapes (C = 192), f16,
// for both of the kernel's forms:
//   proj -> norm2 -> fc1 + GELU (K = 192, N = 768, 128-column tiles; lever 61)
//   fc2 -> the next block's norm1 -> qkv (K = 768, N = 576, 96-column tiles; lever 62)
// Each form is checked first (x1 and y of the fused kernel, its outputs poisoned before, against
// the two launches': max |difference| printed), then timed, in µs per launch (per pair for the
// two launches) over 48-launch graph chains: the two launches, each alone, the fused kernel; for
// the proj form also norm_linear launched in clusters of 6 (what a cluster costs by itself).
// The variants lever 61 measured on the way (the projection in one warp, its phase breakdown,
// st.async + mbarrier instead of the cluster barrier, no cluster) are the patch
// docs/benchmarks/history/lever61-probe-variants.patch (it applies to this file as of that commit).
// Run on the GPU from the repo root:
//   nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -I candle-ragged/kernels -o /tmp/rnl scripts/gpu/probes/rnl.cu \
//     -lcublasLt -lcuda && /tmp/rnl
//   RNL_CHECK_ONLY=1 compute-sanitizer --tool racecheck /tmp/rnl   (the checks alone)
#include <cuda_fp16.h>

#include <cmath>

#include "../../../candle-fastpath/kernels/fastpath.cu"
#include "probe_common.cuh"

constexpr int C = 192, NODES = 48, REPS = 200;
constexpr int LDS = C + 8;

extern "C" __global__ void __cluster_dims__(6, 1, 1) __launch_bounds__(NL_WARPS * 32)
    nl_clustered(const __half* x, const __half* ln_w, const __half* ln_b, const __half* w, const __half* bias,
                 __half* y, int M, int Nn, float eps) {
    norm_linear_tile<__half, C, true>(x, ln_w, ln_b, w, bias, y, M, Nn, eps);
}

using NormLinearFn = void (*)(const __half*, const __half*, const __half*, const __half*, const __half*, __half*,
                              int, int, float);
using FusedFn = void (*)(const __half*, const __half*, const __half*, const __half*, const __half*, const __half*,
                         const __half*, const __half*, __half*, __half*, int, int, float);

struct Ctx {
    cudaStream_t s;
    cublasLtHandle_t lt;
    void* ws;
    size_t ws_bytes;
    bool check_only;
};

// One form at M rows: front Linear [C, KF] on o [M, KF] plus the residual r [M, C] gives x1, and
// norm_linear(x1) with N outputs gives y. `fused` with `bn`-column tiles computes both.
static void boundary(const Ctx& c, const char* name, int M, int KF, int N, int bn, NormLinearFn nl, FusedFn fused,
                     bool cluster_cost) {
    const int nl_smem = (NL_BM + NL_BN) * LDS * 2;
    const int kw = KF == C ? 6 : 12;  // the kernel's K warps for each form (its entries' KW)
    const int fused_smem = RNL_BAR_BYTES + ((NL_BM + bn) * LDS + (NL_BM + 32) * (KF + 8)) * 2 + kw * NL_BM * 32 * 4;
    CK(cudaFuncSetAttribute(nl, cudaFuncAttributeMaxDynamicSharedMemorySize, nl_smem));
    CK(cudaFuncSetAttribute(nl_clustered, cudaFuncAttributeMaxDynamicSharedMemorySize, nl_smem));
    CK(cudaFuncSetAttribute(fused, cudaFuncAttributeMaxDynamicSharedMemorySize, fused_smem));
    const float eps = 1e-6f;
    const unsigned seed = KF == C ? 1 : 21;
    __half* o = (__half*)drandom_host((size_t)M * KF, seed, 1.f);
    __half* r = (__half*)drandom_host((size_t)M * C, seed + 1, 3.f, 0.5f);
    __half* wf = (__half*)drandom_host((size_t)C * KF, seed + 2, KF == C ? 0.07f : 0.036f);
    __half* bf = (__half*)drandom_host(C, seed + 3, 0.2f);
    __half* lnw = (__half*)drandom_host(C, seed + 4, 0.3f, 1.f);
    __half* lnb = (__half*)drandom_host(C, seed + 5, 0.2f);
    __half* w = (__half*)drandom_host((size_t)N * C, seed + 6, 0.07f);
    __half* b = (__half*)drandom_host(N, seed + 7, 0.2f);
    __half *x1a = (__half*)dalloc((size_t)M * C * 2), *ya = (__half*)dalloc((size_t)M * N * 2);
    __half *x1b = (__half*)dalloc((size_t)M * C * 2), *yb = (__half*)dalloc((size_t)M * N * 2);
    Gemm front = make_gemm(c.lt, M, C, KF, wf, bf, c.ws_bytes);
    const dim3 grid((N + NL_BN - 1) / NL_BN, (M + NL_BM - 1) / NL_BM), grid6(6, (M + NL_BM - 1) / NL_BM);
    auto front_only = [&] { run_gemm(c.lt, front, o, x1a, r, c.ws, c.ws_bytes, c.s); };
    auto nl_only = [&] { nl<<<grid, NL_WARPS * 32, nl_smem, c.s>>>(x1a, lnw, lnb, w, b, ya, M, N, eps); };
    auto sep = [&] {
        front_only();
        nl_only();
    };
    auto nl_cl = [&] { nl_clustered<<<grid, NL_WARPS * 32, nl_smem, c.s>>>(x1a, lnw, lnb, w, b, ya, M, N, eps); };
    auto one = [&] {
        fused<<<grid6, NL_WARPS * 32, fused_smem, c.s>>>(o, wf, bf, r, lnw, lnb, w, b, x1b, yb, M, N, eps);
    };
    sep();
    CK(cudaMemsetAsync(x1b, 0xff, (size_t)M * C * 2, c.s));
    CK(cudaMemsetAsync(yb, 0xff, (size_t)M * N * 2, c.s));
    one();
    CK(cudaStreamSynchronize(c.s));
    CK(cudaGetLastError());
    printf("check %s M %d: x1 max |diff| %g, y %g\n", name, M, max_diff_half(x1a, x1b, (size_t)M * C),
           max_diff_half(ya, yb, (size_t)M * N));
    for (int round = 0; round < (c.check_only ? 0 : 2); ++round) {
        printf("%s M %d round %d: two launches %.2f | front %.2f norm_linear %.2f |", name, M, round,
               graph_us_per_call(c.s, NODES / 2, REPS, sep), graph_us_per_call(c.s, NODES, REPS, front_only),
               graph_us_per_call(c.s, NODES, REPS, nl_only));
        if (cluster_cost) printf(" norm_linear in clusters of 6 %.2f |", graph_us_per_call(c.s, NODES, REPS, nl_cl));
        printf(" fused %.2f\n", graph_us_per_call(c.s, NODES, REPS, one));
    }
}

int main() {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    Ctx c{};
    CK(cudaStreamCreateWithFlags(&c.s, cudaStreamNonBlocking));
    LT(cublasLtCreate(&c.lt));
    c.ws_bytes = 32 << 20;
    c.ws = dalloc(c.ws_bytes);
    // RNL_CHECK_ONLY=1: the checks alone (one launch of each kernel), for compute-sanitizer.
    c.check_only = getenv("RNL_CHECK_ONLY") != nullptr;
    printf("%s, %d SMs; us per launch (per pair for the two launches), median of %d replays of %d-launch graph chains\n",
           p.name, p.multiProcessorCount, REPS, NODES);
    for (int M : {197, 65})
        boundary(c, "proj -> norm2 -> fc1 + GELU", M, C, 4 * C, 128, fastpath_norm_linear_f16_c192_gelu,
                 fastpath_residual_norm_linear_f16_c192_gelu, true);
    for (int M : {197, 65})
        boundary(c, "fc2 -> norm1 -> qkv", M, 4 * C, 3 * C, 96, fastpath_norm_linear_f16_c192,
                 fastpath_residual_norm_linear_f16_c192_k768, false);
    return 0;
}
