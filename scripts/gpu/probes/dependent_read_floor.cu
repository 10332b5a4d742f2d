// What the read behind `griddepcontrol.wait` costs by its size: a graph of launches of a one-phase
// kernel, each CTA reading R bytes that the launch before wrote (a batch-1 kernel's activations:
// the thin GEMM's x tile is 48 KB a CTA), with programmatic edges (every CTA triggers its
// dependents at entry and waits before the read) and without. Lever 126 found that fetching those
// bytes once per cluster (TMA multicast) saves nothing, so the read is not bound by what L2
// serves in all; this probe asks whether it is bound by the bytes each CTA waits for (then smaller
// tiles, more CTAs, would shorten it) or by a fixed latency (then they would not). Standalone:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/dependent_read_floor scripts/gpu/probes/dependent_read_floor.cu -lcuda -lcublasLt
//   /tmp/dependent_read_floor
// Rows: R = 0 (a 16-byte token), 6, 12, 24, 48, 96 KB a CTA, read four ways:
//   lsu: each thread's 16-byte loads, eight at a time (ld.global.cg), summed, the sum stored;
//   tma: thread 0 asks the bulk-copy engine for R bytes in 8 KB pieces into shared memory, all
//        counted on one transaction barrier, as our kernels' TMA boxes are; the CTA waits on it;
//   cp.async/128, cp.async/512: 128 or 512 threads each issuing all its 16-byte cp.async into
//        shared memory at once, then waiting for them (fastpath.cu's K / V staging: 512 threads);
// over G = one or two CTAs per SM (two: the same bytes in all, each CTA half). Per-phase cost =
// (time of 2P phases − time of P phases) / P, medians of 50 replays; fixed costs cancel.
#include "probe_common.cuh"

constexpr int THREADS = 128, SLICE = 768;  // f16 elements a CTA writes a phase (1.5 KB)
constexpr int PIECE = 8192;                // bytes of one bulk copy (a 64 × 64 f16 TMA box)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// R bytes of `in` from CTA b's slice on (wrapping at `total` elements), summed.
__device__ float read_lsu(const __half* in, int b, int total, int bytes) {
    float acc = 0.f;
    const int start = b * SLICE, vecs = bytes / 16;
    constexpr int UNROLL = 8;
    for (int j0 = threadIdx.x; j0 < vecs; j0 += THREADS * UNROLL) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int j = j0 + u * THREADS;
            int e = start + j * 8;
            while (e >= total) e -= total;
            v[u] = j < vecs ? __ldcg(reinterpret_cast<const uint4*>(in + e)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc += __uint_as_float(v[u].x & 0x3f800000u);
    }
    return acc;
}

// R bytes of `in` from CTA b's slice on into shared memory by the bulk-copy engine (pieces that
// would cross the buffer's end start over at its beginning), then one word of each piece summed.
__device__ float read_tma(const __half* in, int b, int total, int bytes, unsigned char* smem, uint64_t* bar) {
    const uint32_t b32 = smem_u32(bar);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b32) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b32), "r"(bytes) : "memory");
        for (int off = 0; off < bytes; off += PIECE) {
            const int n = min(PIECE, bytes - off);
            int e = b * SLICE + off / 2;
            if (e >= total) e -= total;
            if (e + n / 2 > total) e = 0;
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                    smem_u32(smem + off)),
                "l"(in + e), "r"(n), "r"(b32)
                : "memory");
        }
    }
    __syncthreads();
    uint32_t done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(b32)
                     : "memory");
    float acc = 0.f;
    for (int off = threadIdx.x * 16; off < bytes; off += THREADS * 16)
        acc += __uint_as_float(*reinterpret_cast<const uint32_t*>(smem + off) & 0x3f800000u);
    return acc;
}

// CTA b's 1.5 KB slice of `out` from its threads' sums (every sum reaches the store, so no load is
// dead code).
__device__ __forceinline__ void write_slice(__half* out, int b, float acc) {
    probe_store_slice<SLICE>(out, b, __shfl_xor_sync(~0u, acc, 1) + acc);
}

// R bytes of `in` from CTA b's slice on into shared memory by cp.async, 16 bytes a request, every
// thread's requests issued together (as fastpath.cu's K / V staging does), then one word of each
// 16 bytes summed.
template <int NT>
__device__ float read_cp_async(const __half* in, int b, int total, int bytes, unsigned char* smem) {
    const int start = b * SLICE, vecs = bytes / 16;
    for (int j = threadIdx.x; j < vecs; j += NT) {
        int e = start + j * 8;
        while (e >= total) e -= total;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(smem + 16 * j)), "l"(in + e) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    float acc = 0.f;
    for (int off = threadIdx.x * 16; off < bytes; off += NT * 16)
        acc += __uint_as_float(*reinterpret_cast<const uint32_t*>(smem + off) & 0x3f800000u);
    return acc;
}

