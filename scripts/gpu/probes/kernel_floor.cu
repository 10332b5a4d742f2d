// What one kernel costs inside a CUDA graph chain on this GPU, against cuBLASLt's batch-1 GEMMs:
// the floor an own fused GEMM (LayerNorm prologue, GELU epilogue) would start from. Each probe is
// a graph of NODES dependent launches of one kernel, replayed REPS times; the per-node time is
// the median replay time (CUDA events) / NODES. Standalone (nvcc + cuBLASLt); run on the GPU:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/kernel_floor scripts/gpu/probes/kernel_floor.cu -lcublasLt
//   /tmp/kernel_floor
// Probes (DeiT-S at batch 1: 197 rows, C = 384; the load probes move a GEMM's operands):
//   empty kernels of several grids;
//   load_tiles: one CTA per 64 x 64 output tile, its A rows (64 x K) and W rows (64 x K) fetched
//     whole, by 16-byte loads or by two 1-D bulk copies (TMA, mbarrier), then one store per tile
//     element (a GEMM with no arithmetic: its memory chain);
//   cuBLASLt f16 GEMMs of DeiT-S's four shapes with the bias epilogue, as the model calls them.
#include <cuda_fp16.h>

#include "probe_common.cuh"

constexpr int NODES = 96, REPS = 200;

__global__ void empty_kernel() {}

// A [M, K] and W [N, K] row-major f16; block (n-tile, m-tile) reads its 64 rows of each with
// 16-byte loads and writes out[m, n] = (sum of its A row's first vector) + (W row's) as f16.
__global__ void load_tiles_ld(const __half* a, const __half* w, __half* out, int M, int N, int K) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int m0 = blockIdx.y * 64, n0 = blockIdx.x * 64;
    const int vecs = K / 8;  // 16-byte vectors per row
    uint4* sa = reinterpret_cast<uint4*>(smem);
    uint4* sw = sa + 64 * vecs;
    for (int i = threadIdx.x; i < 64 * vecs; i += blockDim.x) {
        const int r = i / vecs, c = i % vecs;
        sa[i] = m0 + r < M ? reinterpret_cast<const uint4*>(a + (size_t)(m0 + r) * K)[c] : make_uint4(0, 0, 0, 0);
        sw[i] = n0 + r < N ? reinterpret_cast<const uint4*>(w + (size_t)(n0 + r) * K)[c] : make_uint4(0, 0, 0, 0);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) {
        const int r = i / 64, c = i % 64;
        if (m0 + r < M && n0 + c < N) {
            const __half* ar = reinterpret_cast<const __half*>(&sa[r * vecs + (c % vecs)]);
            const __half* wr = reinterpret_cast<const __half*>(&sw[c * vecs + (r % vecs)]);
            out[(size_t)(m0 + r) * N + n0 + c] = __hadd(ar[0], wr[0]);
        }
    }
}

// The same with each operand tile fetched as one 1-D bulk copy (the 64 rows of a row-major
// [rows, K] matrix are contiguous), completion counted on an mbarrier (rows past M are not
// fetched: the copy is shortened).
__global__ void load_tiles_bulk(const __half* a, const __half* w, __half* out, int M, int N, int K) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bar;
    const int m0 = blockIdx.y * 64, n0 = blockIdx.x * 64;
    const int rows_a = min(64, M - m0), rows_w = min(64, N - n0);
    const unsigned bytes_a = rows_a * K * 2, bytes_w = rows_w * K * 2;
    __half* sa = reinterpret_cast<__half*>(smem);
    __half* sw = sa + 64 * K;
    const unsigned bar_addr = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_addr));
        asm volatile("fence.mbarrier_init.release.cluster;");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_addr), "r"(bytes_a + bytes_w));
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                static_cast<unsigned>(__cvta_generic_to_shared(sa))),
            "l"(a + (size_t)m0 * K), "r"(bytes_a), "r"(bar_addr)
            : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                static_cast<unsigned>(__cvta_generic_to_shared(sw))),
            "l"(w + (size_t)n0 * K), "r"(bytes_w), "r"(bar_addr)
            : "memory");
    }
    __syncthreads();
    unsigned done = 0;
    while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(bar_addr)
            : "memory");
    }
    for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) {
        const int r = i / 64, c = i % 64;
        if (r < rows_a && c < rows_w) out[(size_t)(m0 + r) * N + n0 + c] = __hadd(sa[r * K + c], sw[c * K + r]);
    }
}

