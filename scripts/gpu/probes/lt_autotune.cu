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
    LtSetup setup;
    cublasLtHandle_t lt = setup.lt;
    cudaStream_t s = setup.s;
    const size_t ws_bytes = setup.ws_bytes;
    void* ws = setup.ws;
    const int dims[] = {192, 384, 768};
    const int rows[] = {197, 138, 69, 1576, 12608, 50432};
    printf("model C, rows, GEMM: pick-0 us | best us (pick #) | best / pick 0 | max |diff| | candidates | split-K of pick 0 / best\n");
    for (int c : dims) {
        for (int m : rows) {
            for (const DeitGemm& sh : kDeitGemms) {
                GemmCase gc(lt, m, sh.n_mult * c, sh.k_mult * c, sh.residual, algos, ws_bytes);
                const int n = gc.n, found = (int)gc.picks.size();
                Gemm& g = gc.g;
                const auto& res = gc.picks;
                void *x = gc.x, *r = gc.r, *y0 = gc.y0, *y1 = gc.y1;
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
            }
        }
    }
    return 0;
}
