// What a phase boundary costs on this GPU: the step from one stage of a forward to the next as a
// kernel boundary in a CUDA graph (what the batch-1 forward pays ~54 times a DeiT-S replay) against
// the same step inside one persistent kernel (a "megakernel": one CTA per SM running every stage,
// waiting on a grid-wide barrier, or only on the CTA whose data it reads). The question it answers:
// would such a kernel remove the per-boundary cost that levers 104, 119 and 122 kept meeting (~1
// µs a boundary in a graph), and by how much. Standalone (nvcc, runtime API); run on the GPU:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/phase_floor scripts/gpu/probes/phase_floor.cu -lcuda -lcublasLt
//   /tmp/phase_floor
// Every row runs G = one CTA per SM of 128 threads and P phases; each phase is one of:
//   token: each CTA reads the 16 bytes CTA (i + 1) mod G wrote in the phase before and writes its
//     own (a cross-CTA dependency through L2, nothing else);
//   load:  each CTA reads 48 KB (a batch-1 GEMM tile's activations: 64 rows of C = 384 in f16)
//     from a buffer every CTA wrote a slice of in the phase before, then writes its 1.5 KB slice;
//   static load: the same reads from a buffer no phase writes (a GEMM's weights), the same writes.
// and each boundary one of:
//   graph:    a graph of P launches of a one-phase kernel (stream order: the next starts when the
//             previous has finished), and the same launched with programmatic dependent launch
//             (programmatic edges: the next grid launches at once and waits in
//             griddepcontrol.wait; a static load issues its loads before the wait);
//   barrier:  one launch, a grid-wide barrier between phases (an arrival counter and a generation
//             word in global memory, release / acquire);
//   flag:     one launch, each CTA waits only for the CTAs it reads (token: one; load: the
//             slices its 48 KB span), through per-CTA phase words (the data-flow form).
// Per-phase cost = (time of 2P phases − time of P phases) / P (fixed costs cancel), medians of 50;
// the persistent forms with their spin loops backing off 0, 64 or 256 ns (__nanosleep) between
// polls, since 131 CTAs polling one word in L2 may slow the loads of the others.
#include <cooperative_groups.h>

#include "probe_common.cuh"

constexpr int THREADS = 128, SLICE = 768;  // f16 elements a CTA writes in a load phase (1.5 KB)
constexpr int READ = 64 * 384;             // f16 elements a CTA reads in a load phase (48 KB)
static_assert(READ % (8 * THREADS) == 0, "whole 16-byte loads per thread");

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// 48 KB from the slices starting at CTA b's (wrapping at the buffer's end), summed per thread:
// each thread's 24 loads issued together (no load waits on another).
__device__ __forceinline__ float load_48k(const __half* in, int b, int g) {
    const int total = g * SLICE, start = b * SLICE;
    constexpr int PER = READ / 8 / THREADS;
    uint4 v[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        int e = start + (j * THREADS + threadIdx.x) * 8;
        if (e >= total) e -= total;
        v[j] = __ldcg(reinterpret_cast<const uint4*>(in + e));
    }
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        // Every half of the 16 bytes, so the loads stay 16-byte loads.
        const __half2* h = reinterpret_cast<const __half2*>(&v[j]);
        const __half2 s2 = __hadd2(__hadd2(h[0], h[1]), __hadd2(h[2], h[3]));
        acc += __low2float(s2) + __high2float(s2);
    }
    return acc;
}

// CTA b's 1.5 KB slice of `out` (the first 96 threads, 16 bytes each).
__device__ __forceinline__ void store_slice(__half* out, int b, float acc) { probe_store_slice<SLICE>(out, b, acc); }

// One phase's work for CTA `b` of `g`: `in` the phase before's data, `out` this phase's.
template <bool LOAD>
__device__ __forceinline__ void phase_work(const __half* in, __half* out, int b, int g) {
    if (!LOAD) {
        if (threadIdx.x == 0) {
            const uint4 v = __ldcg(reinterpret_cast<const uint4*>(in) + (b + 1) % g);
            uint4 w = v;
            w.x += 1;
            __stcg(reinterpret_cast<uint4*>(out) + b, w);
        }
        return;
    }
    store_slice(out, b, load_48k(in, b, g));
}

// The slices CTA b reads in a load phase: READ elements from slice b on.
__device__ __forceinline__ int slices_read(int g) { return (READ + SLICE - 1) / SLICE < g ? (READ + SLICE - 1) / SLICE : g; }

template <bool LOAD>
__global__ void __launch_bounds__(THREADS) one_phase(const __half* in, __half* out) {
    phase_work<LOAD>(in, out, blockIdx.x, gridDim.x);
}

// One phase launched with programmatic dependent launch: it lets the next phase's grid launch at
// once, and waits for the previous grid's memory (griddepcontrol.wait) before reading what that
// grid wrote; EARLY (reads of a buffer no phase writes) issues its loads before the wait, as a
// kernel would its weights, and waits only before its store.
template <bool LOAD, bool EARLY>
__global__ void __launch_bounds__(THREADS) one_phase_pdl(const __half* in, __half* out) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (EARLY) {
        const float acc = load_48k(in, blockIdx.x, gridDim.x);
        asm volatile("griddepcontrol.wait;" ::: "memory");
        store_slice(out, blockIdx.x, acc);
        return;
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    phase_work<LOAD>(in, out, blockIdx.x, gridDim.x);
}

