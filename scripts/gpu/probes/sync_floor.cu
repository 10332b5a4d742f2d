// How long the host waits past the GPU's work at batch 1: a graph replay timed as `bench` times
// it (host clock from the launch call to the return of the stream's synchronisation) against the
// GPU time between CUDA events around it, under each of the context's scheduling flags (how the
// driver's synchronisation waits: spin, yield, blocking sync, or its automatic choice, which is
// what candle's primary context gets). One flag per process: the flags must be set before the
// primary context is made. Standalone (nvcc, driver + runtime API); run on the GPU:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/sync_floor scripts/gpu/probes/sync_floor.cu -lcuda -lcublasLt
//   /tmp/sync_floor auto|spin|yield|blocking
// Rows: a graph of 16 dependent kernels of ~10 µs each (a batch-1 forward's shape, ~170 µs), and
// one empty kernel launched and synchronised; medians of 200 after 20 warm-ups.
#include <chrono>
#include <cstring>

#include "probe_common.cuh"

// Busy for `ns` nanoseconds of the GPU's global timer (one thread a block).
__global__ void busy(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

__global__ void empty() {}

int main(int argc, char** argv) {
    const char* mode = argc > 1 ? argv[1] : "auto";
    unsigned flags = CU_CTX_SCHED_AUTO;
    if (!strcmp(mode, "spin")) flags = CU_CTX_SCHED_SPIN;
    if (!strcmp(mode, "yield")) flags = CU_CTX_SCHED_YIELD;
    if (!strcmp(mode, "blocking")) flags = CU_CTX_SCHED_BLOCKING_SYNC;
    CU(cuInit(0));
    CUdevice dev;
    CU(cuDeviceGet(&dev, 0));
    CU(cuDevicePrimaryCtxSetFlags(dev, flags));
    CK(cudaSetDevice(0));
    CK(cudaFree(nullptr));
    unsigned got = 0;
    int active = 0;
    CU(cuDevicePrimaryCtxGetState(dev, &got, &active));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < 16; ++i) busy<<<1, 1, 0, s>>>(10000);
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    using clk = std::chrono::steady_clock;
    std::vector<double> wall, gpu, empty_rt;
    for (int i = 0; i < 220; ++i) {
        // As bench times a graph row, then the same between events for the GPU's share.
        const ReplayClock t = clock_replay(ge, s, e0, e1);
        // One empty kernel, launched and waited for.
        const auto t2 = clk::now();
        empty<<<1, 1, 0, s>>>();
        CK(cudaStreamSynchronize(s));
        const auto t3 = clk::now();
        if (i >= 20) {
            wall.push_back(t.wall_us);
            gpu.push_back(t.gpu_us);
            empty_rt.push_back(std::chrono::duration<double, std::micro>(t3 - t2).count());
        }
    }
    printf("flags %-8s (context reports 0x%x): graph of 16 x 10 us kernels: wall %.1f us, events %.1f us, "
           "wall - events %.1f us; one empty kernel launched and synchronised: %.1f us (medians of 200)\n",
           mode, got, median_of(wall), median_of(gpu), median_of(wall) - median_of(gpu), median_of(empty_rt));
    return 0;
}
