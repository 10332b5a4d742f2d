// Shared by the standalone probes in this folder: error checks that stop the probe with the
// failing call's text, and the median time of a graph of launches replayed on a stream.
#pragma once
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
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

// µs per launch: `calls` launches made by `launch` on `s`, captured as one graph, replayed 20
// times to warm up, then `reps` times between CUDA events; the median replay / calls.
static double graph_us_per_call(cudaStream_t s, int calls, int reps, const std::function<void()>& launch) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls; ++i) launch();
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(ge, s));
    std::vector<float> ms;
    for (int i = 0; i < reps; ++i) {
        CK(cudaEventRecord(e0, s));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return 1000.0 * ms[ms.size() / 2] / calls;
}
