// Exact (erf) GELU applied in place, the activation timm's ViT/DeiT MLP uses:
//   gelu(x) = 0.5 · x · (1 + erf(x / √2)), computed in f32 for every storage type.
// It runs right after the fc1 cuBLASLt call (bias already added in its epilogue) on the
// buffer that call wrote; cuBLASLt's own GELU epilogue is the tanh approximation, which would
// not match timm's nn.GELU().
//
// Bandwidth-bound: each thread moves 16-byte vectors when the buffer is 16-byte aligned
// (always for buffers candle allocates), with a scalar tail.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ float gelu_erf(float x) {
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

template <typename T>
__device__ void gelu_inplace(T* __restrict__ x, unsigned long long n) {
    constexpr unsigned VEC = 16 / sizeof(T);
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long vec_end = 0;
    if ((reinterpret_cast<uintptr_t>(x) & 15) == 0) {
        vec_end = n / VEC;
        uint4* xv = reinterpret_cast<uint4*>(x);
        for (unsigned long long i = tid; i < vec_end; i += stride) {
            uint4 raw = xv[i];
            T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
            for (unsigned j = 0; j < VEC; ++j) e[j] = from_f32<T>(gelu_erf(to_f32(e[j])));
            xv[i] = raw;
        }
        vec_end *= VEC;
    }
    for (unsigned long long i = vec_end + tid; i < n; i += stride) {
        x[i] = from_f32<T>(gelu_erf(to_f32(x[i])));
    }
}

extern "C" __global__ void fastpath_gelu_erf_f32(float* x, unsigned long long n) {
    gelu_inplace(x, n);
}
extern "C" __global__ void fastpath_gelu_erf_f16(__half* x, unsigned long long n) {
    gelu_inplace(x, n);
}
extern "C" __global__ void fastpath_gelu_erf_bf16(__nv_bfloat16* x, unsigned long long n) {
    gelu_inplace(x, n);
}

// LayerNorm over the last dim C of `rows` contiguous rows, as torch.nn.LayerNorm computes it:
//   y = (x - mean) / sqrt(var + eps) · w + b,  var the biased (1/C) variance,
// statistics in f32 from values held in registers (mean first, then the centred sum of squares:
// no cancellation from E[x²] - E[x]²). One warp per row, 16-byte vectors; the host guarantees
// C % (16 / sizeof(T)) == 0, C / (16 / sizeof(T)) <= 32 · LN_MAX_CHUNKS and 16-byte alignment.
#define LN_MAX_CHUNKS 8

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <typename T>
__device__ void layer_norm_rows(const T* __restrict__ x, const T* __restrict__ w,
                                const T* __restrict__ b, T* __restrict__ y,
                                unsigned rows, unsigned C, float eps) {
    constexpr unsigned VEC = 16 / sizeof(T);
    const unsigned row = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const unsigned lane = threadIdx.x % 32;
    if (row >= rows) return;
    const unsigned chunks = C / VEC;
    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)row * C);
    float v[LN_MAX_CHUNKS][VEC];
    float sum = 0.f;
#pragma unroll
    for (int t = 0; t < LN_MAX_CHUNKS; ++t) {
        const unsigned c = lane + 32 * t;
        if (c < chunks) {
            uint4 raw = xr[c];
            const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (unsigned j = 0; j < VEC; ++j) {
                v[t][j] = to_f32(e[j]);
                sum += v[t][j];
            }
        }
    }
    const float mean = warp_sum(sum) / (float)C;
    float sq = 0.f;
#pragma unroll
    for (int t = 0; t < LN_MAX_CHUNKS; ++t) {
        if (lane + 32 * t < chunks) {
#pragma unroll
            for (unsigned j = 0; j < VEC; ++j) {
                const float d = v[t][j] - mean;
                sq += d * d;
            }
        }
    }
    const float rstd = 1.0f / sqrtf(warp_sum(sq) / (float)C + eps);
    const uint4* wr = reinterpret_cast<const uint4*>(w);
    const uint4* br = reinterpret_cast<const uint4*>(b);
    uint4* yr = reinterpret_cast<uint4*>(y + (size_t)row * C);
#pragma unroll
    for (int t = 0; t < LN_MAX_CHUNKS; ++t) {
        const unsigned c = lane + 32 * t;
        if (c < chunks) {
            uint4 wraw = wr[c], braw = br[c], out;
            const T* we = reinterpret_cast<const T*>(&wraw);
            const T* be = reinterpret_cast<const T*>(&braw);
            T* oe = reinterpret_cast<T*>(&out);
#pragma unroll
            for (unsigned j = 0; j < VEC; ++j) {
                oe[j] = from_f32<T>((v[t][j] - mean) * rstd * to_f32(we[j]) + to_f32(be[j]));
            }
            yr[c] = out;
        }
    }
}