// The same phase with NT threads and the read by cp.async (PDL as read_phase's).
template <bool PDL, int NT>
__global__ void __launch_bounds__(NT) read_phase_cp_async(const __half* in, __half* out, int bytes) {
    extern __shared__ __align__(128) unsigned char smem[];
    if (PDL) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
    const int b = blockIdx.x, g = gridDim.x, total = g * SLICE;
    float acc = read_cp_async<NT>(in, b, total, bytes, smem);
    write_slice(out, b, acc);
}

// One phase: trigger the next grid (PDL), wait for the one before, read R bytes of what it wrote
// (R = 0: CTA b + 1's 16-byte token), write this CTA's slice.
template <bool PDL, bool TMA>
__global__ void __launch_bounds__(THREADS) read_phase(const __half* in, __half* out, int bytes) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ uint64_t bar;
    if (PDL) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
    const int b = blockIdx.x, g = gridDim.x, total = g * SLICE;
    float acc;
    if (bytes == 0) {
        acc = threadIdx.x == 0 ? __half2float(in[((b + 1) % g) * SLICE]) : 0.f;
    } else {
        acc = TMA ? read_tma(in, b, total, bytes, smem, &bar) : read_lsu(in, b, total, bytes);
    }
    write_slice(out, b, acc);
}

int main() {
    int sms = 0;
    CK(cudaSetDevice(0));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs, %d threads a CTA; per phase = (2P - P phases) / P, P = 96, medians of 50\n", prop.name, sms,
           THREADS);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const int max_g = 2 * sms, P = 96, REPS = 50;
    // Each CTA writes its slice and reads up to 96 KB from it on, wrapping: a buffer of at least
    // 96 KB however few CTAs.
    const size_t elems = std::max<size_t>((size_t)max_g * SLICE, 96 * 1024 / 2 + SLICE);
    auto* buf0 = static_cast<__half*>(dalloc(elems * 2));
    auto* buf1 = static_cast<__half*>(dalloc(elems * 2));
    const void* kernels[2][4] = {{(const void*)read_phase<false, false>, (const void*)read_phase<false, true>,
                                  (const void*)read_phase_cp_async<false, 128>, (const void*)read_phase_cp_async<false, 512>},
                                 {(const void*)read_phase<true, false>, (const void*)read_phase<true, true>,
                                  (const void*)read_phase_cp_async<true, 128>, (const void*)read_phase_cp_async<true, 512>}};
    const char* mode_names[4] = {"lsu", "tma", "cp.async/128", "cp.async/512"};
    for (auto& row : kernels)
        for (const void* f : row) CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    auto phases_ms = [&](int phases, bool pdl, int mode, int g, int bytes) {
        cudaLaunchAttribute attr{};
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg{};
        cfg.gridDim = dim3(g);
        cfg.blockDim = dim3(mode == 3 ? 512 : THREADS);
        cfg.dynamicSmemBytes = mode > 0 ? std::max(bytes, 16) : 0;
        cfg.stream = s;
        cfg.attrs = pdl ? &attr : nullptr;
        cfg.numAttrs = pdl ? 1 : 0;
        cudaGraph_t gph;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int p = 0; p < phases; ++p) {
            const __half* in = p % 2 ? buf1 : buf0;
            __half* out = p % 2 ? buf0 : buf1;
            void* args[] = {&in, &out, &bytes};
            CK(cudaLaunchKernelExC(&cfg, kernels[pdl][mode], args));
        }
        CK(cudaStreamEndCapture(s, &gph));
        CK(cudaGraphInstantiate(&ge, gph, 0));
        const double ms = median_event_ms(s, 5, REPS, [&] { CK(cudaGraphLaunch(ge, s)); });
        CK(cudaGraphExecDestroy(ge));
        CK(cudaGraphDestroy(gph));
        return ms;
    };
    for (int per_sm : {1, 2}) {
        const int g = per_sm * sms;
        for (int kb : {0, 6, 12, 24, 48, 96}) {
            // Two CTAs an SM: each reads half, so an SM waits for the same bytes as one CTA would.
            const int bytes = kb * 1024 / per_sm;
            printf("G = %3d (%d a SM), %5d bytes a CTA:", g, per_sm, bytes);
            for (int mode = 0; mode < 4; ++mode) {
                if (kb == 0 && mode > 0) continue;
                for (bool pdl : {false, true}) {
                    const double t1 = phases_ms(P, pdl, mode, g, bytes), t2 = phases_ms(2 * P, pdl, mode, g, bytes);
                    printf("  %s %s %.2f us", mode_names[mode], pdl ? "pdl" : "graph", 1000 * (t2 - t1) / P);
                }
            }
            printf("\n");
        }
    }
    CK(cudaStreamSynchronize(s));
    return 0;
}
