// What the CUDA driver alone costs the host per dispatch on this machine: the floor under the
// ragged-attention issue's "host ≤ 5 µs per call" target, measured the way bench-attention
// measures host time (a loop of calls without a sync, divided; the GPU keeps up because the
// kernels are empty). Standalone (nvcc + the driver API); run on the GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/dispatch_floor scripts/gpu/probes/dispatch_floor.cu -lcuda -lcublasLt
//   /tmp/dispatch_floor
// Each row: CALLS calls timed on the host (steady_clock), ROUNDS rounds, the median and the
// smallest round in µs per call:
//   launch, 4 args / 14 args: cuLaunchKernel of an empty kernel (candle's affine passes ~7
//     arguments, candle-ragged's attention 14);
//   alloc + free: cuMemAllocAsync / cuMemFreeAsync of a 1 MiB buffer from the device's default
//     pool with its release threshold at the maximum (candle's stream-ordered allocations, with
//     lever 4's retained memory);
//   alloc + launch (14) + free: what any op that allocates its output pays at least;
//   event record + wait: cuEventRecord then cuStreamWaitEvent on one event (cudarc's per-operand
//     stream ordering when its event tracking is on);
//   event create + destroy, twice: cudarc's two events per allocation under event tracking.
#include <chrono>

#include "probe_common.cuh"  // CU (driver-call checks) and the headers

extern "C" __global__ void empty4(void*, void*, void*, int) {}
extern "C" __global__ void empty14(void*, void*, void*, void*, void*, long long, long long, long long, long long,
                                   long long, long long, int, float, int) {}

constexpr int CALLS = 2000, ROUNDS = 7;

static void row(const char* name, CUstream s, const std::function<void()>& call) {
    for (int i = 0; i < 200; ++i) call();  // warm-up
    CU(cuStreamSynchronize(s));
    std::vector<double> us;
    for (int r = 0; r < ROUNDS; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < CALLS; ++i) call();
        const auto t1 = std::chrono::steady_clock::now();
        CU(cuStreamSynchronize(s));
        us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / CALLS);
    }
    std::sort(us.begin(), us.end());
    printf("%-34s median %6.2f us  min %6.2f us per call\n", name, us[ROUNDS / 2], us[0]);
}

int main() {
    CU(cuInit(0));
    CUdevice dev;
    CU(cuDeviceGet(&dev, 0));
    char name[128];
    CU(cuDeviceGetName(name, sizeof name, dev));
    CUcontext ctx;
    CU(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(cuCtxSetCurrent(ctx));
    CUstream s;
    CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUmemoryPool pool;
    CU(cuDeviceGetDefaultMemPool(&pool, dev));
    unsigned long long threshold = ~0ull;
    CU(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold));
    printf("%s, %d calls per round, %d rounds\n", name, CALLS, ROUNDS);

    // The runtime shares the primary context; it hands out the kernels' driver handles.
    cudaFunction_t rf4, rf14;
    if (cudaSetDevice(0) != cudaSuccess || cudaGetFuncBySymbol(&rf4, reinterpret_cast<const void*>(empty4)) != cudaSuccess ||
        cudaGetFuncBySymbol(&rf14, reinterpret_cast<const void*>(empty14)) != cudaSuccess) {
        fprintf(stderr, "cudaGetFuncBySymbol failed\n");
        return 1;
    }
    CUfunction f4 = reinterpret_cast<CUfunction>(rf4), f14 = reinterpret_cast<CUfunction>(rf14);
    CUdeviceptr buf;
    CU(cuMemAlloc(&buf, 1 << 20));
    void* p = reinterpret_cast<void*>(buf);
    int n = 1024;
    long long st = 192;
    float scale = 0.125f;
    void* args4[] = {&p, &p, &p, &n};
    void* args14[] = {&p, &p, &p, &p, &p, &st, &st, &st, &st, &st, &st, &n, &scale, &n};
    auto launch4 = [&] { CU(cuLaunchKernel(f4, 1, 1, 1, 32, 1, 1, 0, s, args4, nullptr)); };
    auto launch14 = [&] { CU(cuLaunchKernel(f14, 12, 1, 8, 128, 1, 1, 0, s, args14, nullptr)); };
    auto alloc_free = [&] {
        CUdeviceptr d;
        CU(cuMemAllocAsync(&d, 1 << 20, s));
        CU(cuMemFreeAsync(d, s));
    };
    auto alloc_launch_free = [&] {
        CUdeviceptr d;
        CU(cuMemAllocAsync(&d, 1 << 20, s));
        launch14();
        CU(cuMemFreeAsync(d, s));
    };
    CUevent ev;
    CU(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    auto record_wait = [&] {
        CU(cuEventRecord(ev, s));
        CU(cuStreamWaitEvent(s, ev, 0));
    };
    auto create_destroy = [&] {
        CUevent a, b;
        CU(cuEventCreate(&a, CU_EVENT_DISABLE_TIMING));
        CU(cuEventCreate(&b, CU_EVENT_DISABLE_TIMING));
        CU(cuEventDestroy(a));
        CU(cuEventDestroy(b));
    };
    row("launch, 4 args", s, launch4);
    row("launch, 14 args", s, launch14);
    row("alloc + free (1 MiB, pool)", s, alloc_free);
    row("alloc + launch (14) + free", s, alloc_launch_free);
    row("event record + wait", s, record_wait);
    row("event create + destroy, twice", s, create_destroy);
    row("launch, 4 args (again)", s, launch4);
    return 0;
}
