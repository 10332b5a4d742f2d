// Lever 79's probe: how much faster than cuBLASLt's first heuristic pick (what candle-fastpath's
// FusedLinear runs) the best of its first ALGOS picks is, for DeiT's four GEMMs (qkv, proj +
// residual, fc1, fc2 + residual; f16, bias epilogue, f32 accumulation) at the row counts of
// batch 1, 8, 64 and 256 (197 tokens an image) and at pruned counts. Each algorithm timed in a
// graph of 20 dependent launches (graph_us_per_call), so the times are a replay's; the one with
// the least time is reported with its ratio to pick 0, and with the max |difference| of its
// output from pick 0's (a different accumulation order), and both picks' split-K counts. Run on the GPU
// from the repo root:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/lt_autotune scripts/gpu/probes/lt_autotune.cu -lcublasLt -lcuda
//   /tmp/lt_autotune [ALGOS]        (default 16)
#include "probe_common.cuh"

int main(int argc, char** argv) {
    const int algos = argc > 1 ? atoi(argv[1]) : 16;
    cublasLtHandle_t lt;
    LT(cublasLtCreate(&lt));
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    const size_t ws_bytes = 32u << 20;
    void* ws = dalloc(ws_bytes);
    struct Shape {
        const char* name;
        int n_mult, k_mult;
        bool residual;
    };
    const Shape shapes[] = {{"qkv", 3, 1, false}, {"proj", 1, 1, true}, {"fc1", 4, 1, false}, {"fc2", 1, 4, true}};
    const int dims[] = {192, 384, 768};
    const int rows[] = {197, 138, 69, 1576, 12608, 50432};
    printf("model C, rows, GEMM: pick-0 us | best us (pick #) | best / pick 0 | max |diff| | candidates | split-K of pick 0 / best\n");
    for (int c : dims) {
        for (int m : rows) {
            for (const Shape& sh : shapes) {
                const int n = sh.n_mult * c, k = sh.k_mult * c;
                void* w = drandom_host((size_t)n * k, 1 + n + k, 1.f / sqrtf((float)k));
                void* b = drandom_host(n, 7 + n, 0.5f);
                void* x = drandom_host((size_t)m * k, 3 + m, 1.f);
                void* r = sh.residual ? drandom_host((size_t)m * n, 5 + m, 1.f) : nullptr;
                void* y0 = dalloc((size_t)m * n * 2);
                void* y1 = dalloc((size_t)m * n * 2);
                Gemm g = make_gemm(lt, m, n, k, w, b, ws_bytes);
                cublasLtMatmulPreference_t pref;
                LT(cublasLtMatmulPreferenceCreate(&pref));
                LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                        sizeof(ws_bytes)));
                std::vector<cublasLtMatmulHeuristicResult_t> res(algos);
                int found = 0;
                LT(cublasLtMatmulAlgoGetHeuristic(lt, g.op, g.lw, g.lx, g.ly, g.ly, pref, algos, res.data(), &found));
                LT(cublasLtMatmulPreferenceDestroy(pref));
                const int calls = 20, reps = m > 20000 ? 30 : 100;
                double t0 = 0, best = 1e30;
                int best_i = 0;
                for (int i = 0; i < found; ++i) {
                    g.algo = res[i].algo;
                    const double t = graph_us_per_call(s, calls, reps, [&] { run_gemm(lt, g, x, y1, r, ws, ws_bytes, s); });
                    if (i == 0) {
                        t0 = t;
                        CK(cudaMemcpyAsync(y0, y1, (size_t)m * n * 2, cudaMemcpyDeviceToDevice, s));
                    }
                    if (t < best) {
                        best = t;
                        best_i = i;
                    }
                }
                g.algo = res[best_i].algo;
                run_gemm(lt, g, x, y1, r, ws, ws_bytes, s);
                CK(cudaStreamSynchronize(s));
                const float d = max_diff_half(y0, y1, (size_t)m * n);
                auto splitk = [](const cublasLtMatmulAlgo_t& a) {
                    uint32_t v = 0;
                    size_t w = 0;
                    return cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &v, sizeof(v), &w) ==
                                   CUBLAS_STATUS_SUCCESS
                               ? (int)v
                               : -1;
                };
                printf("C %4d rows %5d %-4s  %7.2f | %7.2f (#%d) | %.3f | %.3g | %d | split-K %d / %d\n", c, m, sh.name, t0,
                       best, best_i, best / t0, d, found, splitk(res[0].algo), splitk(res[best_i].algo));
                fflush(stdout);
                for (void* p : {w, b, x, r, y0, y1})
                    if (p) CK(cudaFree(p));
                LT(cublasLtMatmulDescDestroy(g.op));
                LT(cublasLtMatrixLayoutDestroy(g.lw));
                LT(cublasLtMatrixLayoutDestroy(g.lx));
                LT(cublasLtMatrixLayoutDestroy(g.ly));
            }
        }
    }
    return 0;
}