// The static-load phase of a kernel shaped like ours: `smem` bytes of dynamic shared memory a
// CTA (reserved, one word touched) and, by the launch, clusters; PDL as one_phase_pdl's EARLY.
template <bool PDL>
__global__ void __launch_bounds__(THREADS) heavy_phase(const __half* in, __half* out) {
    extern __shared__ float heavy_smem[];
    if (PDL) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const float acc = load_48k(in, blockIdx.x, gridDim.x);
    if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (threadIdx.x == 0) heavy_smem[0] = acc;
    store_slice(out, blockIdx.x, acc);
}

// All phases in one launch; buffers alternate between phases. mode 0: grid barrier; 1: flags.
template <bool LOAD>
__global__ void __launch_bounds__(THREADS) persistent(__half* buf0, __half* buf1, const __half* fixed, int phases,
                                                      int mode, unsigned* count, unsigned* gen, unsigned* flags,
                                                      unsigned backoff) {
    const int b = blockIdx.x, g = gridDim.x;
    unsigned my_gen = 0;
    if (threadIdx.x == 0) my_gen = ld_acquire(gen);
    for (int p = 0; p < phases; ++p) {
        const __half* in = fixed ? fixed : p % 2 ? buf1 : buf0;
        __half* out = p % 2 ? buf0 : buf1;
        if (mode == 1 && p > 0 && threadIdx.x < 32) {
            // Wait for the CTAs whose phase p − 1 output this CTA reads, a lane each.
            const int n = LOAD ? slices_read(g) : 1, first = LOAD ? b : (b + 1) % g;
            for (int j = threadIdx.x; j < n; j += 32) {
                const unsigned* f = flags + (first + j) % g;
                while (ld_acquire(f) < (unsigned)p) __nanosleep(backoff);
            }
        }
        __syncthreads();
        phase_work<LOAD>(in, out, b, g);
        __syncthreads();
        if (threadIdx.x == 0) {
            if (mode == 1) {
                st_release(flags + b, p + 1);
            } else {
                // Grid barrier: the last arrival resets the counter and bumps the generation.
                __threadfence();
                if (atomicAdd(count, 1) == (unsigned)g - 1) {
                    *count = 0;
                    st_release(gen, my_gen + 1);
                } else {
                    while (ld_acquire(gen) == my_gen) __nanosleep(backoff);
                }
                ++my_gen;
            }
        }
    }
}

// Milliseconds of one replay of a graph of `phases` launches of `f` with `cfg` (median of REPS
// after 5 warm-ups), phase p reading `fixed` (when given) or buffer p mod 2 and writing the other.
static double graph_of_phases_ms(cudaStream_t s, const cudaLaunchConfig_t& cfg, const void* f, int phases,
                                 const __half* fixed, __half* buf0, __half* buf1, int reps) {
    cudaGraph_t gph;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int p = 0; p < phases; ++p) {
        const __half* in = fixed ? fixed : p % 2 ? buf1 : buf0;
        __half* out = p % 2 ? buf0 : buf1;
        void* args[] = {&in, &out};
        CK(cudaLaunchKernelExC(&cfg, f, args));
    }
    CK(cudaStreamEndCapture(s, &gph));
    CK(cudaGraphInstantiate(&ge, gph, 0));
    const double ms = median_event_ms(s, 5, reps, [&] { CK(cudaGraphLaunch(ge, s)); });
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(gph));
    return ms;
}

