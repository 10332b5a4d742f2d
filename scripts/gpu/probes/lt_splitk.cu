// Lever 83's probe: whether split-K versions of cuBLASLt's heuristic picks beat the best
// single-pass pick (what lever 79's tuning chooses from) for DeiT's four GEMMs at batch-1 row
// counts (197 tokens, and the pruned 138 / 69) of DeiT-S and DeiT-B, f16, bias epilogue, f32 accumulation. For
// each of the heuristic's first ALGOS picks: its time as given, then with CUBLASLT_ALGO_CONFIG_
// SPLITK_NUM set to 2, 3, 4, 6, 8 under each reduction scheme the algorithm accepts
// (cublasLtMatmulAlgoCheck); each timed in a graph of 20 dependent launches (graph_us_per_call,
// a replay's time). Prints the best single-pass time (and pick #), the best split-K time (pick #,
// split, scheme) and their ratio, and the max |difference| of the split-K output from the
// single-pass one. Run on the GPU from the repo root:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/lt_splitk scripts/gpu/probes/lt_splitk.cu -lcublasLt -lcuda
//   /tmp/lt_splitk [ALGOS]        (default 8)
#include "probe_common.cuh"

int main(int argc, char** argv) {
    const int algos = argc > 1 ? atoi(argv[1]) : 8;
    LtSetup setup;
    cublasLtHandle_t lt = setup.lt;
    cudaStream_t s = setup.s;
    const size_t ws_bytes = setup.ws_bytes;
    void* ws = setup.ws;
    // DeiT-S and DeiT-B (DeiT-T's batch-1 GEMMs run inside its fused kernels).
    const int dims[] = {384, 768};
    const int rows[] = {197, 138, 69};
    const int splits[] = {2, 3, 4, 6, 8};
    const cublasLtReductionScheme_t schemes[] = {CUBLASLT_REDUCTION_SCHEME_INPLACE,
                                                 CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
                                                 CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE};
    printf("C, rows, GEMM: best single-pass us (pick #) | best split-K us (pick #, split, scheme) | split / single | "
           "max |diff| | split-K variants accepted\n");
    for (int c : dims) {
        for (int m : rows) {
            for (const DeitGemm& sh : kDeitGemms) {
                GemmCase gc(lt, m, sh.n_mult * c, sh.k_mult * c, sh.residual, algos, ws_bytes);
                const int n = gc.n, found = (int)gc.picks.size();
                Gemm& g = gc.g;
                const auto& res = gc.picks;
                void *x = gc.x, *r = gc.r, *y0 = gc.y0, *y1 = gc.y1;
                const int calls = 20, reps = 100;
                double best1 = 1e30, bestk = 1e30;
                int best1_i = 0, bestk_i = -1, bestk_split = 0, bestk_scheme = -1, accepted = 0;
                cublasLtMatmulAlgo_t best1_algo{}, bestk_algo{};
                for (int i = 0; i < found; ++i) {
                    g.algo = res[i].algo;
                    const double t = graph_us_per_call(s, calls, reps, [&] { run_gemm(lt, g, x, y1, r, ws, ws_bytes, s); });
                    if (t < best1) {
                        best1 = t;
                        best1_i = i;
                        best1_algo = res[i].algo;
                    }
                    for (int sp : splits) {
                        for (int si = 0; si < 3; ++si) {
                            cublasLtMatmulAlgo_t a = res[i].algo;
                            uint32_t spv = (uint32_t)sp, sch = (uint32_t)schemes[si];
                            if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &spv, sizeof(spv)) !=
                                    CUBLAS_STATUS_SUCCESS ||
                                cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &sch,
                                                                     sizeof(sch)) != CUBLAS_STATUS_SUCCESS)
                                continue;
                            cublasLtMatmulHeuristicResult_t chk{};
                            if (cublasLtMatmulAlgoCheck(lt, g.op, g.lw, g.lx, g.ly, g.ly, &a, &chk) != CUBLAS_STATUS_SUCCESS ||
                                chk.workspaceSize > ws_bytes)
                                continue;
                            ++accepted;
                            g.algo = a;
                            const double tk =
                                graph_us_per_call(s, calls, reps, [&] { run_gemm(lt, g, x, y1, r, ws, ws_bytes, s); });
                            if (tk < bestk) {
                                bestk = tk;
                                bestk_i = i;
                                bestk_split = sp;
                                bestk_scheme = si;
                                bestk_algo = a;
                            }
                        }
                    }
                }
                float d = 0.f;
                if (bestk_i >= 0) {
                    g.algo = best1_algo;
                    run_gemm(lt, g, x, y0, r, ws, ws_bytes, s);
                    g.algo = bestk_algo;
                    run_gemm(lt, g, x, y1, r, ws, ws_bytes, s);
                    CK(cudaStreamSynchronize(s));
                    d = max_diff_half(y0, y1, (size_t)m * n);
                }
                printf("C %4d rows %4d %-4s  %6.2f (#%d) | %6.2f (#%d, %d, %d) | %.3f | %.3g | %d of %d picks\n", c, m,
                       sh.name, best1, best1_i, bestk_i >= 0 ? bestk : 0.0, bestk_i, bestk_split, bestk_scheme,
                       bestk_i >= 0 ? bestk / best1 : 0.0, d, accepted, found);
                fflush(stdout);
            }
        }
    }
    return 0;
}
