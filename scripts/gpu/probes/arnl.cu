// Lever 64's probe: the attention of a batch-1 DeiT-T block folded into residual_norm_linear's
// proj form (lever 61), so that one launch runs attention -> proj + residual -> norm2 -> fc1 +
// GELU, against the two launches it replaces (candle-ragged's resident attention kernel with the
// launch shape its host picks at batch 1: 8 key parts, one query tile per block; then lever 61's
// kernel). f16, C = 192, 3 heads of 64, one sequence of M tokens (M = 197 and the pruned lengths
// of the default schedule at keep 0.7: 138, 97, 68).
//
// The fused kernel is candle-fastpath's attention_residual_norm_linear_tile (kernels/fastpath.cu),
// both its entries (W's loads issued at once, and late). The variants lever 64 timed on the way
// (a copy of the kernel with MODE bits: length first, pair split, q first, late W, and timing-only
// breakdowns) are docs/benchmarks/history/lever64-probe-variants.patch, which applies to this file
// as of that commit. The design: the cluster of six CTAs that shares a 16-row tile splits the
// attention by head: ranks h and h + 3 both compute head h for the tile's 16 queries over all keys (8 warps,
// each a range of 16-key tiles with candle-ragged's attend_keys, then one merge of the 8
// online-softmax states by all 16 warps), and each writes the normalised rows into the attention
// tile (16 x 192) of three cluster CTAs through distributed shared memory (rank h into ranks 0-2,
// rank h + 3 into ranks 3-5). After a cluster barrier every CTA holds the whole tile where
// lever 61's kernel loads it from global memory, and goes on as that kernel does.
//
// Each M is checked first (x1 and y of the fused kernel, its outputs poisoned before, against the
// two launches': max |difference| printed), then timed in µs per launch (per pair for the two
// launches) over 48-launch graph chains.
// Run on the GPU from the repo root:
//   nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -I candle-ragged/kernels -o /tmp/arnl \
//     scripts/gpu/probes/arnl.cu candle-ragged/kernels/ragged_attention.cu -lcublasLt -lcuda && /tmp/arnl
//   ARNL_CHECK_ONLY=1 compute-sanitizer --tool racecheck /tmp/arnl   (the checks alone)
#include <cuda_fp16.h>

#include <cmath>

#include "../../../candle-fastpath/kernels/fastpath.cu"
#include "probe_common.cuh"

// candle-ragged's resident kernel, from its own translation unit (the nvcc line below).
extern "C" __global__ void ragged_attn_resident_f16_d64(const __half* q, const __half* k, const __half* v, __half* o,
                                                        const uint32_t* cu_seqlens, long long q_tok, long long q_head,
                                                        long long k_tok, long long k_head, long long v_tok,
                                                        long long v_head, int heads, float scale_log2,
                                                        int uniform_len);

constexpr int C = 192, NODES = 48, REPS = 200;
constexpr int AR_D = 64, AR_HEADS = C / AR_D, AR_ROW = AR_D + 8, AR_PARTS = 8, AR_STATE = AR_D / 2 + 4;

// candle-fastpath's dynamic shared memory at M rows (its host's attention_rnl_smem_bytes).
static size_t fused_smem_bytes(int M) {
    const int LDS = C + 8, kv_rows = (M + 15) / 16 * 16;
    return RNL_BAR_BYTES + ((size_t)(NL_BM + 128) * LDS + (size_t)(NL_BM + 32) * LDS) * 2 + 6 * NL_BM * 32 * 4 +
           (size_t)AR_PARTS * AR_STATE * 32 * 4 + (size_t)2 * kv_rows * AR_ROW * 2;
}