// y = x + x over n f16 (n a multiple of 8), one 16-byte vector per thread: the traffic of a
// LayerNorm (C = 384) or the GELU pass (4C) at batch 1, with no reductions.
__global__ void elementwise(const uint4* x, uint4* y, int vecs) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < vecs) {
        uint4 v = x[i];
        __half2* h = reinterpret_cast<__half2*>(&v);
        for (int j = 0; j < 4; ++j) h[j] = __hadd2(h[j], h[j]);
        y[i] = v;
    }
}

// µs per launch of a graph of NODES launches made by `launch` on `s` (median of REPS replays).
static double per_node_us(cudaStream_t s, const std::function<void()>& launch) {
    return graph_us_per_call(s, NODES, REPS, launch);
}

// A cuBLASLt GEMM of one shape on zeroed operands of its own: x [M, K], W [N, K], b [N], y [M, N].
struct GemmCall {
    Gemm g;
    void *x, *y;
};

static GemmCall gemm_call(cublasLtHandle_t lt, int M, int N, int K, size_t ws_bytes) {
    void* w = dalloc((size_t)N * K * 2);
    void* b = dalloc((size_t)N * 2);
    return {make_gemm(lt, M, N, K, w, b, ws_bytes), dalloc((size_t)M * K * 2), dalloc((size_t)M * N * 2)};
}

