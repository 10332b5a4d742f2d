// What a captured forward's memory nodes cost a replay: candle allocates each intermediate with
// cuMemAllocAsync and frees it with cuMemFreeAsync, so a capture holds an allocation and a free
// node per kernel (a DeiT-S batch-1 graph: 54 kernels, 54 + 54 memory nodes). A graph of K
// dependent ~5 µs kernels, each writing a buffer either allocated and freed inside the capture
// (memory nodes) or allocated once before it (none), timed as `bench` times a replay (host clock
// from the launch call to the return of the stream's synchronisation), with the host time the
// launch call takes and the GPU time between CUDA events. Standalone (nvcc, runtime API); run on
// the GPU:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/graph_nodes_floor scripts/gpu/probes/graph_nodes_floor.cu -lcuda -lcublasLt
//   /tmp/graph_nodes_floor
#include "probe_common.cuh"

// Busy for `ns` nanoseconds of the global timer, then one store into `out` (block 0, thread 0).
__global__ void busy_store(float* out, unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = (float)(t - t0);
}

int main() {
    CK(cudaSetDevice(0));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaMemPool_t pool;
    CK(cudaDeviceGetDefaultMemPool(&pool, 0));
    unsigned long long keep = ~0ull;
    CK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    for (int kernels : {16, 54}) {
        for (int memory_nodes = 0; memory_nodes < 2; ++memory_nodes) {
            std::vector<float*> fixed(kernels);
            for (auto& p : fixed) CK(cudaMalloc(&p, 1 << 20));
            cudaGraph_t g;
            cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            float* prev = nullptr;
            for (int i = 0; i < kernels; ++i) {
                float* out = fixed[i];
                if (memory_nodes) CK(cudaMallocAsync(&out, 1 << 20, s));
                busy_store<<<132, 128, 0, s>>>(out, 5000);
                if (memory_nodes && prev) CK(cudaFreeAsync(prev, s));
                prev = memory_nodes ? out : nullptr;
            }
            if (memory_nodes && prev) CK(cudaFreeAsync(prev, s));
            CK(cudaStreamEndCapture(s, &g));
            CK(cudaGraphInstantiate(&ge, g, 0));
            CK(cudaGraphUpload(ge, s));
            size_t nodes = 0;
            CK(cudaGraphGetNodes(g, nullptr, &nodes));
            cudaEvent_t e0, e1;
            CK(cudaEventCreate(&e0));
            CK(cudaEventCreate(&e1));
            std::vector<double> wall, launch, gpu;
            for (int i = 0; i < 220; ++i) {
                const ReplayClock t = clock_replay(ge, s, e0, e1);
                if (i >= 20) {
                    wall.push_back(t.wall_us);
                    launch.push_back(t.launch_us);
                    gpu.push_back(t.gpu_us);
                }
            }
            printf("%2d kernels of ~5 us, %s (%zu nodes): launch call %.1f us, wall %.1f us, events %.1f us "
                   "(medians of 200)\n",
                   kernels, memory_nodes ? "each output allocated and freed in the graph" : "fixed buffers",
                   nodes, median_of(launch), median_of(wall), median_of(gpu));
            CK(cudaEventDestroy(e0));
            CK(cudaEventDestroy(e1));
            CK(cudaGraphExecDestroy(ge));
            CK(cudaGraphDestroy(g));
            for (auto p : fixed) CK(cudaFree(p));
        }
    }
    return 0;
}