extern "C" __global__ void fastpath_layer_norm_f32(const float* x, const float* w, const float* b,
                                                   float* y, unsigned rows, unsigned C, float eps) {
    layer_norm_rows(x, w, b, y, rows, C, eps);
}
extern "C" __global__ void fastpath_layer_norm_f16(const __half* x, const __half* w, const __half* b,
                                                   __half* y, unsigned rows, unsigned C, float eps) {
    layer_norm_rows(x, w, b, y, rows, C, eps);
}
extern "C" __global__ void fastpath_layer_norm_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w,
                                                    const __nv_bfloat16* b, __nv_bfloat16* y,
                                                    unsigned rows, unsigned C, float eps) {
    layer_norm_rows(x, w, b, y, rows, C, eps);
}

// Non-overlapping patches as matmul rows (im2col for a stride-p, p×p conv), cast on the way:
//   out[(b·gh + gy)·gw + gx, (c·p + py)·p + px] = pixels[b, c, gy·p + py, gx·p + px]
// for f32 pixels [B, Cin, H, W] (contiguous). One thread per output element: writes coalesced,
// reads in runs of p contiguous floats.
template <typename T>
__device__ void patchify(const float* __restrict__ px, T* __restrict__ out, unsigned long long n,
                         int cin, int h, int w, int p) {
    const int gh = h / p, gw = w / p, k = cin * p * p;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long row = i / k;
        const int col = (int)(i % k);
        const int x0 = col % p, y0 = (col / p) % p, c = col / (p * p);
        const int gx = (int)(row % gw), gy = (int)((row / gw) % gh);
        const unsigned long long b = row / ((unsigned long long)gw * gh);
        const float v = px[((b * cin + c) * h + (gy * p + y0)) * (unsigned long long)w + gx * p + x0];
        out[i] = from_f32<T>(v);
    }
}

extern "C" __global__ void fastpath_patchify_f32(const float* px, float* out, unsigned long long n, int cin,
                                                 int h, int w, int p) {
    patchify(px, out, n, cin, h, w, p);
}
extern "C" __global__ void fastpath_patchify_f16(const float* px, __half* out, unsigned long long n, int cin,
                                                 int h, int w, int p) {
    patchify(px, out, n, cin, h, w, p);
}
extern "C" __global__ void fastpath_patchify_bf16(const float* px, __nv_bfloat16* out, unsigned long long n,
                                                  int cin, int h, int w, int p) {
    patchify(px, out, n, cin, h, w, p);
}

// The log-probability of one class under a small linear classifier, per row:
//   out[r] = log_softmax(x[r]·Wᵀ + b)[cls],  W [K, D], K <= HEAD_MAX_CLASSES,
// the logits summed in f32 and rounded to T (as a T matmul with a bias epilogue stores them),
// the log-softmax in f32. One warp per row; x rows may be strided (ldx elements apart).
// (DynamicViT's keep score: Linear(C/4, 2), LogSoftmax, column 0 — one kernel instead of a
// matmul, a cast and the six passes of a log-softmax over two columns.)
#define HEAD_MAX_CLASSES 8

template <typename T>
__device__ void linear_log_prob_rows(const T* __restrict__ x, const T* __restrict__ w,
                                     const T* __restrict__ b, float* __restrict__ out,
                                     unsigned rows, unsigned long long ldx, int D, int K, int cls) {
    const unsigned row = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const unsigned lane = threadIdx.x % 32;
    if (row >= rows) return;
    const T* xr = x + (unsigned long long)row * ldx;
    float acc[HEAD_MAX_CLASSES];
#pragma unroll
    for (int j = 0; j < HEAD_MAX_CLASSES; ++j) acc[j] = 0.f;
    for (int i = lane; i < D; i += 32) {
        const float xv = to_f32(xr[i]);
#pragma unroll
        for (int j = 0; j < HEAD_MAX_CLASSES; ++j)
            if (j < K) acc[j] = fmaf(xv, to_f32(w[j * D + i]), acc[j]);
    }
    float m = __int_as_float(0xff800000);  // -inf
#pragma unroll
    for (int j = 0; j < HEAD_MAX_CLASSES; ++j) {
        if (j < K) {
            acc[j] = to_f32(from_f32<T>(warp_sum(acc[j]) + to_f32(b[j])));
            m = fmaxf(m, acc[j]);
        }
    }
    float s = 0.f, z = 0.f;
#pragma unroll
    for (int j = 0; j < HEAD_MAX_CLASSES; ++j) {
        if (j < K) s += expf(acc[j] - m);
        if (j == cls) z = acc[j];
    }
    if (lane == 0) out[row] = (z - m) - logf(s);
}