int main() {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    printf("%s, %d SMs; graph of %d dependent launches, median of %d replays; us per launch\n", p.name,
           p.multiProcessorCount, NODES, REPS);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const int sms = p.multiProcessorCount;
    for (int grid : {1, 25, sms, 4 * sms}) {
        printf("empty kernel, %4d blocks of 256 threads: %.2f\n", grid,
               per_node_us(s, [&] { empty_kernel<<<grid, 256, 0, s>>>(); }));
    }
    const int M = 197, C = 384;
    {
        uint4 *x, *y;
        CK(cudaMalloc(&x, (size_t)M * 4 * C * 2));
        CK(cudaMalloc(&y, (size_t)M * 4 * C * 2));
        for (int width : {C, 4 * C}) {
            const int vecs = M * width / 8;
            printf("elementwise f16 over %d x %d (one 16-byte vector per thread): %.2f\n", M, width,
                   per_node_us(s, [&] { elementwise<<<(vecs + 255) / 256, 256, 0, s>>>(x, y, vecs); }));
        }
    }
    struct Shape { const char* name; int N, K; };
    const Shape shapes[] = {{"qkv", 3 * C, C}, {"proj", C, C}, {"fc1", 4 * C, C}, {"fc2", C, 4 * C}};
    __half *a, *w, *out;
    CK(cudaMalloc(&a, (size_t)M * 4 * C * 2));
    CK(cudaMalloc(&w, (size_t)4 * C * 4 * C * 2));
    CK(cudaMalloc(&out, (size_t)M * 4 * C * 2));
    CK(cudaMemset(a, 0, (size_t)M * 4 * C * 2));
    CK(cudaMemset(w, 0, (size_t)4 * C * 4 * C * 2));
    for (auto* k : {(const void*)load_tiles_ld, (const void*)load_tiles_bulk})
        CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * 64 * C * 2));
    cublasLtHandle_t lt;
    LT(cublasLtCreate(&lt));
    const size_t ws_bytes = 32 << 20;
    void* ws;
    CK(cudaMalloc(&ws, ws_bytes));
    for (const Shape& sh : shapes) {
        const dim3 grid((sh.N + 63) / 64, (M + 63) / 64);
        const int smem = 2 * 64 * sh.K * 2;
        const bool fits = smem <= 2 * 64 * C * 2;
        const double ld = fits ? per_node_us(s, [&] { load_tiles_ld<<<grid, 256, smem, s>>>(a, w, out, M, sh.N, sh.K); }) : -1;
        const double bulk = fits ? per_node_us(s, [&] { load_tiles_bulk<<<grid, 256, smem, s>>>(a, w, out, M, sh.N, sh.K); }) : -1;
        const GemmCall g = gemm_call(lt, M, sh.N, sh.K, ws_bytes);
        const double gemm = per_node_us(s, [&] { run_gemm(lt, g.g, g.x, g.y, nullptr, ws, ws_bytes, s); });
        printf("%-4s M %d N %4d K %4d (%3d tiles of 64 x 64, %3d KB of operands per tile): load_tiles ld %.2f, bulk %.2f; cuBLASLt %.2f\n",
               sh.name, M, sh.N, sh.K, grid.x * grid.y, smem / 1024, ld, bulk, gemm);
    }
    // Pairs: a GEMM then an elementwise kernel (a LayerNorm's or the GELU's place after a GEMM),
    // per pair, against the two alone; then with the elementwise kernel preferring the whole
    // carveout as shared memory (the GEMM's configuration: no L1 / shared-memory switch between
    // the two), and two different GEMMs alternating.
    {
        uint4 *x, *y;
        CK(cudaMalloc(&x, (size_t)M * 4 * C * 2));
        CK(cudaMalloc(&y, (size_t)M * 4 * C * 2));
        const int vecs = M * C / 8;
        const GemmCall q = gemm_call(lt, M, 3 * C, C, ws_bytes);
        const GemmCall f2 = gemm_call(lt, M, C, 4 * C, ws_bytes);
        auto gemm = [&](const GemmCall& g) { run_gemm(lt, g.g, g.x, g.y, nullptr, ws, ws_bytes, s); };
        auto ew = [&] { elementwise<<<(vecs + 255) / 256, 256, 0, s>>>(x, y, vecs); };
        const double q_alone = per_node_us(s, [&] { gemm(q); });
        const double ew_alone = per_node_us(s, ew);
        const double pair = per_node_us(s, [&] { gemm(q); ew(); });
        for (int carveout : {-1, 0, 100}) {
            CK(cudaFuncSetAttribute((const void*)elementwise, cudaFuncAttributePreferredSharedMemoryCarveout, carveout));
            printf("qkv GEMM then elementwise (%d x %d), carveout preference %4d: %.2f per pair (alone: %.2f + %.2f = %.2f)\n",
                   M, C, carveout, per_node_us(s, [&] { gemm(q); ew(); }), q_alone, ew_alone, q_alone + ew_alone);
        }
        (void)pair;
        const double f2_alone = per_node_us(s, [&] { gemm(f2); });
        printf("qkv GEMM then fc2 GEMM: %.2f per pair (alone: %.2f + %.2f = %.2f)\n",
               per_node_us(s, [&] { gemm(q); gemm(f2); }), q_alone, f2_alone, q_alone + f2_alone);
        CK(cudaFuncSetAttribute((const void*)empty_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, -1));
        printf("qkv GEMM then empty kernel (25 blocks): %.2f per pair\n",
               per_node_us(s, [&] { gemm(q); empty_kernel<<<25, 256, 0, s>>>(); }));
        CK(cudaFuncSetAttribute((const void*)empty_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
        printf("qkv GEMM then empty kernel (25 blocks), carveout 100: %.2f per pair\n",
               per_node_us(s, [&] { gemm(q); empty_kernel<<<25, 256, 0, s>>>(); }));
    }
    CK(cudaDeviceSynchronize());
    return 0;
}