// M rows, the sequence's first `len` (< M: a capacity-sized buffer whose tail rows hold stale
// values, here NaN, which neither path may let into the sequence's rows).
static void run(cudaStream_t s, int M, int len, bool check_only) {
    const int N = 4 * C, LDS = C + 8;
    const float eps = 1e-6f, scale_log2 = 0.125f * 1.4426950408889634f;
    const unsigned seed = 31 + M;
    __half* qkv = (__half*)drandom_host((size_t)M * 3 * C, seed, 2.f);
    __half* r = (__half*)drandom_host((size_t)M * C, seed + 1, 3.f, 0.5f);
    __half* wp = (__half*)drandom_host((size_t)C * C, seed + 2, 0.07f);
    __half* bp = (__half*)drandom_host(C, seed + 3, 0.2f);
    __half* lnw = (__half*)drandom_host(C, seed + 4, 0.3f, 1.f);
    __half* lnb = (__half*)drandom_host(C, seed + 5, 0.2f);
    __half* w = (__half*)drandom_host((size_t)N * C, seed + 6, 0.07f);
    __half* b = (__half*)drandom_host(N, seed + 7, 0.2f);
    if (len < M) CK(cudaMemset(qkv + (size_t)len * 3 * C, 0xff, (size_t)(M - len) * 3 * C * 2));
    uint32_t cu_h[2] = {0, (uint32_t)len};
    uint32_t* cu = (uint32_t*)dalloc(8);
    CK(cudaMemcpy(cu, cu_h, 8, cudaMemcpyHostToDevice));
    __half* o = (__half*)dalloc((size_t)M * C * 2);
    __half *x1a = (__half*)dalloc((size_t)M * C * 2), *ya = (__half*)dalloc((size_t)M * N * 2);
    __half *x1b = (__half*)dalloc((size_t)M * C * 2), *yb = (__half*)dalloc((size_t)M * N * 2);

    // candle-ragged's plan at batch 1 (resident_plan: 8 key parts, one 16-row tile per block).
    const int q_tiles = (M + 15) / 16, kv_rows = q_tiles * 16;
    const int attn_smem = 2 * kv_rows * AR_ROW * 2 + 1 * 7 * AR_STATE * 32 * 4;
    const int rnl_smem = ((NL_BM + 128) * LDS + (NL_BM + 32) * LDS) * 2 + 6 * NL_BM * 32 * 4;
    CK(cudaFuncSetAttribute(ragged_attn_resident_f16_d64, cudaFuncAttributeMaxDynamicSharedMemorySize, attn_smem));
    CK(cudaFuncSetAttribute(fastpath_residual_norm_linear_f16_c192_gelu,
                            cudaFuncAttributeMaxDynamicSharedMemorySize, rnl_smem));
    const long long tok = 3 * C, hd = AR_D;
    auto attn = [&] {
        ragged_attn_resident_f16_d64<<<dim3(q_tiles, AR_HEADS, 1), dim3(32, 8), attn_smem, s>>>(
            qkv, qkv + C, qkv + 2 * C, o, cu, tok, hd, tok, hd, tok, hd, AR_HEADS, scale_log2, len == M ? M : 0);
    };
    const dim3 grid6(6, (M + NL_BM - 1) / NL_BM);
    auto rnl = [&] {
        fastpath_residual_norm_linear_f16_c192_gelu<<<grid6, NL_WARPS * 32, rnl_smem, s>>>(o, wp, bp, r, lnw, lnb, w,
                                                                                            b, x1a, ya, M, N, eps);
    };
    auto sep = [&] {
        attn();
        rnl();
    };
    sep();
    CK(cudaStreamSynchronize(s));
    if (!check_only)
        for (int round = 0; round < 2; ++round)
            printf("M %d round %d: two launches %.2f | attention %.2f residual_norm_linear %.2f\n", M, round,
                   graph_us_per_call(s, NODES / 2, REPS, sep), graph_us_per_call(s, NODES, REPS, attn),
                   graph_us_per_call(s, NODES, REPS, rnl));
    auto fused = [&](auto kernel, const char* name) {
        const int smem = (int)fused_smem_bytes(M);
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        auto one = [&] {
            kernel<<<grid6, NL_WARPS * 32, smem, s>>>(qkv, cu, wp, bp, r, lnw, lnb, w, b, x1b, yb, M, N, eps,
                                                      scale_log2);
        };
        {
            CK(cudaMemsetAsync(x1b, 0xff, (size_t)M * C * 2, s));
            CK(cudaMemsetAsync(yb, 0xff, (size_t)M * N * 2, s));
            one();
            CK(cudaStreamSynchronize(s));
            CK(cudaGetLastError());
            printf("  check %-28s M %d len %d (smem %d B): x1 max |diff| %g, y %g\n", name, M, len, smem,
                   max_diff_half(x1a, x1b, (size_t)M * C), max_diff_half(ya, yb, (size_t)M * N));
        }
        if (!check_only)
            printf("  fused %-28s M %d: %.2f / %.2f\n", name, M, graph_us_per_call(s, NODES, REPS, one),
                   graph_us_per_call(s, NODES, REPS, one));
    };
    fused(fastpath_attention_residual_norm_linear_f16_c192_gelu, "candle-fastpath's kernel");
    fused(fastpath_attention_residual_norm_linear_f16_c192_gelu_late, "candle-fastpath's, late W");
}

int main() {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const bool check_only = getenv("ARNL_CHECK_ONLY") != nullptr;
    printf("%s, %d SMs; us per launch (per pair for the two launches), median of %d replays of %d-launch graph chains\n",
           p.name, p.multiProcessorCount, REPS, NODES);
    for (int M : {197, 138, 97, 68, 1, 17}) run(s, M, M, check_only);
    run(s, 197, 190, true);
    run(s, 70, 64, true);
    return 0;
}