extern "C" __global__ void fastpath_linear_log_prob_f32(const float* x, const float* w, const float* b,
                                                        float* out, unsigned rows, unsigned long long ldx,
                                                        int D, int K, int cls) {
    linear_log_prob_rows(x, w, b, out, rows, ldx, D, K, cls);
}
extern "C" __global__ void fastpath_linear_log_prob_f16(const __half* x, const __half* w, const __half* b,
                                                        float* out, unsigned rows, unsigned long long ldx,
                                                        int D, int K, int cls) {
    linear_log_prob_rows(x, w, b, out, rows, ldx, D, K, cls);
}
extern "C" __global__ void fastpath_linear_log_prob_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w,
                                                         const __nv_bfloat16* b, float* out, unsigned rows,
                                                         unsigned long long ldx, int D, int K, int cls) {
    linear_log_prob_rows(x, w, b, out, rows, ldx, D, K, cls);
}

// ---------------------------------------------------------------------------------------------
// Small-row linear: y[M, N] = epilogue(x[M, K] · W[N, K]ᵀ + b) for f16 / bf16 with f32
// accumulation, the bias, GELU and residual applied to the f32 sum before the one rounding.
//
// Why: at a ViT's batch 1 (197 rows) every cuBLASLt call costs 4.0–4.7 µs back to back whatever
// algorithm it runs (all eight heuristic candidates timed on the H100), and the exact GELU then
// needs a kernel of its own. This one is a plain tensor-core tile loop whose fixed cost is one
// short pipeline fill, with the GELU in its epilogue.
//
// Tiling: a block of 4 warps owns SG_BM = 32 rows × SG_BN = 64 output features; warp w computes
// all 32 rows × features [16w, 16w + 16) with mma.sync.m16n8k16 (two m-tiles × two n-tiles).
// K is walked in SG_BK = 64 slices through an SG_STAGES-deep cp.async ring in dynamic shared
// memory (55 KB; rows padded by 8 elements so ldmatrix reads are conflict-free); rows past M,
// features past N and slices past K are zero-filled, so no fragment ever reads garbage. At these
// sizes a block's time is the latency of its loads, so the bias and residual values the
// epilogue needs are loaded into registers before the K loop, behind the first slices.
// The host guarantees: K % 8 == 0, N % 2 == 0, 16-byte aligned x (row stride ldx % 8 == 0) and W,
// 4-byte aligned out / bias / residual.
#define SG_BM 32
#define SG_BN 64
#define SG_BK 64
#define SG_STAGES 4
#define SG_PAD 8
#define SG_LD (SG_BK + SG_PAD)

__device__ __forceinline__ uint32_t sg_smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void sg_cp_async_16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sg_smem_addr(dst)),
                 "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void sg_ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(sg_smem_addr(p)));
}
__device__ __forceinline__ void sg_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1, __half) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void sg_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1, __nv_bfloat16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Epilogue kinds (SmallGemmEpilogue on the host).
#define SG_PLAIN 0
#define SG_GELU 1
#define SG_RESIDUAL 2
#define SG_RESIDUAL_GELU 3

