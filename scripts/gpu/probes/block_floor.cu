// A DeiT-S block at batch 1 (197 tokens, C = 384, 6 heads) as the model's CUDA graph runs it,
// kernel by kernel, in a graph chain: our LayerNorm, GELU and attention kernels loaded from the
// PTX the cargo build wrote (the driver JITs it, as candle does) and cuBLASLt GEMMs with the
// model's epilogues. Each kernel alone (NODES dependent launches of it), then the whole block
// (LN, qkv, attention, proj + residual, LN, fc1, GELU, fc2 + residual) twelve times. Per-launch
// figures are median replay times (CUDA events) / launches. Run on the GPU from the repo root:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/block_floor scripts/gpu/probes/block_floor.cu -lcublasLt -lcuda
//   /tmp/block_floor FASTPATH_PTX RAGGED_PTX
#include <cuda_fp16.h>

#include <chrono>

#include "probe_common.cuh"

constexpr int NODES = 96, REPS = 200;

static double per_call_us(cudaStream_t s, int calls, const std::function<void()>& launch) {
    return graph_us_per_call(s, calls, REPS, launch);
}

// Medians (µs) of REPS replays of `ge` on `s` after 20 untimed ones, as the bench times a
// replay: the host wall clock from before `before()` (the copy into the input buffer, if any) to
// after the stream's synchronisation, and the CUDA events around them (0 without `events`).
struct ReplayTimes {
    double wall, events;
};
static ReplayTimes replay_times(cudaStream_t s, cudaGraphExec_t ge, bool events, const std::function<void()>& before) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<double> wall, gpu;
    for (int i = 0; i < 20 + REPS; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        if (events) CK(cudaEventRecord(e0, s));
        before();
        CK(cudaGraphLaunch(ge, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaStreamSynchronize(s));
        const auto t1 = std::chrono::steady_clock::now();
        float t = 0;
        if (events) CK(cudaEventElapsedTime(&t, e0, e1));
        if (i >= 20) {
            wall.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
            gpu.push_back(1000.0 * t);
        }
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    std::sort(wall.begin(), wall.end());
    std::sort(gpu.begin(), gpu.end());
    return {wall[wall.size() / 2], gpu[gpu.size() / 2]};
}

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s FASTPATH_PTX RAGGED_PTX\n", argv[0]);
        return 2;
    }
    CK(cudaFree(0));
    CU(cuInit(0));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    CUmodule fast = load_ptx(argv[1]), ragged = load_ptx(argv[2]);
    CUfunction ln, gelu, attn;
    CU(cuModuleGetFunction(&ln, fast, "fastpath_layer_norm_f16_c2"));
    CU(cuModuleGetFunction(&gelu, fast, "fastpath_gelu_phi_f16"));
    CU(cuModuleGetFunction(&attn, ragged, "ragged_attn_resident_f16_d64"));
    const int M = 197, C = 384, H = 6, D = 64;
    // The resident plan for 1 x 6 heads x 197 tokens on 132 SMs (resident_plan.rs): 8 key parts of
    // one warp, 13 query tiles x 6 heads; K / V rows padded to 208 and the parts' merge buffers.
    const unsigned attn_smem = 2 * 208 * (D + 8) * 2 + 1 * 7 * (D / 2 + 4) * 32 * 4;
    CU(cuFuncSetAttribute(attn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, attn_smem));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CUstream cs = (CUstream)s;

    void* x = dalloc((size_t)M * C * 2);      // residual stream
    void* xn = dalloc((size_t)M * C * 2);     // LayerNorm output
    void* qkv = dalloc((size_t)M * 3 * C * 2);
    void* o = dalloc((size_t)M * C * 2);
    void* h = dalloc((size_t)M * 4 * C * 2);
    void* lnw = dalloc(C * 2);
    void* lnb = dalloc(C * 2);
    unsigned* cu = (unsigned*)dalloc(8);
    const unsigned cu_host[2] = {0, (unsigned)M};
    CK(cudaMemcpy(cu, cu_host, 8, cudaMemcpyHostToDevice));

    unsigned rows = M, cdim = C;
    float eps = 1e-6f;
    auto run_ln = [&](void* in, void* out) {
        void* args[] = {&in, &lnw, &lnb, &out, &rows, &cdim, &eps};
        CU(cuLaunchKernel(ln, (M + 7) / 8, 1, 1, 256, 1, 1, 0, cs, args, nullptr));
    };
    unsigned long long glen = (unsigned long long)M * 4 * C;
    auto run_gelu = [&] {
        void* args[] = {&h, &glen};
        const unsigned blocks = std::min<unsigned long long>((glen / 8 + 255) / 256, 132 * 16);
        CU(cuLaunchKernel(gelu, blocks, 1, 1, 256, 1, 1, 0, cs, args, nullptr));
    };
    long long q_tok = 3 * C, q_head = D;
    int heads = H, uniform = M;
    float scale_log2 = 0.125f * 1.4426950408889634f;
    void* kp = (char*)qkv + C * 2;
    void* vp = (char*)qkv + 2 * C * 2;
    auto run_attn = [&] {
        void* args[] = {&qkv, &kp, &vp, &o, &cu, &q_tok, &q_head, &q_tok, &q_head, &q_tok, &q_head,
                        &heads, &scale_log2, &uniform};
        CU(cuLaunchKernel(attn, 13, H, 1, 32, 8, 1, attn_smem, cs, args, nullptr));
    };
    cublasLtHandle_t lt;
    LT(cublasLtCreate(&lt));
    const size_t ws_bytes = 32 << 20;
    void* ws = dalloc(ws_bytes);
    // Zeroed weights and biases of each GEMM's shape.
    auto gemm_of = [&](int N, int K) { return make_gemm(lt, M, N, K, dalloc((size_t)N * K * 2), dalloc(N * 2), ws_bytes); };
    const Gemm g_qkv = gemm_of(3 * C, C), g_proj = gemm_of(C, C), g_fc1 = gemm_of(4 * C, C), g_fc2 = gemm_of(C, 4 * C);
    auto gemm = [&](const Gemm& g, const void* in, void* out, const void* res) {
        run_gemm(lt, g, in, out, res, ws, ws_bytes, s);
    };
    void* x2 = dalloc((size_t)M * C * 2);
    printf("%s; DeiT-S block at batch 1 as graph nodes; us per launch (median of %d replays)\n", p.name, REPS);
    printf("LayerNorm (ours)           %.2f\n", per_call_us(s, NODES, [&] { run_ln(x, xn); }));
    printf("qkv GEMM                   %.2f\n", per_call_us(s, NODES, [&] { gemm(g_qkv, xn, qkv, nullptr); }));
    printf("attention (ours, resident) %.2f\n", per_call_us(s, NODES, run_attn));
    printf("proj GEMM + residual       %.2f\n", per_call_us(s, NODES, [&] { gemm(g_proj, o, x2, x); }));
    printf("fc1 GEMM                   %.2f\n", per_call_us(s, NODES, [&] { gemm(g_fc1, xn, h, nullptr); }));
    printf("GELU (ours, phi)           %.2f\n", per_call_us(s, NODES, run_gelu));
    printf("fc2 GEMM + residual        %.2f\n", per_call_us(s, NODES, [&] { gemm(g_fc2, h, x, x2); }));
    auto block = [&] {
        run_ln(x, xn);
        gemm(g_qkv, xn, qkv, nullptr);
        run_attn();
        gemm(g_proj, o, x2, x);
        run_ln(x2, xn);
        gemm(g_fc1, xn, h, nullptr);
        run_gelu();
        gemm(g_fc2, h, x, x2);
    };
    printf("whole block (8 launches)   %.2f per block, 12 blocks in one graph\n", per_call_us(s, 12, block));
    // The same 12 blocks as the bench times a replay: host wall clock from before the launch to
    // after the synchronisation, with and without the copy of a 3 x 224 x 224 f32 input into the
    // graph's input buffer first (CapturedForward::replay does that copy).
    {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < 12; ++i) block();
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        CK(cudaGraphUpload(ge, s));
        const size_t pix = 3 * 224 * 224 * 4;
        void* src = dalloc(pix);
        void* dst = dalloc(pix);
        // Lever 56's copy kernel exists only with its patch applied
        // (docs/benchmarks/history/lever56-copy-kernel.patch); without it that mode is skipped.
        CUfunction copy_kernel = nullptr;
        const bool have_copy_kernel = cuModuleGetFunction(&copy_kernel, fast, "fastpath_copy_bytes") == CUDA_SUCCESS;
        unsigned long long pix_bytes = pix;
        const char* modes[] = {"graph launch + sync", "cudaMemcpyAsync D2D + graph launch + sync",
                               "copy kernel (fastpath_copy_bytes) + graph launch + sync",
                               "cudaMemcpyAsync D2D + graph launch + sync, no event before the copy"};
        for (int mode = 0; mode < 4; ++mode) {
            if (mode == 2 && !have_copy_kernel) continue;
            const ReplayTimes t = replay_times(s, ge, mode != 3, [&] {
                if (mode == 1 || mode == 3) CK(cudaMemcpyAsync(dst, src, pix, cudaMemcpyDeviceToDevice, s));
                if (mode == 2) {
                    void* args[] = {&src, &dst, &pix_bytes};
                    const unsigned blocks = std::min<unsigned long long>((pix + 4095) / 4096, 132 * 8);
                    CU(cuLaunchKernel(copy_kernel, blocks, 1, 1, 256, 1, 1, 0, cs, args, nullptr));
                }
            });
            printf("12 blocks, %s: host wall %.1f us, events %.1f us (medians)\n", modes[mode], t.wall, t.events);
        }
    }
    // The same 12 blocks with every intermediate allocated inside the capture by
    // cudaMallocAsync and freed by cudaFreeAsync once its last reader is queued, as candle's
    // tensors are (each becomes a graph memory node): does a graph pay for its memory nodes?
    {
        auto run_attn_on = [&](void* qkv_p, void* o_p) {
            void* kp2 = (char*)qkv_p + C * 2;
            void* vp2 = (char*)qkv_p + 2 * C * 2;
            void* args[] = {&qkv_p, &kp2, &vp2, &o_p, &cu, &q_tok, &q_head, &q_tok, &q_head, &q_tok, &q_head,
                            &heads, &scale_log2, &uniform};
            CU(cuLaunchKernel(attn, 13, H, 1, 32, 8, 1, attn_smem, cs, args, nullptr));
        };
        auto run_gelu_on = [&](void* h_p) {
            void* args[] = {&h_p, &glen};
            const unsigned blocks = std::min<unsigned long long>((glen / 8 + 255) / 256, 132 * 16);
            CU(cuLaunchKernel(gelu, blocks, 1, 1, 256, 1, 1, 0, cs, args, nullptr));
        };
        auto alloc = [&](size_t bytes) {
            void* p2;
            CK(cudaMallocAsync(&p2, bytes, s));
            return p2;
        };
        const size_t act = (size_t)M * C * 2;
        auto blocks_alloc = [&] {
            void* cur = x;
            for (int b = 0; b < 12; ++b) {
                void* xn1 = alloc(act);
                run_ln(cur, xn1);
                void* qkv1 = alloc(3 * act);
                gemm(g_qkv, xn1, qkv1, nullptr);
                CK(cudaFreeAsync(xn1, s));
                void* o1 = alloc(act);
                run_attn_on(qkv1, o1);
                CK(cudaFreeAsync(qkv1, s));
                void* x21 = alloc(act);
                gemm(g_proj, o1, x21, cur);
                CK(cudaFreeAsync(o1, s));
                if (cur != x) CK(cudaFreeAsync(cur, s));
                void* xn2 = alloc(act);
                run_ln(x21, xn2);
                void* h1 = alloc(4 * act);
                gemm(g_fc1, xn2, h1, nullptr);
                CK(cudaFreeAsync(xn2, s));
                run_gelu_on(h1);
                void* x31 = alloc(act);
                gemm(g_fc2, h1, x31, x21);
                CK(cudaFreeAsync(h1, s));
                CK(cudaFreeAsync(x21, s));
                cur = x31;
            }
            CK(cudaMemcpyAsync(x2, cur, act, cudaMemcpyDeviceToDevice, s));
            CK(cudaFreeAsync(cur, s));
        };
        auto blocks_plain = [&] {
            for (int i = 0; i < 12; ++i) block();
        };
        const char* names[] = {"12 blocks, buffers fixed (kernel nodes only)",
                               "12 blocks, buffers from cudaMallocAsync / cudaFreeAsync in the capture"};
        for (int mode = 0; mode < 2; ++mode) {
            cudaGraph_t g;
            cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            if (mode == 0) blocks_plain(); else blocks_alloc();
            CK(cudaStreamEndCapture(s, &g));
            size_t nodes = 0;
            CK(cudaGraphGetNodes(g, nullptr, &nodes));
            std::vector<cudaGraphNode_t> list(nodes);
            CK(cudaGraphGetNodes(g, list.data(), &nodes));
            int kinds[16] = {0};
            for (auto n : list) {
                cudaGraphNodeType t;
                CK(cudaGraphNodeGetType(n, &t));
                kinds[std::min((int)t, 15)]++;
            }
            CK(cudaGraphInstantiate(&ge, g, 0));
            CK(cudaGraphUpload(ge, s));
            const ReplayTimes t = replay_times(s, ge, true, [] {});
            printf("%s: %zu nodes (kernel %d, memcpy %d, memset %d, mem alloc %d, mem free %d): host wall %.1f us, "
                   "events %.1f us (medians)\n",
                   names[mode], nodes, kinds[cudaGraphNodeTypeKernel], kinds[cudaGraphNodeTypeMemcpy],
                   kinds[cudaGraphNodeTypeMemset], kinds[cudaGraphNodeTypeMemAlloc], kinds[cudaGraphNodeTypeMemFree],
                   t.wall, t.events);
            CK(cudaGraphExecDestroy(ge));
            CK(cudaGraphDestroy(g));
        }
    }
    CK(cudaDeviceSynchronize());
    return 0;
}
