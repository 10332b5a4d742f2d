// Shared by the standalone probes in this folder: error checks that stop the probe with the
// failing call's text, the median time of a graph of launches replayed on a stream, zeroed device
// buffers, PTX modules from the cargo build, and cuBLASLt GEMMs as candle-fastpath calls them.
#pragma once
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)
#define CU(x)                                                              \
    do {                                                                   \
        CUresult r_ = (x);                                                 \
        if (r_ != CUDA_SUCCESS) {                                          \
            const char* m_;                                                \
            cuGetErrorString(r_, &m_);                                     \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, m_); \
            exit(1);                                                       \
        }                                                                  \
    } while (0)
#define LT(x)                                                                          \
    do {                                                                               \
        cublasStatus_t s_ = (x);                                                       \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                             \
            fprintf(stderr, "%s:%d %s: status %d\n", __FILE__, __LINE__, #x, (int)s_); \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

// Milliseconds of `run` (work it enqueues on `s`) between two CUDA events: `warmup` untimed
// runs, then the median of `reps`.
static double median_event_ms(cudaStream_t s, int warmup, int reps, const std::function<void()>& run) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < warmup; ++i) run();
    std::vector<float> ms;
    for (int i = 0; i < reps; ++i) {
        CK(cudaEventRecord(e0, s));
        run();
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return ms[ms.size() / 2];
}

// The median of `v`.
static double median_of(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// One replay of `ge` on `s` timed as `bench` times a graph row: host µs from the launch call to
// its return (`launch_us`) and to the stream's synchronisation (`wall_us`); then a second replay
// between the events `e0` / `e1` for the GPU's share (`gpu_us`).
struct ReplayClock {
    double launch_us, wall_us, gpu_us;
};
static ReplayClock clock_replay(cudaGraphExec_t ge, cudaStream_t s, cudaEvent_t e0, cudaEvent_t e1) {
    using clk = std::chrono::steady_clock;
    const auto us = [](clk::time_point a, clk::time_point b) {
        return std::chrono::duration<double, std::micro>(b - a).count();
    };
    const auto t0 = clk::now();
    CK(cudaGraphLaunch(ge, s));
    const auto t1 = clk::now();
    CK(cudaStreamSynchronize(s));
    const auto t2 = clk::now();
    CK(cudaEventRecord(e0, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaStreamSynchronize(s));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return {us(t0, t1), us(t0, t2), 1000.0 * ms};
}

// µs per launch: `calls` launches made by `launch` on `s`, captured as one graph, replayed 20
// times to warm up, then `reps` times between CUDA events; the median replay / calls.
static double graph_us_per_call(cudaStream_t s, int calls, int reps, const std::function<void()>& launch) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls; ++i) launch();
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    const double ms = median_event_ms(s, 20, reps, [&] { CK(cudaGraphLaunch(ge, s)); });
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return 1000.0 * ms / calls;
}

// A zeroed device buffer of `bytes`.
static void* dalloc(size_t bytes) {
    void* p;
    CK(cudaMalloc(&p, bytes));
    CK(cudaMemset(p, 0, bytes));
    return p;
}

// The module of a PTX file the cargo build wrote (the driver JITs it, as candle does).
static CUmodule load_ptx(const char* path) {
    std::ifstream f(path);
    if (!f) {
        fprintf(stderr, "cannot read %s\n", path);
        exit(1);
    }
    std::stringstream ss;
    ss << f.rdbuf();
    std::string ptx = ss.str();
    CUmodule m;
    CU(cuModuleLoadData(&m, ptx.c_str()));
    return m;
}

// y[M, N] = x[M, K] W[N, K]^T + b (+ r), f16 with f32 accumulation and the bias epilogue, as
// candle-fastpath calls cuBLASLt: its heuristic's first pick for the shape.
struct Gemm {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t lw, lx, ly;
    cublasLtMatmulAlgo_t algo;
    const void *w, *b;
};

static Gemm make_gemm(cublasLtHandle_t lt, int M, int N, int K, const void* w, const void* b, size_t ws_bytes) {
    Gemm g{};
    g.w = w;
    g.b = b;
    LT(cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    LT(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    LT(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)));
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    LT(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    LT(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.b, sizeof(g.b)));
    // Column-major view: y^T (N x M) = W' (K x N)^T x' (K x M).
    LT(cublasLtMatrixLayoutCreate(&g.lw, CUDA_R_16F, K, N, K));
    LT(cublasLtMatrixLayoutCreate(&g.lx, CUDA_R_16F, K, M, K));
    LT(cublasLtMatrixLayoutCreate(&g.ly, CUDA_R_16F, N, M, N));
    cublasLtMatmulPreference_t pref;
    LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    LT(cublasLtMatmulAlgoGetHeuristic(lt, g.op, g.lw, g.lx, g.ly, g.ly, pref, 1, &res, &found));
    if (!found) {
        fprintf(stderr, "no cuBLASLt algorithm for %d x %d x %d\n", M, N, K);
        exit(1);
    }
    g.algo = res.algo;
    return g;
}

// y = x W^T + b (+ res, as C with beta 1, when given) on `s`, into a separate y.
static void run_gemm(cublasLtHandle_t lt, const Gemm& g, const void* x, void* y, const void* res, void* ws,
                     size_t ws_bytes, cudaStream_t s) {
    const float one = 1.f, zero = 0.f;
    LT(cublasLtMatmul(lt, g.op, &one, g.w, g.lw, x, g.lx, res ? &one : &zero, res ? res : y, g.ly, y, g.ly, &g.algo,
                      ws, ws_bytes, s));
}

// A device buffer of n halves, offset + scale · u with u uniform in [-1, 1) from an LCG seeded by
// `seed` (the same values on every run and machine).
static void* drandom_host(size_t n, unsigned seed, float scale, float offset = 0.f) {
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

// The largest |a - b| over n halves of two device buffers (infinity when one is not finite).
static float max_diff_half(const void* a, const void* b, size_t n) {
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

// One of DeiT's GEMMs (`y = x W^T + b`, plus a residual when `residual`) with random operands on
// the device, two output buffers, and cuBLASLt's first `algos` heuristic picks for it (what the
// autotuning probes time); everything freed on destruction.
struct GemmCase {
    int m, n, k;
    void *w, *b, *x, *r, *y0, *y1;
    Gemm g;
    std::vector<cublasLtMatmulHeuristicResult_t> picks;

    GemmCase(cublasLtHandle_t lt, int m_, int n_, int k_, bool residual, int algos, size_t ws_bytes)
        : m(m_), n(n_), k(k_) {
        w = drandom_host((size_t)n * k, 1 + n + k, 1.f / sqrtf((float)k));
        b = drandom_host(n, 7 + n, 0.5f);
        x = drandom_host((size_t)m * k, 3 + m, 1.f);
        r = residual ? drandom_host((size_t)m * n, 5 + m, 1.f) : nullptr;
        y0 = dalloc((size_t)m * n * 2);
        y1 = dalloc((size_t)m * n * 2);
        g = make_gemm(lt, m, n, k, w, b, ws_bytes);
        cublasLtMatmulPreference_t pref;
        LT(cublasLtMatmulPreferenceCreate(&pref));
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                sizeof(ws_bytes)));
        picks.resize(algos);
        int found = 0;
        LT(cublasLtMatmulAlgoGetHeuristic(lt, g.op, g.lw, g.lx, g.ly, g.ly, pref, algos, picks.data(), &found));
        LT(cublasLtMatmulPreferenceDestroy(pref));
        picks.resize(found);
    }
    GemmCase(const GemmCase&) = delete;
    GemmCase& operator=(const GemmCase&) = delete;
    ~GemmCase() {
        for (void* p : {w, b, x, r, y0, y1})
            if (p) CK(cudaFree(p));
        LT(cublasLtMatmulDescDestroy(g.op));
        LT(cublasLtMatrixLayoutDestroy(g.lw));
        LT(cublasLtMatrixLayoutDestroy(g.lx));
        LT(cublasLtMatrixLayoutDestroy(g.ly));
    }
};

// CTA b's SLICE f16 elements of `out` (the first SLICE / 8 threads, 16 bytes each, L2 only): a
// phase probe's output, `acc` rounded into every element so that the loads behind it stay live.
template <int SLICE>
__device__ __forceinline__ void probe_store_slice(__half* out, int b, float acc) {
    if (threadIdx.x < SLICE / 8) {
        const __half2 o = __floats2half2_rn(acc, 1.f);
        uint4 w;
        w.x = w.y = w.z = w.w = *reinterpret_cast<const unsigned*>(&o);
        __stcg(reinterpret_cast<uint4*>(out + b * SLICE) + threadIdx.x, w);
    }
}

// DeiT's four GEMMs per block, sized as multiples of the width C: qkv, proj (+ residual), fc1,
// fc2 (+ residual).
struct DeitGemm {
    const char* name;
    int n_mult, k_mult;
    bool residual;
};
static const DeitGemm kDeitGemms[] = {{"qkv", 3, 1, false}, {"proj", 1, 1, true}, {"fc1", 4, 1, false}, {"fc2", 1, 4, true}};

// A cuBLASLt handle, a stream and a 32 MB workspace, as the autotuning probes run their GEMMs.
struct LtSetup {
    cublasLtHandle_t lt;
    cudaStream_t s;
    size_t ws_bytes = 32u << 20;
    void* ws;
    LtSetup() {
        LT(cublasLtCreate(&lt));
        CK(cudaStreamCreate(&s));
        ws = dalloc(ws_bytes);
    }
};