template <typename T>
__device__ void small_gemm(const T* __restrict__ x, const T* __restrict__ w,
                           const T* __restrict__ bias, const T* __restrict__ residual,
                           T* __restrict__ out, unsigned M, unsigned N, unsigned K,
                           unsigned ldx, int kind) {
    extern __shared__ __align__(16) unsigned char sg_smem[];
    auto xs = reinterpret_cast<T(*)[SG_BM][SG_LD]>(sg_smem);
    auto ws = reinterpret_cast<T(*)[SG_BN][SG_LD]>(sg_smem + sizeof(T) * SG_STAGES * SG_BM * SG_LD);
    const unsigned tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const unsigned m0 = blockIdx.y * SG_BM, n0 = blockIdx.x * SG_BN;
    const unsigned slices = (K + SG_BK - 1) / SG_BK;

    auto load = [&](unsigned slice, unsigned stage) {
        const unsigned k0 = slice * SG_BK;
#pragma unroll
        for (unsigned i = 0; i < (SG_BM * SG_BK / 8) / 128; ++i) {
            const unsigned c = tid + i * 128, r = c / (SG_BK / 8), kc = (c % (SG_BK / 8)) * 8;
            const bool ok = m0 + r < M && k0 + kc < K;
            sg_cp_async_16(&xs[stage][r][kc], ok ? x + (size_t)(m0 + r) * ldx + k0 + kc : x, ok);
        }
#pragma unroll
        for (unsigned i = 0; i < (SG_BN * SG_BK / 8) / 128; ++i) {
            const unsigned c = tid + i * 128, r = c / (SG_BK / 8), kc = (c % (SG_BK / 8)) * 8;
            const bool ok = n0 + r < N && k0 + kc < K;
            sg_cp_async_16(&ws[stage][r][kc], ok ? w + (size_t)(n0 + r) * K + k0 + kc : w, ok);
        }
    };

    float acc[2][2][4] = {};
#pragma unroll
    for (unsigned s = 0; s < SG_STAGES - 1; ++s) {
        if (s < slices) load(s, s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    // The epilogue's operands, requested now so their latency hides behind the K loop.
    const unsigned g = lane / 4, t = lane % 4;
    float bias_v[2][2];
    uint32_t res_v[2][2][2];
#pragma unroll
    for (unsigned ni = 0; ni < 2; ++ni) {
        const unsigned col = n0 + warp * 16 + ni * 8 + 2 * t;
        const bool col_ok = col < N;  // N is even: col < N means col + 1 < N too
        bias_v[ni][0] = bias && col_ok ? to_f32(bias[col]) : 0.f;
        bias_v[ni][1] = bias && col_ok ? to_f32(bias[col + 1]) : 0.f;
#pragma unroll
        for (unsigned mi = 0; mi < 2; ++mi)
#pragma unroll
            for (unsigned h = 0; h < 2; ++h) {
                const unsigned row = m0 + mi * 16 + g + h * 8;
                res_v[mi][ni][h] = kind >= SG_RESIDUAL && col_ok && row < M
                    ? *reinterpret_cast<const uint32_t*>(residual + (size_t)row * N + col)
                    : 0u;
            }
    }
    for (unsigned slice = 0; slice < slices; ++slice) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(SG_STAGES - 2));
        // Every warp is done with the stage the next prefetch overwrites (read one slice ago).
        __syncthreads();
        const unsigned next = slice + SG_STAGES - 1;
        if (next < slices) load(next, next % SG_STAGES);
        asm volatile("cp.async.commit_group;\n" ::);
        const unsigned st = slice % SG_STAGES;
#pragma unroll
        for (unsigned kk = 0; kk < SG_BK; kk += 16) {
            uint32_t a[2][4], b[4];
#pragma unroll
            for (unsigned mi = 0; mi < 2; ++mi)
                sg_ldmatrix_x4(a[mi], &xs[st][mi * 16 + lane % 16][kk + (lane / 16) * 8]);
            // Matrices: (features 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15).
            sg_ldmatrix_x4(b, &ws[st][warp * 16 + (lane / 16) * 8 + lane % 8]
                                  [kk + ((lane / 8) % 2) * 8]);
#pragma unroll
            for (unsigned mi = 0; mi < 2; ++mi) {
                sg_mma(acc[mi][0], a[mi], b[0], b[1], T());
                sg_mma(acc[mi][1], a[mi], b[2], b[3], T());
            }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);

#pragma unroll
    for (unsigned ni = 0; ni < 2; ++ni) {
        const unsigned col = n0 + warp * 16 + ni * 8 + 2 * t;
        if (col >= N) continue;
#pragma unroll
        for (unsigned mi = 0; mi < 2; ++mi) {
#pragma unroll
            for (unsigned h = 0; h < 2; ++h) {
                const unsigned row = m0 + mi * 16 + g + h * 8;
                if (row >= M) continue;
                float v0 = acc[mi][ni][2 * h] + bias_v[ni][0];
                float v1 = acc[mi][ni][2 * h + 1] + bias_v[ni][1];
                if (kind >= SG_RESIDUAL) {
                    const T* r = reinterpret_cast<const T*>(&res_v[mi][ni][h]);
                    v0 += to_f32(r[0]);
                    v1 += to_f32(r[1]);
                }
                if (kind == SG_GELU || kind == SG_RESIDUAL_GELU) {
                    v0 = gelu_erf(v0);
                    v1 = gelu_erf(v1);
                }
                T pair[2] = {from_f32<T>(v0), from_f32<T>(v1)};
                *reinterpret_cast<uint32_t*>(out + (size_t)row * N + col) =
                    *reinterpret_cast<uint32_t*>(pair);
            }
        }
    }
}

#define SMALL_GEMM_ENTRY(NAME, T)                                                               \
    extern "C" __global__ void __launch_bounds__(128)                                           \
        NAME(const T* x, const T* w, const T* bias, const T* residual, T* out, unsigned M,       \
             unsigned N, unsigned K, unsigned ldx, int kind) {                                  \
        small_gemm<T>(x, w, bias, residual, out, M, N, K, ldx, kind);                           \
    }
SMALL_GEMM_ENTRY(fastpath_small_linear_f16, __half)
SMALL_GEMM_ENTRY(fastpath_small_linear_bf16, __nv_bfloat16)