int main() {
    int dev = 0, sms = 0;
    CK(cudaSetDevice(dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    printf("%s, %d SMs; G = %d CTAs of %d threads\n", prop.name, sms, sms, THREADS);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const size_t elems = (size_t)sms * SLICE;
    auto* buf0 = static_cast<__half*>(dalloc(elems * 2));
    auto* buf1 = static_cast<__half*>(dalloc(elems * 2));
    auto* buf2 = static_cast<__half*>(dalloc(elems * 2));
    auto* sync = static_cast<unsigned*>(dalloc((2 + sms) * sizeof(unsigned)));
    unsigned *count = sync, *gen = sync + 1, *flags = sync + 2;
    const int P = 96, REPS = 50;
    for (int kind = 0; kind < 3; ++kind) {
        const bool load = kind > 0;
        const char* what = kind == 2 ? "static load (48 KB a CTA, unwritten)" : load ? "load (48 KB a CTA)" : "token (16 B a CTA)";
        __half* fixed = kind == 2 ? buf2 : nullptr;
        // graph: P and 2P launches, µs per launch from the difference.
        // pdl: the launches with the programmatic-stream-serialization attribute, so that the
        // capture links them by programmatic edges.
        auto graph_ms = [&](int phases, bool pdl) {
            const void* f = kind == 0 ? (const void*)one_phase<false> : (const void*)one_phase<true>;
            if (pdl)
                f = kind == 0   ? (const void*)one_phase_pdl<false, false>
                    : kind == 1 ? (const void*)one_phase_pdl<true, false>
                                : (const void*)one_phase_pdl<true, true>;
            cudaLaunchAttribute attr{};
            attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
            attr.val.programmaticStreamSerializationAllowed = 1;
            cudaLaunchConfig_t cfg{};
            cfg.gridDim = dim3(sms);
            cfg.blockDim = dim3(THREADS);
            cfg.stream = s;
            cfg.attrs = pdl ? &attr : nullptr;
            cfg.numAttrs = pdl ? 1 : 0;
            return graph_of_phases_ms(s, cfg, f, phases, fixed, buf0, buf1, REPS);
        };
        // persistent: one cooperative launch of P and 2P phases (all CTAs resident).
        auto persistent_ms = [&](int phases, int mode, unsigned backoff) {
            return median_event_ms(s, 5, REPS, [&] {
                CK(cudaMemsetAsync(sync, 0, (2 + sms) * sizeof(unsigned), s));
                void* args[] = {&buf0, &buf1, &fixed, &phases, &mode, &count, &gen, &flags, &backoff};
                const void* f = load ? (const void*)persistent<true> : (const void*)persistent<false>;
                CK(cudaLaunchCooperativeKernel(f, dim3(sms), dim3(THREADS), args, 0, s));
            });
        };
        const double g1 = graph_ms(P, false), g2 = graph_ms(2 * P, false);
        const double p1 = graph_ms(P, true), p2 = graph_ms(2 * P, true);
        printf("%s, per phase: graph of launches %.2f us, with programmatic edges %.2f us%s (whole: %.1f / %.1f "
               "and %.1f / %.1f us for %d / %d phases)\n",
               what, 1000 * (g2 - g1) / P, 1000 * (p2 - p1) / P, kind == 2 ? " (loads before the wait)" : "",
               1000 * g1, 1000 * g2, 1000 * p1, 1000 * p2, P, 2 * P);
        for (unsigned backoff : {0u, 64u, 256u}) {
            const double b1 = persistent_ms(P, 0, backoff), b2 = persistent_ms(2 * P, 0, backoff);
            const double f1 = persistent_ms(P, 1, backoff), f2 = persistent_ms(2 * P, 1, backoff);
            printf("  spin back-off %3u ns: grid barrier %.2f us, flags %.2f us (whole: barrier %.1f / %.1f, "
                   "flags %.1f / %.1f)\n",
                   backoff, 1000 * (b2 - b1) / P, 1000 * (f2 - f1) / P, 1000 * b1, 1000 * b2, 1000 * f1, 1000 * f2);
        }
    }
    // Kernels shaped like ours: 128 CTAs (a multiple of the cluster sizes) with large shared
    // memory, alone or in clusters of 8, the static load before the wait: can the next grid
    // still start early when a CTA of the running one holds most of an SM's shared memory?
    for (int smem : {0, 100 * 1024, 150 * 1024}) {
        for (int cluster : {1, 8}) {
            for (bool pdl : {false, true}) {
                const void* f = pdl ? (const void*)heavy_phase<true> : (const void*)heavy_phase<false>;
                CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, smem + 16));
            }
            auto heavy_ms = [&](int phases, bool pdl) {
                const void* f = pdl ? (const void*)heavy_phase<true> : (const void*)heavy_phase<false>;
                cudaLaunchAttribute attrs[2]{};
                int n = 0;
                if (cluster > 1) {
                    attrs[n].id = cudaLaunchAttributeClusterDimension;
                    attrs[n].val.clusterDim.x = cluster;
                    attrs[n].val.clusterDim.y = 1;
                    attrs[n].val.clusterDim.z = 1;
                    ++n;
                }
                if (pdl) {
                    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                    attrs[n].val.programmaticStreamSerializationAllowed = 1;
                    ++n;
                }
                cudaLaunchConfig_t cfg{};
                cfg.gridDim = dim3(128);
                cfg.blockDim = dim3(THREADS);
                cfg.dynamicSmemBytes = smem + 16;  // the word the kernel touches, even at 0
                cfg.stream = s;
                cfg.attrs = n ? attrs : nullptr;
                cfg.numAttrs = n;
                return graph_of_phases_ms(s, cfg, f, phases, buf2, buf0, buf1, REPS);
            };
            const double g1 = heavy_ms(P, false), g2 = heavy_ms(2 * P, false);
            const double p1 = heavy_ms(P, true), p2 = heavy_ms(2 * P, true);
            printf("static load, 128 CTAs, %3d KB shared memory a CTA, clusters of %d, per phase: graph %.2f us, "
                   "with programmatic edges %.2f us (loads before the wait)\n",
                   smem / 1024, cluster, 1000 * (g2 - g1) / P, 1000 * (p2 - p1) / P);
        }
    }
    CK(cudaStreamSynchronize(s));
    return 0;
}
