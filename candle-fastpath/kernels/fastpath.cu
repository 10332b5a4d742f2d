// Exact GELU applied in place, the activation timm's ViT/DeiT MLP uses, computed in f32 for
// every storage type, in one of two forms (the host picks the kernel):
//   fastpath_gelu_erf_*: gelu(x) = 0.5 · x · (1 + erf(x / √2));
//   fastpath_gelu_phi_*: gelu(x) = x · Φ(x) through the normal tail (gelu_phi.cuh: more accurate
//   for negative x, and fewer instructions).
// It runs right after the fc1 cuBLASLt call (bias already added in its epilogue) on the
// buffer that call wrote; cuBLASLt's own GELU epilogue is the tanh approximation, which would
// not match timm's nn.GELU().
//
// Bandwidth-bound: each thread moves 16-byte vectors when the buffer is 16-byte aligned
// (always for buffers candle allocates), with a scalar tail.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <type_traits>

#include "dependent_launch.cuh"
#include "epilogue.cuh"
#include "gelu_phi.cuh"
#include "layer_norm_row.cuh"
// candle-ragged's warp-level attention (its build metadata puts the folder on the include path):
// attention_residual_norm_linear runs the same online softmax inside its cluster.
#include "attention_warp.cuh"
#include "row_norm.cuh"
#include "select_common.cuh"

struct GeluErf {
    __device__ __forceinline__ float operator()(float x) const {
        return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    }
};
struct GeluPhi {
    __device__ __forceinline__ float operator()(float x) const { return gelu_phi(x); }
};

template <typename Gelu, typename T>
__device__ void gelu_inplace(T* __restrict__ x, unsigned long long n) {
    const Gelu gelu;
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
            for (unsigned j = 0; j < VEC; ++j) e[j] = from_f32<T>(gelu(to_f32(e[j])));
            xv[i] = raw;
        }
        vec_end *= VEC;
    }
    for (unsigned long long i = vec_end + tid; i < n; i += stride) {
        x[i] = from_f32<T>(gelu(to_f32(x[i])));
    }
}

// Holds the GPU for `ns` nanoseconds (one thread of one block): FusedLinear's autotuning (lever
// 79) queues the launches it times behind it, so that its CUDA events measure the kernels and
// not the rate at which the host can launch them.
extern "C" __global__ void fastpath_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

// One entry per form and storage type, named as the Rust side's GELU_NAMES table expects.
#define GELU_ENTRY(FORM, Functor, SUFFIX, T)                                                    \
    extern "C" __global__ void fastpath_gelu_##FORM##_##SUFFIX(T* x, unsigned long long n) {    \
        gelu_inplace<Functor>(x, n);                                                            \
    }
GELU_ENTRY(erf, GeluErf, f32, float)
GELU_ENTRY(erf, GeluErf, f16, __half)
GELU_ENTRY(erf, GeluErf, bf16, __nv_bfloat16)
GELU_ENTRY(phi, GeluPhi, f32, float)
GELU_ENTRY(phi, GeluPhi, f16, __half)
GELU_ENTRY(phi, GeluPhi, bf16, __nv_bfloat16)

// LayerNorm over the last dim C of `rows` contiguous rows, as torch.nn.LayerNorm computes it:
//   y = (x - mean) / sqrt(var + eps) · w + b,  var the biased (1/C) variance,
// statistics in f32 from values held in registers (mean first, then the centred sum of squares:
// no cancellation from E[x²] - E[x]²). One warp per row, 16-byte vectors; the host guarantees
// C % (16 / sizeof(T)) == 0, C / (16 / sizeof(T)) <= 32 · CHUNKS and 16-byte alignment.
//
// CHUNKS (16-byte vectors per lane) is a template parameter with one kernel per size class
// (1, 2, 4, 8; the host takes the smallest that holds C): the row lives in registers, so the
// class sets the register count and with it how many rows an SM keeps in flight. With one
// 8-chunk kernel for every C, DeiT-S's C = 384 (2 chunks per lane in f16) needed 95 registers per
// thread, ~21 resident warps per SM, too few loads in flight to stream HBM.

template <int LN_MAX_CHUNKS, typename T>
__device__ void layer_norm_rows(const T* __restrict__ x, const T* __restrict__ w,
                                const T* __restrict__ b, T* __restrict__ y,
                                unsigned rows, unsigned C, float eps) {
    constexpr unsigned VEC = 16 / sizeof(T);
    const unsigned row = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const unsigned lane = threadIdx.x % 32;
    // A kernel with a programmatic edge from this one (a thin GEMM after norm1 / norm2) may be
    // scheduled now: it asks for its weights while these rows are normalised, and waits in
    // griddepcontrol.wait for them (dependent_launch.cuh).
    dl_launch_dependents();
    if (row >= rows) return;
    const unsigned chunks = C / VEC;
    // The weight and bias chunks are requested first, beside the row: they do not depend on the
    // statistics, and loaded after them (where they are used) they cost one more L2 round trip
    // behind the two reductions, and another after the first chunk's store. At batch 1 a
    // LayerNorm is all latency (DeiT-S: 25 per forward, ~4 µs each; lever 50).
    uint4 wraw[LN_MAX_CHUNKS], braw[LN_MAX_CHUNKS];
    layer_norm_params<LN_MAX_CHUNKS>(w, b, wraw, braw, chunks, lane);
    layer_norm_warp_row<LN_MAX_CHUNKS, T>(reinterpret_cast<const uint4*>(x + (size_t)row * C),
                                          reinterpret_cast<uint4*>(y + (size_t)row * C), wraw, braw, chunks, C,
                                          eps, lane);
}

// One entry per size class and storage type, named as the Rust side's LN_NAMES table expects.
#define LAYER_NORM_ENTRY(CHUNKS, SUFFIX, T)                                                     \
    extern "C" __global__ void fastpath_layer_norm_##SUFFIX##_c##CHUNKS(                          \
        const T* x, const T* w, const T* b, T* y, unsigned rows, unsigned C, float eps) {         \
        layer_norm_rows<CHUNKS>(x, w, b, y, rows, C, eps);                                        \
    }
#define LAYER_NORM_ENTRIES(CHUNKS)                                                              \
    LAYER_NORM_ENTRY(CHUNKS, f32, float)                                                        \
    LAYER_NORM_ENTRY(CHUNKS, f16, __half)                                                       \
    LAYER_NORM_ENTRY(CHUNKS, bf16, __nv_bfloat16)
LAYER_NORM_ENTRIES(1)
LAYER_NORM_ENTRIES(2)
LAYER_NORM_ENTRIES(4)
LAYER_NORM_ENTRIES(8)

// Rows of at most MAX_CHUNKS vectors with a row to each group of G lanes (layer_norm_group_row:
// the same bits as the one-warp kernels above), at most three vectors a lane: g8 for rows of up
// to 24 vectors (C ≤ 192 in 16-bit storage, ≤ 96 in f32), g16 up to 48 (C ≤ 384 / 192).
template <int CHUNKS, int G, int MAX_CHUNKS, typename T>
__device__ void layer_norm_group_rows(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                      T* __restrict__ y, unsigned rows, unsigned C, float eps) {
    constexpr unsigned VEC = 16 / sizeof(T);
    const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned row = t / G;
    const bool valid = row < rows;
    // A warp whose groups are all past the end leaves together (no shuffle is split).
    if ((t & ~31u) / G >= rows) return;
    const size_t at = valid ? (size_t)row * C : 0;
    layer_norm_group_row<CHUNKS, G, MAX_CHUNKS, T>(reinterpret_cast<const uint4*>(x + at), reinterpret_cast<uint4*>(y + at), w,
                                       b, C / VEC, C, eps, threadIdx.x % G, valid);
}
#define LAYER_NORM_GROUP_ENTRY(CHUNKS, G, MAXC, SUFFIX, T)                                            \
    extern "C" __global__ void fastpath_layer_norm_##SUFFIX##_g##G(const T* x, const T* w, const T* b, T* y, \
                                                                 unsigned rows, unsigned C, float eps) { \
        layer_norm_group_rows<CHUNKS, G, MAXC>(x, w, b, y, rows, C, eps);                               \
    }
#define LAYER_NORM_GROUP_ENTRIES(CHUNKS, G, MAXC)                                               \
    LAYER_NORM_GROUP_ENTRY(CHUNKS, G, MAXC, f32, float)                                         \
    LAYER_NORM_GROUP_ENTRY(CHUNKS, G, MAXC, f16, __half)                                        \
    LAYER_NORM_GROUP_ENTRY(CHUNKS, G, MAXC, bf16, __nv_bfloat16)
LAYER_NORM_GROUP_ENTRIES(1, 8, 24)
LAYER_NORM_GROUP_ENTRIES(2, 16, 48)

// Non-overlapping patches as matmul rows (im2col for a stride-p, p×p conv), cast on the way:
//   out[b·(L + gh·gw) + L + gy·gw + gx, (c·p + py)·p + px] = pixels[b, c, gy·p + py, gx·p + px]
// for pixels [B, Cin, H, W] (contiguous; H and W multiples of p, checked on the host) in f32 or
// in the output's 16-bit type (a caller that already holds f16 images, as timm's half-precision
// models take them: half the bytes to read; lever 114), and
// each image's L leading rows zero (L = 0 for plain patch rows; L = the class / distillation
// rows when the patch GEMM runs over a whole sequence's rows, lever 67: their x is then the
// residual operand plus the bias alone).
// Threads walk the pixels in their own order, V at a time (V = 4 when p, W and both pointers
// allow 16-byte loads, else 1): a warp's loads are one contiguous 512-byte span, and its stores
// land as p·sizeof(T)-byte runs (4 threads per run of 16), whole sectors both ways. The previous
// mapping (one thread per run, in output order) had a warp's loads 32 image rows apart, 16 bytes
// of each 32-byte sector per instruction: 204 µs at DeiT's batch 256 against a 77 µs floor.
// Index arithmetic is 32-bit when the element count fits (one divide chain per V pixels).
template <typename P, typename T, typename I, int V>
__device__ void patchify_walk(const P* __restrict__ px, T* __restrict__ out, I items, I cin, I h,
                              I w, I p, I lead) {
    const I wv = w / V, gh = h / p, gw = w / p, cols = cin * p * p;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < items; i += (I)gridDim.x * blockDim.x) {
        const I xv = i % wv, row = i / wv;  // row = (b·cin + c)·h + y
        const I y = row % h, bc = row / h;
        const I c = bc % cin, b = bc / cin;
        const I x = xv * V;
        const I gx = x / p, pxl = x % p, gy = y / p, py = y % p;
        T* dst = out + (b * (lead + gh * gw) + lead + gy * gw + gx) * cols + (c * p + py) * p + pxl;
        if constexpr (V == 4 && sizeof(P) == 2) {
            // 16-bit pixels of the output's type: 8 bytes in, the same 8 bytes out.
            *reinterpret_cast<uint2*>(dst) = reinterpret_cast<const uint2*>(px)[i];
        } else if constexpr (V == 4) {
            const float4 v = reinterpret_cast<const float4*>(px)[i];
            if constexpr (sizeof(T) == 4) {
                *reinterpret_cast<float4*>(dst) = v;
            } else {
                alignas(8) T e[4] = {from_f32<T>(v.x), from_f32<T>(v.y), from_f32<T>(v.z), from_f32<T>(v.w)};
                *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(e);
            }
        } else {
            *dst = from_f32<T>(to_f32(px[i]));
        }
    }
}

// n: the pixel count (B·Cin·H·W); lead: the zero rows in front of each image's patch rows.
template <typename P, typename T>
__device__ void patchify(const P* __restrict__ px, T* __restrict__ out, unsigned long long n,
                         int cin, int h, int w, int p, int lead) {
    // patchify_walk copies 16-bit pixels as they are: only into rows of their own type.
    static_assert(sizeof(P) == 4 || std::is_same<P, T>::value, "16-bit pixels must be the rows' type");
    // Uniform across the grid: every thread takes the same branch.
    const bool vec = p % 4 == 0 && w % 4 == 0 && (reinterpret_cast<uintptr_t>(px) & (4 * sizeof(P) - 1)) == 0 &&
                     (reinterpret_cast<uintptr_t>(out) & (4 * sizeof(T) - 1)) == 0;
    const unsigned long long items = vec ? n / 4 : n;
    // The output holds n + B·lead·cols elements: 32-bit indices while that and every grid-stride
    // step stay under 2^32: under 2^31 (the stride, at most a few million threads, cannot wrap
    // past it).
    const unsigned long long cols = (unsigned long long)cin * p * p;
    const unsigned long long images = n / ((unsigned long long)cin * h * w);
    const unsigned long long zeros = images * lead * cols;
    if (n + zeros < (1ull << 31)) {
        if (vec) patchify_walk<P, T, unsigned, 4>(px, out, (unsigned)items, cin, h, w, p, lead);
        else patchify_walk<P, T, unsigned, 1>(px, out, (unsigned)items, cin, h, w, p, lead);
    } else {
        using U = unsigned long long;
        if (vec) patchify_walk<P, T, U, 4>(px, out, items, cin, h, w, p, lead);
        else patchify_walk<P, T, U, 1>(px, out, items, cin, h, w, p, lead);
    }
    // The leading rows: lead·cols zeros at the start of each image's rows.
    const unsigned long long per_image = (unsigned long long)lead * cols;
    const unsigned long long image_rows = lead + (unsigned long long)(h / p) * (w / p);
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < zeros;
         i += (unsigned long long)gridDim.x * blockDim.x)
        out[(i / per_image) * image_rows * cols + i % per_image] = from_f32<T>(0.f);
}

extern "C" __global__ void fastpath_patchify_f32(const float* px, float* out, unsigned long long n, int cin,
                                                 int h, int w, int p, int lead) {
    patchify(px, out, n, cin, h, w, p, lead);
}
extern "C" __global__ void fastpath_patchify_f16(const float* px, __half* out, unsigned long long n, int cin,
                                                 int h, int w, int p, int lead) {
    patchify(px, out, n, cin, h, w, p, lead);
}
extern "C" __global__ void fastpath_patchify_bf16(const float* px, __nv_bfloat16* out, unsigned long long n,
                                                  int cin, int h, int w, int p, int lead) {
    patchify(px, out, n, cin, h, w, p, lead);
}
// Pixels already in the output's 16-bit type.
extern "C" __global__ void fastpath_patchify_f16_from_f16(const __half* px, __half* out, unsigned long long n,
                                                          int cin, int h, int w, int p, int lead) {
    patchify(px, out, n, cin, h, w, p, lead);
}
extern "C" __global__ void fastpath_patchify_bf16_from_bf16(const __nv_bfloat16* px, __nv_bfloat16* out,
                                                            unsigned long long n, int cin, int h, int w, int p,
                                                            int lead) {
    patchify(px, out, n, cin, h, w, p, lead);
}

// The tokens entering a ViT's first block, in one pass:
//   out[b, i, :] = (i < P ? prefix[i, :] : patches[b, i − P, :]) + pos[i, :]
// for patches [B, N − P, C], prefix [P, C] (the class / distillation tokens), pos [N, C], all
// contiguous; out [B, N, C]. The sum is rounded once from f32, as candle's own add does, so the
// result is bit-for-bit that of cat + broadcast_add (two copies and a strided broadcast kernel
// before, ~0.5 ms at DeiT-S batch 256). One warp per output row, 16-byte vectors when C and
// every pointer allow (`vec`), else one element per lane.
template <typename T>
__device__ void embed_tokens(const T* __restrict__ patches, const T* __restrict__ prefix,
                             const T* __restrict__ pos, T* __restrict__ out, unsigned rows,
                             unsigned n, unsigned p, unsigned C, int vec) {
    constexpr unsigned VEC = 16 / sizeof(T);
    const unsigned lane = threadIdx.x % 32;
    for (unsigned row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < rows;
         row += gridDim.x * (blockDim.x / 32)) {
        const unsigned i = row % n, b = row / n;
        const T* src = i < p ? prefix + (size_t)i * C : patches + ((size_t)b * (n - p) + (i - p)) * C;
        const T* pe = pos + (size_t)i * C;
        T* dst = out + (size_t)row * C;
        if (vec) {
            for (unsigned v = lane; v < C / VEC; v += 32) {
                uint4 a = reinterpret_cast<const uint4*>(src)[v];
                const uint4 e = reinterpret_cast<const uint4*>(pe)[v];
                T* ae = reinterpret_cast<T*>(&a);
                const T* ee = reinterpret_cast<const T*>(&e);
#pragma unroll
                for (unsigned j = 0; j < VEC; ++j) ae[j] = from_f32<T>(to_f32(ae[j]) + to_f32(ee[j]));
                reinterpret_cast<uint4*>(dst)[v] = a;
            }
        } else {
            for (unsigned c = lane; c < C; c += 32) dst[c] = from_f32<T>(to_f32(src[c]) + to_f32(pe[c]));
        }
    }
}

extern "C" __global__ void fastpath_embed_tokens_f32(const float* patches, const float* prefix,
                                                     const float* pos, float* out, unsigned rows,
                                                     unsigned n, unsigned p, unsigned C, int vec) {
    embed_tokens(patches, prefix, pos, out, rows, n, p, C, vec);
}
extern "C" __global__ void fastpath_embed_tokens_f16(const __half* patches, const __half* prefix,
                                                     const __half* pos, __half* out, unsigned rows,
                                                     unsigned n, unsigned p, unsigned C, int vec) {
    embed_tokens(patches, prefix, pos, out, rows, n, p, C, vec);
}
extern "C" __global__ void fastpath_embed_tokens_bf16(const __nv_bfloat16* patches,
                                                      const __nv_bfloat16* prefix,
                                                      const __nv_bfloat16* pos, __nv_bfloat16* out,
                                                      unsigned rows, unsigned n, unsigned p,
                                                      unsigned C, int vec) {
    embed_tokens(patches, prefix, pos, out, rows, n, p, C, vec);
}

// The log-probability of one class under a small linear classifier, per row:
//   out[r] = log_softmax(x[r]·Wᵀ + b)[cls],  W [K, D], K <= HEAD_MAX_CLASSES,
// the logits summed in f32 and rounded to T (as a T matmul with a bias epilogue stores them),
// the log-softmax in f32. One warp per row; x rows may be strided (ldx elements apart).
// (DynamicViT's keep score: Linear(C/4, 2), LogSoftmax, column 0 — one kernel instead of a
// matmul, a cast and the six passes of a log-softmax over two columns.)
#define HEAD_MAX_CLASSES 8

// The f32 log-probability of class `cls` of one row `x` (D elements, read with lane stride 32)
// under W [K, D], b [K]: one warp, every lane returns it. Shared by linear_log_prob and the
// pooled head's tail, so both give the same bits for the same row.
template <typename T>
__device__ __forceinline__ float row_log_prob(const T* x, const T* __restrict__ w, const T* __restrict__ b, int D,
                                              int K, int cls) {
    const unsigned lane = threadIdx.x % 32;
    float acc[HEAD_MAX_CLASSES];
#pragma unroll
    for (int j = 0; j < HEAD_MAX_CLASSES; ++j) acc[j] = 0.f;
    for (int i = lane; i < D; i += 32) {
        const float xv = to_f32(x[i]);
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
    return (z - m) - logf(s);
}

template <typename T>
__device__ void linear_log_prob_rows(const T* __restrict__ x, const T* __restrict__ w,
                                     const T* __restrict__ b, float* __restrict__ out,
                                     unsigned rows, unsigned long long ldx, int D, int K, int cls) {
    const unsigned row = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const unsigned lane = threadIdx.x % 32;
    if (row >= rows) return;
    const float lp = row_log_prob<T>(x + (unsigned long long)row * ldx, w, b, D, K, cls);
    if (lane == 0) out[row] = lp;
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
// norm_linear: y = LayerNorm(x) Wᵀ + b, optionally followed by the exact GELU (x·Φ(x)), in one
// launch, for the few-hundred-row problems of a ViT block at batch 1 (lever 58 in
// docs/LEVERS.md; its standalone probe is scripts/gpu/probes/ln_linear.cu). At batch 1 the
// LayerNorm and the GELU pass are each a launch of ~1.5–2 µs of latency in a CUDA graph's chain,
// for a few hundred KB of work; here they cost ~0.5–1 µs inside the GEMM.
//
// One CTA per NL_BM × NL_BN output tile, NL_WARPS warps:
//   1. all threads issue cp.async for the tile's NL_BM input rows (whole: K = C) and its NL_BN
//      weight rows into shared memory (rows padded by 16 bytes, so ldmatrix rows fall in
//      distinct banks; rows past M or N are zero-filled), then load the LayerNorm's parameters
//      and this thread's bias pair;
//   2. once the input rows have landed, one warp per row normalises them in place with
//      layer_norm_rows' arithmetic and lane order (the normalised rows are its output bit for
//      bit), while the weight rows are still arriving;
//   3. the first NL_BM / 16 · NL_BN / 32 warps run mma.sync m16n8k16 (f32 accumulation) over
//      K, 16 rows × 32 columns each; the others leave;
//   4. bias, rounding to the storage type, then (GELU) x·Φ(x) of that rounded value, rounded
//      again: what cuBLASLt's bias epilogue followed by the GELU pass computes.
// Many warps matter: the LayerNorm is a dependent chain of shuffles per row, and with 4 warps
// per CTA it cost +5 µs (the probe's ncu). The host (norm_linear in candle-fastpath) launches it
// only when the grid fits one wave and C is one of the widths below: at C = 384 and up the
// kernel's whole-row loads make its GEMM slower than cuBLASLt's (the probe's table).
constexpr int NL_BM = 16, NL_BN = 128, NL_WARPS = 16;

__device__ __forceinline__ void nl_cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0)
                 : "memory");
}

// cp.async of rows row0.. row0 + ROWS - 1 of `src` (K elements each, contiguous) into shared rows
// of K + 8 elements (16-byte padding: ldmatrix rows in distinct banks); rows at or past `limit`
// are zero-filled and read nothing. All NL_WARPS · 32 threads take part.
template <typename T, int K, int ROWS>
__device__ __forceinline__ void nl_stage_rows(T* dst, const T* __restrict__ src, int row0, int limit) {
    constexpr int VECS = K / 8, LD = K + 8;
    for (int i = threadIdx.x; i < ROWS * VECS; i += NL_WARPS * 32) {
        const int r = i / VECS, c = i % VECS;
        const bool ok = row0 + r < limit;
        nl_cp_async16(dst + r * LD + c * 8, src + (size_t)(ok ? row0 + r : 0) * K + c * 8, ok);
    }
}

__device__ __forceinline__ void nl_ldmatrix_x4(unsigned* r, const void* p) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

template <typename T> __device__ __forceinline__ void nl_mma(float* c, const unsigned* a, unsigned b0, unsigned b1);
template <> __device__ __forceinline__ void nl_mma<__half>(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void nl_mma<__nv_bfloat16>(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc[j] (the m16n8 accumulator of columns 8j..8j+7, j < 2·NG) += A · Bᵀ for one warp, A the 16
// rows at `a` and B the 16·NG rows at `b` (K elements each, row stride LDS elements, in shared
// memory): per 16-wide step, A's fragment and NG ldmatrix of B, then the 2·NG MMAs.
template <typename T, int K, int LDS, int NG>
__device__ __forceinline__ void nl_warp_mma_16xn(float (&acc)[2 * NG][4], const T* a, const T* b) {
    const unsigned lane = threadIdx.x % 32;
    const T* a_base = a + (lane % 16) * LDS + (lane / 16) * 8;
    const T* b_base = b + ((lane % 8) + (lane / 16) * 8) * LDS + ((lane / 8) % 2) * 8;
#pragma unroll 4
    for (int k0 = 0; k0 < K; k0 += 16) {
        unsigned ra[4], rb[4 * NG];
        nl_ldmatrix_x4(ra, a_base + k0);
#pragma unroll
        for (int g = 0; g < NG; ++g) nl_ldmatrix_x4(rb + 4 * g, b_base + g * 16 * LDS + k0);
#pragma unroll
        for (int j = 0; j < 2 * NG; ++j) nl_mma<T>(acc[j], ra, rb[2 * j], rb[2 * j + 1]);
    }
}

// The 16 × 32 slice most tiles here take: nl_warp_mma_16xn with two groups of weight rows.
template <typename T, int K, int LDS>
__device__ __forceinline__ void nl_warp_mma_16x32(float (&acc)[4][4], const T* a, const T* b) {
    nl_warp_mma_16xn<T, K, LDS, 2>(acc, a, b);
}

// The NL_BM rows of K elements at `rows` (shared memory, LDS elements apart) normalised in place,
// one warp per row (the first NL_BM warps; NL_BM <= NL_WARPS): the LayerNorm kernel's own row
// code, so the rows are its output bit for bit. `wraw` / `braw`: the LayerNorm's parameters as
// layer_norm_params loads them.
// ROWS > NL_WARPS (the 64-row tile of norm_linear): warp w takes rows w, w + NL_WARPS, ...
template <int CHUNKS, typename T, int K, int LDS, int ROWS = NL_BM>
__device__ __forceinline__ void nl_normalize_rows(T* rows, const uint4 (&wraw)[CHUNKS], const uint4 (&braw)[CHUNKS],
                                                  float eps) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int r = warp; r < ROWS; r += NL_WARPS) {
        uint4* row = reinterpret_cast<uint4*>(rows + r * LDS);
        layer_norm_warp_row<CHUNKS, T>(row, row, wraw, braw, K / 8, K, eps, lane);
    }
}

// Each row's L2 norm (f32) of the NL_BM rows `rows` (K wide, LDS apart, the storage type's rounded
// values) into norms[m0 + row] for rows below M, one warp per row, by candle-ragged's row-norm
// arithmetic (row_norm.cuh, as its select kernels score rows for Threshold-L2): lane l takes the
// 8 elements of its 16-byte chunk [8l, 8l + 8) (K = 192: lanes 24-31 hold 0). So a step that
// ranks these values keeps exactly the tokens the select kernel's own norms keep (lever 77).
template <typename T, int K, int LDS>
__device__ __forceinline__ void nl_row_norms(const T* rows, float* __restrict__ norms, int m0, int M) {
    static_assert(K % 8 == 0 && K <= 256, "one 16-byte chunk per lane");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp >= NL_BM) return;
    float acc = 0.f;
    if (lane * 8 < K) {
        const uint4 raw = *reinterpret_cast<const uint4*>(rows + warp * LDS + lane * 8);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc = row_norm_sq_add(to_f32(e[i]), acc);
    }
    acc = row_norm_lane_sum(acc);
    if (lane == 0 && m0 + warp < M) norms[m0 + warp] = row_norm_sqrt(acc);
}

// x [M, K], ln_w / ln_b [K], w [N, K], bias [N], y [M, N]; all contiguous and 16-byte aligned,
// N even (checked on the host). Grid (ceil(N / NL_BN), ceil(M / BM)), NL_WARPS · 32 threads,
// (BM + NL_BN) · (K + 8) · sizeof(T) bytes of dynamic shared memory.
// BM = NL_BM (16 rows) is lever 58's tile, for grids of one wave at one CTA per SM. BM = 64
// (lever 81) is for a few thousand rows (DeiT-T at batch 8: 1,576): a quarter of the CTAs, each
// staging its 128 weight rows once for 64 input rows, every warp normalising four rows and then
// running one 16 × 32 slice of the MMA; two CTAs fit per SM.
template <typename T, int K, int BM, bool GELU>
__device__ void norm_linear_tile(const T* __restrict__ x, const T* __restrict__ ln_w, const T* __restrict__ ln_b,
                                 const T* __restrict__ w, const T* __restrict__ bias, T* __restrict__ y, int M, int N,
                                 float eps) {
    constexpr int LDS = K + 8, VECS = K / 8, CHUNKS = (VECS + 31) / 32;
    constexpr int WARPS_N = NL_BN / 32, MMA_WARPS = (BM / 16) * WARPS_N;
    static_assert(K % 16 == 0 && BM % 16 == 0 && MMA_WARPS <= NL_WARPS, "tile shape");
    extern __shared__ __align__(16) unsigned char nl_smem[];
    T* sa = reinterpret_cast<T*>(nl_smem);
    T* sb = sa + BM * LDS;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * NL_BN;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

    // 1. Input rows first (the LayerNorm waits on them), then the weight rows.
    nl_stage_rows<T, K, BM>(sa, x, m0, M);
    asm volatile("cp.async.commit_group;" ::: "memory");
    nl_stage_rows<T, K, NL_BN>(sb, w, n0, N);
    asm volatile("cp.async.commit_group;" ::: "memory");
    uint4 wraw[CHUNKS], braw[CHUNKS];
    layer_norm_params<CHUNKS>(ln_w, ln_b, wraw, braw, VECS, lane);
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    float bias_f[4][2];
    nl_load_bias(bias_f, bias, n0 + wn * 32, N);
    asm volatile("cp.async.wait_group 1;" ::: "memory");
    __syncthreads();

    // 2. The rows normalised in place.
    nl_normalize_rows<CHUNKS, T, K, LDS, BM>(sa, wraw, braw, eps);
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    if (warp >= MMA_WARPS) return;

    // 3. A 16 × 32 slice of the tile per warp.
    float acc[4][4] = {};
    nl_warp_mma_16x32<T, K, LDS>(acc, sa + wm * 16 * LDS, sb + wn * 32 * LDS);

    // 4. Epilogue.
    nl_store_tile<T, GELU>(acc, bias_f, y, m0 + wm * 16, n0 + wn * 32, M, N);
}

// One entry per storage type, width and epilogue, named as the Rust side's NORM_LINEAR_NAMES
// table expects.
#define NORM_LINEAR_ENTRY(SUFFIX, T, K, BM, GELU, TAIL)                                                       \
    extern "C" __global__ void __launch_bounds__(NL_WARPS * 32)                                               \
        fastpath_norm_linear_##SUFFIX##_c##K##TAIL(const T* x, const T* ln_w, const T* ln_b, const T* w,     \
                                                    const T* bias, T* y, int M, int N, float eps) {          \
        norm_linear_tile<T, K, BM, GELU>(x, ln_w, ln_b, w, bias, y, M, N, eps);                               \
    }
NORM_LINEAR_ENTRY(f16, __half, 192, NL_BM, false, )
NORM_LINEAR_ENTRY(f16, __half, 192, NL_BM, true, _gelu)
NORM_LINEAR_ENTRY(bf16, __nv_bfloat16, 192, NL_BM, false, )
NORM_LINEAR_ENTRY(bf16, __nv_bfloat16, 192, NL_BM, true, _gelu)
NORM_LINEAR_ENTRY(f16, __half, 192, 64, false, _m64)
NORM_LINEAR_ENTRY(f16, __half, 192, 64, true, _gelu_m64)
NORM_LINEAR_ENTRY(bf16, __nv_bfloat16, 192, 64, false, _m64)
NORM_LINEAR_ENTRY(bf16, __nv_bfloat16, 192, 64, true, _gelu_m64)

// ---------------------------------------------------------------------------------------------
// residual_norm_linear: the attention's output projection with its residual, then norm2 → fc1
// (→ GELU), what a pre-norm block runs between its attention and its fc2:
//   x1 = r + o·Wpᵀ + bp,   y = LayerNorm(x1)·Wᵀ + b (then x·Φ(x)),
// in one launch that writes both x1 (fc2's residual) and y (lever 61 in docs/LEVERS.md). At
// DeiT-T's batch 1 the projection is a launch of ~3 µs in a CUDA graph's chain for a 197 × 192 ×
// 192 product; here it is a few warps' MMA steps inside norm_linear's kernel.
//
// Each CTA computes the 16 × 128 tile of y that norm_linear's would, and needs the whole
// normalised rows of x1 for it. Rather than every CTA recomputing the rows' projection (loading
// all of Wp), the RNL_SPLIT CTAs that share a row tile form a thread-block cluster and split it:
// cluster rank q computes x1's columns [32q, 32q + 32) of the 16 rows (mma.sync, K split over
// several warps, the partials summed in a fixed order), stores them to global memory and, once
// the whole cluster is running (a cluster arrive at entry, its wait before the stores), into
// every cluster CTA's row buffer through distributed shared memory (st.async, counted on the
// receiver's transaction barrier: the exchanges below); once its barrier has counted every
// rank's bytes each CTA goes on exactly as norm_linear_tile (LayerNorm of its rows in place,
// MMA with its weight tile, epilogue). So the rows normalised are x1 rounded to the storage type, as the
// separate kernels would read them back.
// The proj epilogue sums in f32 as cuBLASLt's bias + residual epilogue does ((o·Wpᵀ + r) + bp),
// rounded once.
//
// The same kernel serves the block's other boundary, fc2 + residual in front of the next block's
// norm1 + qkv (o is then fc1's GELU output, KF = 4C wide, and the back tiles are 96 columns wide
// so that six cover qkv's 3C = 576): the second form below (lever 62).
//
// Constraints (checked by the host, residual_norm_linear in candle-fastpath): C = 32 · RNL_SPLIT
// (192), ceil(N / BN) = RNL_SPLIT (DeiT-T's fc1, N = 768 with BN = 128; its qkv, N = 576 with
// BN = 96), compute capability 9.0 (clusters). Grid (RNL_SPLIT, ceil(M / NL_BM)), clusters of
// RNL_SPLIT along x, NL_WARPS · 32 threads, ((NL_BM + BN) · (C + 8) + (NL_BM + 32) · (KF + 8)) ·
// sizeof(T) + KW · NL_BM · 32 · 4 bytes of dynamic shared memory.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
constexpr int RNL_SPLIT = 6;

// The cluster's exchanges through distributed shared memory (lever 68): each CTA pushes its part
// of a tile into every CTA that needs it with st.async, whose mbarrier::complete_tx counts the
// bytes on the receiving CTA's transaction barrier, and the receiver waits on that barrier alone.
// A cluster barrier here (cooperative groups' this_cluster().sync(), whose arrive has release
// semantics) compiles to MEMBAR.ALL.GPU, which waits for every memory operation the thread has in
// flight, global stores and the weights' cp.async prefetch included, and the block kernel ran
// four of them (~2 µs of its ~15). Each barrier serves one exchange of one launch (phase 0); RNL_BAR_BYTES at the start
// of the dynamic shared memory hold them (the host's smem sizes include it). Buffer reuse needs no
// barrier either: a CTA overwrites another's buffer only with data computed from that CTA's later
// exchange, which it sends after its last read of the buffer.
constexpr int RNL_BAR_BYTES = 64;
enum RnlBar { BAR_ATTN = 0, BAR_X1 = 1, BAR_FC1 = 2, BAR_X2 = 3 };

#include "cluster_exchange.cuh"

// What every thread of a residual_norm_linear CTA keeps in registers from its start to its end:
// the LayerNorm's parameters (its lane's chunks), the bias pairs of its warp's slice of the back
// GEMM's tile, and, for threads below RNL_PAIRS, the residual and front bias of the x1 pair it
// finishes (zero past M). Loaded at the start (rnl_load_regs), read by rnl_finish.
template <int K>
struct RnlRegs {
    uint4 wraw[(K / 8 + 31) / 32], braw[(K / 8 + 31) / 32];
    float bias_f[4][2];
    float res[2], pbias[2];
};

// BACK false (attention_residual: no LayerNorm or back GEMM follows): the residual pairs and
// the front bias only.
template <typename T, int K, int BN, bool BACK = true>
__device__ __forceinline__ void rnl_load_regs(RnlRegs<K>& g, const T* __restrict__ ln_w, const T* __restrict__ ln_b,
                                              const T* __restrict__ bias, const T* __restrict__ r,
                                              const T* __restrict__ bp, int M, int N) {
    constexpr int VECS = K / 8, CHUNKS = (VECS + 31) / 32, WARPS_N = BN / 32, SLICE = K / RNL_SPLIT;
    constexpr int RNL_PAIRS = NL_BM * SLICE / 2;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int m0 = blockIdx.y * NL_BM, n0 = blockIdx.x * BN, c0 = blockIdx.x * SLICE;
    if (BACK) {
        layer_norm_params<CHUNKS>(ln_w, ln_b, g.wraw, g.braw, VECS, lane);
        nl_load_bias(g.bias_f, bias, n0 + warp % WARPS_N * 32, N);
    }
    const int prow = tid / (SLICE / 2), pcol = c0 + (tid % (SLICE / 2)) * 2;
    g.res[0] = g.res[1] = g.pbias[0] = g.pbias[1] = 0.f;
    if (tid < RNL_PAIRS) {
        if (m0 + prow < M) {
            const NlPair<T> p = *reinterpret_cast<const NlPair<T>*>(r + (size_t)(m0 + prow) * K + pcol);
            g.res[0] = to_f32(p.a);
            g.res[1] = to_f32(p.b);
        }
        g.pbias[0] = to_f32(bp[pcol]);
        g.pbias[1] = to_f32(bp[pcol + 1]);
    }
}

// A warp's 16 × 32 slice of its CTA's back-GEMM tile (rows `a`, weight rows `b`, K wide, K + 8
// apart), bias, rounding (and the GELU), pushed into every cluster CTA's `y` rows (NL_BM rows of
// RNL_SPLIT · BN + 8 elements: the whole cluster's tiles side by side), counted on each receiver's
// barrier `ybar`. Tile rows past the sequence are pushed too (the receivers count every byte).
template <typename T, int K, int BN, bool GELU>
__device__ __forceinline__ void nl_slice_to_cluster(const T* a, const T* b, const float (&bias_f)[4][2], T* y,
                                                    int row0, int col0, int N, uint32_t ybar) {
    constexpr int LDY = RNL_SPLIT * BN + 8;
    float acc[4][4] = {};
    nl_warp_mma_16x32<T, K, K + 8>(acc, a, b);
    nl_epilogue_tile<T, GELU>(acc, bias_f, row0, col0, NL_BM, N, [&](int row, int col, NlPair<T> p) {
        const uint32_t dst = smem_addr(y + row * LDY + col);
#pragma unroll
        for (int q = 0; q < RNL_SPLIT; ++q) xbar_push(dst, ybar, q, pair_bits(p));
    });
}

// The split-K front GEMM of rnl_finish and linear_residual_norm_tile, step 2: warp w < KW's
// 16 × SLICE slice of o·Wpᵀ over its KF / KW columns of K (o's rows `so`, the rank's Wp rows
// `sp`, both LDF apart), stored as f32 partials into spart [KW][NL_BM][SLICE]. Other warps
// return at once.
template <typename T, int KF, int KW, int LDF, int SLICE>
__device__ __forceinline__ void front_partials(const T* so, const T* sp, float* spart) {
    constexpr int KSLICE = KF / KW, NG = SLICE / 16;
    static_assert(KF % KW == 0 && KSLICE % 16 == 0 && SLICE % 16 == 0, "front GEMM split");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp >= KW) return;
    float acc[2 * NG][4] = {};
    nl_warp_mma_16xn<T, KSLICE, LDF, NG>(acc, so + warp * KSLICE, sp + warp * KSLICE);
    float* part = spart + warp * NL_BM * SLICE;
#pragma unroll
    for (int j = 0; j < 2 * NG; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int rl = lane / 4 + h * 8, cl = j * 8 + (lane % 4) * 2;
            *reinterpret_cast<float2*>(part + rl * SLICE + cl) = make_float2(acc[j][2 * h], acc[j][2 * h + 1]);
        }
    }
}

// Steps 2-5 of residual_norm_linear_tile below (the front GEMM's slice, x1 into every cluster
// CTA's rows, the LayerNorm, the back GEMM and its epilogue), once this CTA's `so` rows (the front
// GEMM's input, KF wide) and `sp` rows (its SLICE rows of Wp) are in shared memory and visible to
// every thread; W's rows (`sb`) may still be in flight as the newest cp.async group. ENTRY_WAIT:
// this call waits on the cluster arrive made at kernel entry (else the caller did).
// attention_residual_norm_linear_tile ends the same way.
//
// TO_CLUSTER (the attention_block entries' first step): x1 stays on chip (its pair is returned
// in *x1p for the step after), and the back GEMM's tile goes, after the epilogue, into every cluster CTA's
// `y` rows (shared memory, NL_BM rows of RNL_SPLIT · BN + 8 elements: the next step's input)
// instead of global memory.
//
// X1_ONLY (attention_residual, lever 86): x1 to global memory and nothing after it (no exchange,
// no LayerNorm, no back GEMM).
template <typename T, int K, int KF, int KW, int BN, bool GELU, bool ENTRY_WAIT, bool TO_CLUSTER = false,
          bool X1_ONLY = false>
__device__ __forceinline__ void rnl_finish(T* sa, const T* sb, const T* so, const T* sp, float* spart,
                                           const RnlRegs<K>& g, T* __restrict__ x1, T* __restrict__ y, int M,
                                           int N, float eps, uint32_t xbar, uint32_t ybar = 0,
                                           NlPair<T>* x1p = nullptr, float* norms = nullptr) {
    constexpr int LDS = K + 8, VECS = K / 8, CHUNKS = (VECS + 31) / 32, LDF = KF + 8;
    constexpr int WARPS_N = BN / 32, MMA_WARPS = (NL_BM / 16) * WARPS_N, SLICE = K / RNL_SPLIT;
    constexpr int RNL_PAIRS = NL_BM * SLICE / 2;
    const int rank = blockIdx.x;
    const int m0 = blockIdx.y * NL_BM, n0 = blockIdx.x * BN, c0 = rank * SLICE;
    const int tid = threadIdx.x, warp = tid / 32;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int prow = tid / (SLICE / 2), pcol = c0 + (tid % (SLICE / 2)) * 2;

    // 2. This rank's 16 × 32 slice of o·Wpᵀ, K split over KW warps into partials.
    front_partials<T, KF, KW, LDF, SLICE>(so, sp, spart);
    __syncthreads();

    // 3. x1 = (o·Wpᵀ + r) + bp, rounded once, to global memory and to every cluster CTA's rows
    // (pushed, counted on each receiver's `xbar`).
    if (ENTRY_WAIT) asm volatile("barrier.cluster.wait;" ::: "memory");
    if (tid < RNL_PAIRS) {
        const NlPair<T> p = front_pair<T, KW, NL_BM, SLICE>(spart, prow, pcol - c0, g.res, g.pbias);
        if (!X1_ONLY) {
            const uint32_t dst = smem_addr(sa + prow * LDS + pcol);
#pragma unroll
            for (int q = 0; q < RNL_SPLIT; ++q) xbar_push(dst, xbar, q, pair_bits(p));
        }
        if (TO_CLUSTER)
            *x1p = p;
        else if (m0 + prow < M)
            *reinterpret_cast<NlPair<T>*>(x1 + (size_t)(m0 + prow) * K + pcol) = p;
    }
    if (X1_ONLY) return;
    // Every rank's x1 pairs in this CTA's rows. No CTA writes another's shared memory after this
    // but through the next exchange (TO_CLUSTER: `y`, on `ybar`), whose bytes its receiver waits
    // for, so each may exit once its own exchanges have landed.
    xbar_wait(xbar);

    // 4. The rows normalised in place; first, with `norms`, cluster rank 0 records their L2
    // norms (a Threshold-L2 step ranks them next).
    if (norms != nullptr && rank == 0) nl_row_norms<T, K, LDS>(sa, norms, m0, M);
    nl_normalize_rows<CHUNKS, T, K, LDS>(sa, g.wraw, g.braw, eps);
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();

    // 5. A 16 × 32 slice of the tile per warp, then the epilogue.
    if (warp < MMA_WARPS) {
        if (TO_CLUSTER) {
            nl_slice_to_cluster<T, K, BN, GELU>(sa + wm * 16 * LDS, sb + wn * 32 * LDS, g.bias_f, y, wm * 16,
                                                n0 + wn * 32, N, ybar);
        } else {
            float acc[4][4] = {};
            nl_warp_mma_16x32<T, K, LDS>(acc, sa + wm * 16 * LDS, sb + wn * 32 * LDS);
            nl_store_tile<T, GELU>(acc, g.bias_f, y, m0 + wm * 16, n0 + wn * 32, M, N);
        }
    }
}

// K = C (the normalised width); KF the front GEMM's K (C for proj, 4C for fc2), split over KW
// warps; BN the back GEMM's tile width (RNL_SPLIT tiles cover its N).
template <typename T, int K, int KF, int KW, int BN, bool GELU>
__device__ void residual_norm_linear_tile(const T* __restrict__ o, const T* __restrict__ wp,
                                          const T* __restrict__ bp, const T* __restrict__ r,
                                          const T* __restrict__ ln_w, const T* __restrict__ ln_b,
                                          const T* __restrict__ w, const T* __restrict__ bias, T* __restrict__ x1,
                                          T* __restrict__ y, int M, int N, float eps) {
    constexpr int THREADS = NL_WARPS * 32, LDS = K + 8, LDF = KF + 8;
    constexpr int WARPS_N = BN / 32, MMA_WARPS = (NL_BM / 16) * WARPS_N, SLICE = K / RNL_SPLIT;
    // The front GEMM's K is split over KW warps (a 12-step dependent MMA chain in one warp cost
    // ~1 µs, the probe's breakdown), then RNL_PAIRS threads sum the partials in a fixed order,
    // one pair of adjacent x1 elements each.
    constexpr int KSLICE = KF / KW, RNL_PAIRS = NL_BM * SLICE / 2;
    static_assert(K % 16 == 0 && BN % 32 == 0 && MMA_WARPS <= NL_WARPS && NL_BM <= NL_WARPS && SLICE == 32 &&
                      NL_BM == 16 && KF % KW == 0 && KSLICE % 16 == 0 && KW <= NL_WARPS && RNL_PAIRS <= THREADS,
                  "tile shape");
    extern __shared__ __align__(16) unsigned char nl_smem[];
    const uint32_t bars = smem_addr(nl_smem);  // the exchanges' barriers (RNL_BAR_BYTES)
    T* sa = reinterpret_cast<T*>(nl_smem + RNL_BAR_BYTES);  // NL_BM rows of x1 (filled by the cluster), then normalised
    T* sb = sa + NL_BM * LDS;                // BN rows of W
    T* so = sb + BN * LDS;                   // NL_BM rows of o (KF wide)
    T* sp = so + NL_BM * LDF;                // this rank's SLICE rows of Wp (KF wide)
    // The front GEMM's partial sums, [KW][NL_BM][SLICE] f32.
    float* spart = reinterpret_cast<float*>(sp + SLICE * LDF);
    // The cluster spans the grid's x (RNL_SPLIT CTAs), so a CTA's rank is its blockIdx.x.
    const int rank = blockIdx.x;
    const int m0 = blockIdx.y * NL_BM, n0 = blockIdx.x * BN, c0 = rank * SLICE;
    // A CTA's shared memory may be written by the others only once it is running, its barrier
    // armed: every thread arrives here and waits right before its pushes (by then the whole
    // cluster has arrived).
    xbar_arm<1>(bars + 8 * BAR_X1, {NL_BM * K * (uint32_t)sizeof(T)});  // its one exchange: x1
    asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");

    // 1. The projection's operands first (o's rows, this rank's Wp rows), then W's rows.
    nl_stage_rows<T, KF, NL_BM>(so, o, m0, M);
    nl_stage_rows<T, KF, SLICE>(sp, wp, c0, K);  // Wp has K = C rows: all of the slice
    asm volatile("cp.async.commit_group;" ::: "memory");
    nl_stage_rows<T, K, BN>(sb, w, n0, N);
    asm volatile("cp.async.commit_group;" ::: "memory");
    RnlRegs<K> g;
    rnl_load_regs<T, K, BN>(g, ln_w, ln_b, bias, r, bp, M, N);
    asm volatile("cp.async.wait_group 1;" ::: "memory");
    __syncthreads();
    rnl_finish<T, K, KF, KW, BN, GELU, true>(sa, sb, so, sp, spart, g, x1, y, M, N, eps, bars + 8 * BAR_X1);
}

// One entry per storage type and form, named as the Rust side's RESIDUAL_NORM_LINEAR_NAMES table
// expects: _c192 (proj → norm2 → fc1, K = 192 over 6 warps, 128-column tiles) with and without
// the GELU, and _c192_k768 (fc2 → the next block's norm1 → qkv: K = 768 over 12 warps, 96-column
// tiles). Compiled only for compute capability 9.0 and up (clusters); the host loads them only
// there.
#define RESIDUAL_NORM_LINEAR_ENTRY(SUFFIX, T, K, KF, KW, BN, GELU, TAIL)                                     \
    extern "C" __global__ void __cluster_dims__(RNL_SPLIT, 1, 1) __launch_bounds__(NL_WARPS * 32)           \
        fastpath_residual_norm_linear_##SUFFIX##_c##K##TAIL(                                                 \
            const T* o, const T* wp, const T* bp, const T* r, const T* ln_w, const T* ln_b, const T* w,      \
            const T* bias, T* x1, T* y, int M, int N, float eps) {                                           \
        residual_norm_linear_tile<T, K, KF, KW, BN, GELU>(o, wp, bp, r, ln_w, ln_b, w, bias, x1, y, M, N,    \
                                                          eps);                                              \
    }
RESIDUAL_NORM_LINEAR_ENTRY(f16, __half, 192, 192, 6, 128, false, )
RESIDUAL_NORM_LINEAR_ENTRY(f16, __half, 192, 192, 6, 128, true, _gelu)
RESIDUAL_NORM_LINEAR_ENTRY(f16, __half, 192, 768, 12, 96, false, _k768)
RESIDUAL_NORM_LINEAR_ENTRY(bf16, __nv_bfloat16, 192, 192, 6, 128, false, )
RESIDUAL_NORM_LINEAR_ENTRY(bf16, __nv_bfloat16, 192, 192, 6, 128, true, _gelu)
RESIDUAL_NORM_LINEAR_ENTRY(bf16, __nv_bfloat16, 192, 768, 12, 96, false, _k768)

// ---------------------------------------------------------------------------------------------
// linear_residual_norm (lever 98): a pre-norm block's attention projection, its residual add and
// the LayerNorm after it as one launch at DeiT-S's width, where the graph ran cuBLASLt's GEMM
// with its residual epilogue and then the LayerNorm kernel:
//   x1 = (o·Wpᵀ + r) + bp   (o, r [M, C], Wp [C, C]),   z = LayerNorm(x1),
// both written out: x1 is the residual stream, z fc1's input, which cuBLASLt still runs. A
// LayerNorm needs whole rows and the GEMM's columns are split over CTAs, so the LRN_SPLIT CTAs
// sharing a 16-row tile form a cluster: rank q computes columns [LRN_SLICE·q, LRN_SLICE·(q + 1))
// of x1 (its Wp rows staged once, K split over LRN_KW warps into f32 partials summed in a fixed
// order: rnl_finish's arithmetic), rounds them, stores them and pushes them into every cluster
// CTA's row buffer (distributed shared memory, counted on a transaction barrier); then rank q
// normalises rows 2q and 2q + 1 of the tile with the LayerNorm kernel's own row code
// (layer_norm_warp_row), so z is that kernel's output for this x1 bit for bit. At batch 1 a
// launch is latency, not bytes: the GEMM and the LayerNorm were ~5 and ~3 µs (ncu), this kernel
// ~6. The same form for fc2 (K = 4C: 148 KB of W2 per CTA) took 10.5 µs against ~8 for the two
// launches it replaced, so fc2 keeps them here (lever 103 runs fc2 → norm1 as TMA + wgmma
// clusters instead: thin_gemm_sm90.cu).
// Constraints (the host's, linear_residual_norm in candle-fastpath): C = 384, every operand
// contiguous and 16-byte aligned, compute capability 9.0; grid (LRN_SPLIT, ceil(M / NL_BM)),
// clusters of LRN_SPLIT along x, NL_WARPS · 32 threads, lrn_smem_bytes() (the host's) of dynamic
// shared memory.
constexpr int LRN_DIM = 384, LRN_SPLIT = 8, LRN_SLICE = LRN_DIM / LRN_SPLIT, LRN_KW = 8;
// The kernel itself (linear_residual_norm_tile) is below the attention kernels, whose code its
// attention form (lever 119) shares.

// ---------------------------------------------------------------------------------------------
// attention_residual_norm_linear: the attention itself folded into residual_norm_linear's proj
// form (lever 64 in docs/LEVERS.md), for one sequence (batch 1) of DeiT-T's width:
//   o = softmax(q kᵀ · scale) v per head (q, k, v read from the fused qkv projection),
//   x1 = r + o·Wpᵀ + bp,   y = LayerNorm(x1)·Wᵀ + b (then x·Φ(x)),
// one launch where the graph ran candle-ragged's attention kernel and then lever 61's. At batch 1
// the attention is ~5 µs of a CUDA graph's chain for a few MFLOP; inside the cluster it adds
// ~3.5 µs to the kernel after it (the probe, scripts/gpu/probes/arnl.cu).
//
// The RNL_SPLIT = 2 · HEADS CTAs of a row tile's cluster split the attention by head: ranks h and
// h + HEADS both compute head h for the tile's 16 queries over all keys, with candle-ragged's
// warp-level online softmax (attention_warp.cuh): K and V of the head staged in shared memory,
// ARNL_PARTS warps each taking a range of 16-key tiles (attend_keys), then all warps merging the
// parts' states (each thread one row and two columns, the parts weighed by their maxima in a
// fixed order). The normalised rows, rounded to the storage type as the attention kernel's
// output is, go into the attention tile of HEADS cluster CTAs through distributed shared memory
// (rank h into ranks 0..HEADS-1, rank h + HEADS into the others); once its transaction barrier
// has counted them every CTA holds the whole 16 × C tile where residual_norm_linear_tile loads
// o, and finishes as that kernel does (rnl_finish).
//
// Latency, not bytes, is what matters here, so (the probe's variants):
//   - the query fragments are loaded (global → registers) before any cp.async is issued: behind
//     Wp's and W's bytes they arrived last (0.2–0.3 µs);
//   - K and V are loaded for all M rows without waiting on cu_seqlens (a memory round trip at the
//     head of the chain, 0.1–0.3 µs); the length masks the keys afterwards, and the rows from
//     the length to the next multiple of 16, which attend_chunk needs finite, are zeroed when
//     M is larger (a capacity-sized buffer);
//   - ranks h and h + HEADS both compute the whole head: splitting its keys between them halves
//     the K / V bytes but costs a state exchange and one more cluster barrier (0.2–0.6 µs slower);
//   - with many rows (78 CTAs at 197) issuing Wp's and W's loads only once K and V have landed
//     saves ~0.3 µs; with few (97 rows and under) it costs as much (the _late entries, which the
//     host takes from ARNL_LATE_W_ROWS = 128 rows up).
// Query rows past the sequence give zero rows of o, as rows the attention kernel never writes
// read in a pool's fresh buffer would not: x1 = r + bp there (nobody reads those rows).
//
// Constraints (checked by the host, attention_residual_norm_linear in candle-fastpath): C = 192
// (three heads of 64), N in (640, 768] (six 128-column tiles), one sequence (cu_seqlens =
// [0, len], len ≤ M), compute capability 9.0. Grid (RNL_SPLIT, ceil(M / NL_BM)), clusters of
// RNL_SPLIT along x, NL_WARPS · 32 threads, attention_rnl_smem_bytes(M) bytes of dynamic shared
// memory (computed by the host, candle-fastpath's cuda.rs). BLOCK: the attention_block entries
// below (lever 65), with the second step's parameters in `nx`.
constexpr int ARNL_HEAD_DIM = 64, ARNL_PARTS = 8, ARNL_STATE = ARNL_HEAD_DIM / 2 + 4;

// A fixed-count pruning step run at the head of the kernel that follows it: select_mlp_block's
// (lever 87, after a block's attention) and select_attention_block's (lever 90, before a block).
struct StepSelect {
    const float* scores;  // the sequence's score rows (step_score's `p`), `len` floats apart
    int len, prefix, keep, fuse, mode, heads;
};
// The longest step input (a token per thread loads its scores; the host's SELECT_STEP_MAX_LEN).
constexpr int SELECT_STEP_MAX_LEN = 512;

// select_attention_block (lever 90): every CTA of the step block's kernel ranks the step's `len`
// tokens by their scores (select_common's ranking, select_top_k's tokens) and places the kept
// ones: `src[r]`, r < prefix + keep, the input position of output row r, in shared memory
// (`scratch`, 3 · len + 32 ints). `v`: thread t's token's score inputs (step_score_load, token
// t), loaded before the weights' cp.async were issued. Every thread must call it; ends on a
// barrier. No fused row here (the step before a block gathers rows, as select_top_k_gathering);
// select_mlp_block's selection runs it too, with `scores_out` (len floats) receiving each
// token's score for its fused row's weights, and the dropped positions after the placement.
__device__ __forceinline__ const int* select_place(const StepSelect& sel, int* scratch,
                                                  const float (&v)[select_common::STEP_SCORE_ROWS],
                                                  float* scores_out = nullptr) {
    using namespace select_common;
    const int len = sel.len;
    int* key = scratch;
    int* kept = key + len;
    int* dropped = kept + len;
    int* counts = dropped + len;
    if ((int)threadIdx.x < len) {
        const float s = step_score_from(v, sel.mode, sel.heads);
        if (scores_out != nullptr) scores_out[threadIdx.x] = s;
        key[threadIdx.x] = total_key(s);
    }
    __syncthreads();
    rank_tokens(key, kept, len, sel.prefix, sel.keep);
    __syncthreads();
    place_tokens(kept, len, key, dropped, counts);  // src over the keys, which are dead
    return key;
}

// The attention_block entries' second step (lever 65): fc2 + residual into the next block's
// norm1 → qkv, as residual_norm_linear's fc2 form computes it (W2 [C, 4C] and b2, the next block's LayerNorm,
// its qkv weight [N2, C] and bias), writing the block's output x2 [M, C] and that qkv [M, N2].
template <typename T>
struct ArnlNext {
    const T *w2, *b2, *ln_w, *ln_b, *wq, *bq;
    T *x2, *qkv;
    int N2;
    float eps;
    float* norms;  // x2's row L2 norms (nl_row_norms), or null: not wanted
};

// attention_residual's class-token scores (lever 88): what candle-ragged's cls_probs writes for
// a pruning step after this attention (EViT's and ATS's scores), computed by the warps the
// attention leaves idle (ARNL_PARTS .. NL_WARPS - 1) of row tile 0's CTAs while the others attend:
// `probs` [HEADS + 1, M] f32, row h < HEADS head h's probabilities of the class token over the
// sequence's keys (rank h, from its K rows in shared memory), row HEADS the value rows' sums of
// squares (ranks HEADS .. 2·HEADS - 1, rows j ≡ rank - HEADS mod HEADS, from global memory);
// entries past `len` are 0. select_common.cuh's and row_norm.cuh's arithmetic in cls_probs'
// order, so the same bits. `scratch`: D + len floats of shared memory no other warp uses now.
template <typename T, int D, int HEADS>
__device__ void arnl_cls_rows(const T* __restrict__ qkv, const T* ks, int len, int M, int rank, float* __restrict__ probs,
                              float scale, float* scratch) {
    using namespace select_common;
    constexpr int ROW = TileCfg<D>::ROW, C = HEADS * D, FIRST = ARNL_PARTS * 32;
    constexpr int THREADS = NL_WARPS * 32 - FIRST, WARPS = THREADS / 32, V = 8;
    static_assert(D % V == 0 && C / V <= 32 && sizeof(T) == 2, "one 16-byte chunk of a value row per lane");
    const int t = threadIdx.x - FIRST, head = rank % HEADS;
    if (rank < HEADS) {
        float* qs = scratch;
        float* logit = scratch + D;
        if (t < D) qs[t] = to_f32(from_f32<T>(cls_query(to_f32(qkv[head * D + t]), scale)));
        asm volatile("bar.sync 1, %0;" ::"r"(THREADS) : "memory");
        for (int j = t; j < len; j += THREADS) {
            uint4 raw[D / V];
#pragma unroll
            for (int c = 0; c < D / V; ++c) raw[c] = *reinterpret_cast<const uint4*>(ks + j * ROW + c * V);
            const T* k = reinterpret_cast<const T*>(raw);
            logit[j] = to_f32(from_f32<T>(cls_dot(qs, D, [&](int i) { return to_f32(k[i]); })));
        }
        asm volatile("bar.sync 1, %0;" ::"r"(THREADS) : "memory");
        float m, sum;
        cls_softmax_stats(logit, len, m, sum);
        float* out = probs + (size_t)head * M;
        for (int j = t; j < M; j += THREADS) out[j] = j < len ? cls_prob(logit[j], m, sum) : 0.f;
        return;
    }
    // Value rows j ≡ head (mod HEADS), four at a time per warp, their loads issued together.
    constexpr int U = 4;
    const int warp = t / 32, lane = t % 32;
    float* out = probs + (size_t)HEADS * M;
    for (int j0 = head + HEADS * warp; j0 < M; j0 += HEADS * WARPS * U) {
        uint4 raw[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u * HEADS * WARPS;
            raw[u] = j < len && lane < C / V
                         ? *reinterpret_cast<const uint4*>(qkv + (size_t)j * 3 * C + 2 * C + lane * V)
                         : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const T* e = reinterpret_cast<const T*>(&raw[u]);
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < V; ++i) acc = row_norm_sq_add(to_f32(e[i]), acc);
            acc = row_norm_lane_sum(acc);
            const int j = j0 + u * HEADS * WARPS;
            if (lane == 0 && j < M) out[j] = j < len ? acc : 0.f;
        }
    }
}

// The K and V rows of head `head` (rows 0 .. kv_rows - 1, ROW = D + 8 elements apart) from the
// fused qkv projection `qkv` ([M, 3C], C = `C`), cp.async by all threads: input row `in_row(row)`
// for row < M, zeros from M on. The caller commits the group.
template <typename T, int C, typename InRow>
__device__ __forceinline__ void arnl_stage_kv(T* ks, T* vs, const T* __restrict__ qkv, int head, int kv_rows, int M,
                                              InRow in_row) {
    constexpr int D = ARNL_HEAD_DIM, ROW = TileCfg<D>::ROW, QKV = 3 * C;
    for (int i = threadIdx.x; i < kv_rows * (D / 8); i += NL_WARPS * 32) {
        const int row = i / (D / 8), c = i % (D / 8);
        const bool ok = row < M;
        const T* at = qkv + (size_t)(ok ? in_row(row) : 0) * QKV + head * D + c * 8;
        nl_cp_async16(ks + row * ROW + c * 8, at + C, ok);
        nl_cp_async16(vs + row * ROW + c * 8, at + 2 * C, ok);
    }
}

// Rows past the sequence may hold anything; those up to its next multiple of 16 must be finite
// (P is exactly 0 there, and 0 · NaN is not). Each thread zeroes the K / V rows it loaded
// (arnl_stage_kv's split of the work), once its cp.async group has landed.
template <typename T>
__device__ __forceinline__ void arnl_zero_kv_tail(T* ks, T* vs, int kv_rows, int len) {
    constexpr int D = ARNL_HEAD_DIM, ROW = TileCfg<D>::ROW;
    for (int i = threadIdx.x; i < kv_rows * (D / 8); i += NL_WARPS * 32) {
        const int row = i / (D / 8), c = i % (D / 8);
        if (row >= len) {
            *reinterpret_cast<uint4*>(ks + row * ROW + c * 8) = make_uint4(0, 0, 0, 0);
            *reinterpret_cast<uint4*>(vs + row * ROW + c * 8) = make_uint4(0, 0, 0, 0);
        }
    }
}

// The merge of the ARNL_PARTS warps' online-softmax states (`sstate`, save_state's layout) into
// head `head`'s normalised 16 × 64 tile, by all NL_WARPS warps: warp g takes accumulators 2g and
// 2g + 1 of every lane's state (one row, two adjacent columns), weighs each part by exp2(its
// maximum - the row's), normalises and rounds the pair (zero for rows at or past `len`), waits on
// the cluster arrive made at kernel entry, and pushes the pair into the attention tile `so` (LDO
// elements a row) of cluster CTAs first .. first + COUNT - 1, counted on their barrier `bar`.
template <typename T, int LDO, int COUNT>
__device__ __forceinline__ void arnl_merge_push(const float* sstate, T* so, int head, int m0, int len, uint32_t bar,
                                                int first, int warp, int lane) {
    constexpr int D = ARNL_HEAD_DIM, PARTS = ARNL_PARTS, STATE = ARNL_STATE;
    static_assert(2 * NL_WARPS == D / 2, "two accumulators of every lane's state per warp");
    const int hi = warp % 2, i0 = 2 * warp;
    float m = -INFINITY;
#pragma unroll
    for (int p = 0; p < PARTS; ++p) m = fmaxf(m, sstate[(p * STATE + D / 2 + hi) * 32 + lane]);
    float l = 0.f, o0 = 0.f, o1 = 0.f;
    if (m != -INFINITY) {  // else no key at all (len 0): zeros below
#pragma unroll
        for (int p = 0; p < PARTS; ++p) {
            const float* s = sstate + p * STATE * 32 + lane;
            const float wgt = exp2f(s[(D / 2 + hi) * 32] - m);  // 0 for a part without keys
            l += s[(D / 2 + 2 + hi) * 32] * wgt;
            o0 += s[i0 * 32] * wgt;
            o1 += s[(i0 + 1) * 32] * wgt;
        }
    }
    // The four threads of a quad hold the row's partial sums over their columns.
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    const int row = lane / 4 + hi * 8, col = head * D + (warp / 2) * 8 + (lane % 4) * 2;
    const uint32_t pair = m0 + row < len ? Pack2<T>::from_floats(o0 / l, o1 / l) : 0u;
    asm volatile("barrier.cluster.wait;" ::: "memory");
    const uint32_t dst = smem_addr(so + row * LDO + col);
#pragma unroll
    for (int q = 0; q < COUNT; ++q) xbar_push(dst, bar, first + q, pair);
}

// X1_ONLY (attention_residual, lever 86): x1 only, neither W's rows nor the LayerNorm's
// parameters loaded (w, bias, ln_w, ln_b and y unused).
// SELECT (select_attention_block, lever 90; BLOCK only): `qkv` and `r` hold the step's `sel.len`
// input tokens and M = sel.prefix + sel.keep is the kept ones' count: every CTA ranks the tokens
// (select_place) and reads its query rows, its head's K / V rows and its residual pairs through
// that placement, so the block runs on the kept rows as if select_top_k_gathering had copied
// them first (cu_seqlens unused: the sequence is the M kept rows).
template <typename T, int K, int BN, bool GELU, bool LATE_W, bool BLOCK = false, bool X1_ONLY = false,
          bool SELECT = false>
__device__ void attention_residual_norm_linear_tile(const T* __restrict__ qkv, const uint32_t* __restrict__ cu_seqlens,
                                                    const T* __restrict__ wp, const T* __restrict__ bp,
                                                    const T* __restrict__ r, const T* __restrict__ ln_w,
                                                    const T* __restrict__ ln_b, const T* __restrict__ w,
                                                    const T* __restrict__ bias, T* __restrict__ x1, T* __restrict__ y,
                                                    int M, int N, float eps, float scale_log2,
                                                    ArnlNext<T> nx = ArnlNext<T>{}, float* probs = nullptr,
                                                    float cls_scale = 0.f, StepSelect sel = StepSelect{}) {
    constexpr int D = ARNL_HEAD_DIM, HEADS = K / D, ROW = TileCfg<D>::ROW, PARTS = ARNL_PARTS, STATE = ARNL_STATE;
    constexpr int THREADS = NL_WARPS * 32, LDS = K + 8;
    constexpr int KF = K, KW = 6, LDF = KF + 8, QKV = 3 * K;
    constexpr int SLICE = K / RNL_SPLIT, RNL_PAIRS = NL_BM * SLICE / 2;
    static_assert(RNL_SPLIT == 2 * HEADS && NL_WARPS == 2 * PARTS && SLICE == 32 && NL_BM == 16 &&
                      RNL_PAIRS <= THREADS,
                  "tile shape");
    static_assert(!SELECT || (BLOCK && !LATE_W && !X1_ONLY), "a step before a whole block");
    static_assert(SELECT_STEP_MAX_LEN <= THREADS && 3 * SELECT_STEP_MAX_LEN + 32 <= KW * NL_BM * SLICE,
                  "a token per thread; the placement in spart");
    extern __shared__ __align__(16) unsigned char nl_smem[];
    const uint32_t bars = smem_addr(nl_smem);  // the exchanges' barriers (RNL_BAR_BYTES)
    T* sa = reinterpret_cast<T*>(nl_smem + RNL_BAR_BYTES);  // NL_BM rows of x1 (filled by the cluster), then normalised
    T* sb = sa + NL_BM * LDS;                // BN rows of W
    T* so = sb + BN * LDS;                   // the attention's NL_BM × C tile (filled by the cluster)
    T* sp = so + NL_BM * LDF;                // this rank's SLICE rows of Wp
    float* spart = reinterpret_cast<float*>(sp + SLICE * LDF);  // [KW][NL_BM][SLICE]
    float* sstate = spart + KW * NL_BM * SLICE;                  // [PARTS][STATE][32 lanes]
    T* ks = reinterpret_cast<T*>(sstate + PARTS * STATE * 32);   // K rows, then V rows, ROW wide
    const int rank = blockIdx.x, head = rank % HEADS, half = rank / HEADS;
    const int m0 = blockIdx.y * NL_BM, n0 = blockIdx.x * BN, c0 = rank * SLICE;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    // As residual_norm_linear_tile: no remote store before the whole cluster runs, its barriers
    // armed (the attention tile, x1; BLOCK: the fc1 tile, x2).
    constexpr uint32_t TILE_BYTES = NL_BM * K * sizeof(T);
    if (BLOCK)
        xbar_arm<4>(bars, {TILE_BYTES, TILE_BYTES, NL_BM * (uint32_t)N * (uint32_t)sizeof(T), TILE_BYTES});
    else
        xbar_arm<2>(bars, {TILE_BYTES, TILE_BYTES});
    asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");

    // 1. The query fragments, then K and V of this CTA's head (M rows, up to a multiple of 16
    // zero-filled), Wp's slice, W's rows: three cp.async groups (LATE_W: the last two once K and
    // V have landed).
    // SELECT: the scores' loads first, Wp's slice (a group), the ranking and placement, then the
    // rows through it (K / V a group), then W's rows (a group, behind K / V in the SM's queue):
    // groups Wp, K / V, W where the others have K / V, Wp, W, so the waits below count the same.
    // The placement lives where the projection's partial sums go later (spart).
    const int* src = nullptr;
    if (SELECT) {
        float score_in[select_common::STEP_SCORE_ROWS];
        if (tid < sel.len) select_common::step_score_load(sel.scores, sel.len, tid, sel.mode, sel.heads, score_in);
        nl_stage_rows<T, KF, SLICE>(sp, wp, c0, K);
        asm volatile("cp.async.commit_group;" ::: "memory");
        src = select_place(sel, reinterpret_cast<int*>(spart), score_in);
    }
    // The input row of output row `row` (< M).
    auto in_row = [&](int row) { return SELECT ? src[row] : row; };
    RowState<D> st;
    if (warp < PARTS) {
        if (SELECT) {
            begin_rows<T, D>(st, qkv, QKV, 0, 0, lane);  // zero fragments, reset state
            const int t = lane % 4, row0 = m0 + lane / 4, row1 = row0 + 8;
            const T* q0 = qkv + (size_t)(row0 < M ? in_row(row0) : 0) * QKV + head * D;
            const T* q1 = qkv + (size_t)(row1 < M ? in_row(row1) : 0) * QKV + head * D;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const int c = kk * 16 + t * 2;
                st.qa[kk][0] = row0 < M ? *reinterpret_cast<const uint32_t*>(q0 + c) : 0u;
                st.qa[kk][1] = row1 < M ? *reinterpret_cast<const uint32_t*>(q1 + c) : 0u;
                st.qa[kk][2] = row0 < M ? *reinterpret_cast<const uint32_t*>(q0 + c + 8) : 0u;
                st.qa[kk][3] = row1 < M ? *reinterpret_cast<const uint32_t*>(q1 + c + 8) : 0u;
            }
        } else {
            begin_rows<T, D>(st, qkv + head * D, QKV, m0, M, lane);
        }
    }
    const int kv_rows = (M + 15) & ~15;
    T* vs = ks + kv_rows * ROW;
    arnl_stage_kv<T, K>(ks, vs, qkv, head, kv_rows, M, in_row);
    asm volatile("cp.async.commit_group;" ::: "memory");
    auto load_weights = [&] {
        if (!SELECT) {
            nl_stage_rows<T, KF, SLICE>(sp, wp, c0, K);  // Wp has K = C rows: all of the slice
            asm volatile("cp.async.commit_group;" ::: "memory");
        }
        if (!X1_ONLY) nl_stage_rows<T, K, BN>(sb, w, n0, N);
        asm volatile("cp.async.commit_group;" ::: "memory");  // (X1_ONLY: an empty group)
    };
    if (!LATE_W) load_weights();
    const int len = SELECT ? M : min(static_cast<int>(cu_seqlens[1]), M);
    RnlRegs<K> g;
    // SELECT: the residual pair through the placement (0 rows: no read in rnl_load_regs).
    rnl_load_regs<T, K, BN, !X1_ONLY>(g, ln_w, ln_b, bias, r, bp, SELECT ? 0 : M, N);
    if (SELECT && tid < RNL_PAIRS) {
        const int prow = tid / (SLICE / 2), pcol = c0 + (tid % (SLICE / 2)) * 2;
        if (m0 + prow < M) {
            const NlPair<T> p = *reinterpret_cast<const NlPair<T>*>(r + (size_t)in_row(m0 + prow) * K + pcol);
            g.res[0] = to_f32(p.a);
            g.res[1] = to_f32(p.b);
        }
    }
    if (LATE_W)
        asm volatile("cp.async.wait_group 0;" ::: "memory");
    else if (SELECT)
        asm volatile("cp.async.wait_group 1;" ::: "memory");  // Wp's and K / V's
    else
        asm volatile("cp.async.wait_group 2;" ::: "memory");
    if (len < M) arnl_zero_kv_tail<T>(ks, vs, kv_rows, len);
    __syncthreads();
    if (LATE_W) load_weights();

    // 2. Warp p < PARTS: the 16 queries over the 16-key tiles [p · kt / PARTS, (p + 1) · kt /
    // PARTS) of the sequence, its online-softmax state left in shared memory.
    if (warp < PARTS) {
        const int kt = (len + 15) / 16;
        const int key0 = warp * kt / PARTS * 16, key_end = min(len, (warp + 1) * kt / PARTS * 16);
        if (key0 < key_end) attend_keys<T, D, 32, false>(st, ks, vs, key0, key_end, scale_log2, lane);
        save_state<D>(st, sstate + warp * STATE * 32 + lane);
    } else if (X1_ONLY && probs != nullptr && blockIdx.y == 0) {
        // Lever 88: the step's scores beside the attention (spart is unused until the merge).
        arnl_cls_rows<T, D, HEADS>(qkv, ks, len, M, rank, probs, cls_scale, spart);
    }
    __syncthreads();
    // BLOCK: K and V are dead; the second step's weights go where they were (W2's slice of 32
    // rows, 4C wide, then the next qkv's 96-row tile), a fourth cp.async group, ~2 µs ahead of
    // their use.
    T* sw2 = ks;
    T* swq = sw2 + SLICE * (4 * K + 8);
    if (BLOCK) {
        nl_stage_rows<T, 4 * K, SLICE>(sw2, nx.w2, c0, K);
        nl_stage_rows<T, K, 96>(swq, nx.wq, rank * 96, nx.N2);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }

    // 3. The merge, into HEADS cluster CTAs' tiles.
    arnl_merge_push<T, LDF, HEADS>(sstate, so, head, m0, len, bars + 8 * BAR_ATTN, half * HEADS, warp, lane);
    // Wp's group done (W's, and BLOCK's fourth, may still be in flight).
    if (BLOCK)
        asm volatile("cp.async.wait_group 2;" ::: "memory");
    else
        asm volatile("cp.async.wait_group 1;" ::: "memory");
    // This CTA's attention tile complete (its HEADS pushers' bytes), and its Wp rows visible to
    // all its threads.
    xbar_wait(bars + 8 * BAR_ATTN);
    __syncthreads();
    if (!BLOCK) {
        rnl_finish<T, K, KF, KW, BN, GELU, false, false, X1_ONLY>(sa, sb, so, sp, spart, g, x1, y, M, N, eps,
                                                                  bars + 8 * BAR_X1);
        return;
    }
    // BLOCK (lever 65): fc1's GELU output goes into every cluster CTA's rows `sh` (where the
    // softmax states were), x1 stays in registers as the second step's residual.
    T* sh = reinterpret_cast<T*>(sstate);
    NlPair<T> x1p{};
    rnl_finish<T, K, KF, KW, BN, GELU, false, true>(sa, sb, so, sp, spart, g, nullptr, sh, M, N, eps, bars + 8 * BAR_X1,
                                                    bars + 8 * BAR_FC1, &x1p);
    RnlRegs<K> g2;
    rnl_load_regs<T, K, 96>(g2, nx.ln_w, nx.ln_b, nx.bq, r, nx.b2, 0, nx.N2);  // 0 rows: no residual read
    g2.res[0] = to_f32(x1p.a);
    g2.res[1] = to_f32(x1p.b);
    // Every CTA's fc1 tile in this CTA's `sh`. The second step's x2 lands in `sa`, where x1 was:
    // a CTA pushes x2 only after this wait, i.e. after every CTA's fc1 tile, which each CTA
    // computed after its last read of its own `sa`; and this CTA's partials go where the
    // attention tile was, which it alone reads.
    xbar_wait(bars + 8 * BAR_FC1);
    __syncthreads();
    // The second step's partial sums where the attention tile, Wp's slice and the first step's
    // partial sums were (31.5 KB for 24 KB).
    rnl_finish<T, K, 4 * K, 12, 96, false, false>(sa, swq, sh, sw2, reinterpret_cast<float*>(so), g2, nx.x2, nx.qkv,
                                                  M, nx.N2, nx.eps, bars + 8 * BAR_X2, 0, nullptr, nx.norms);
}

// One entry per storage type, with and without the GELU, each with W's loads issued at once or
// late (_late: once K and V have landed, which the host picks from ARNL_LATE_W_ROWS rows up),
// named as the Rust side's ATTENTION_RNL_NAMES table expects. Compute capability 9.0 and up
// only, as above.
#define ATTENTION_RESIDUAL_NORM_LINEAR_ENTRY(SUFFIX, T, GELU, LATE, TAIL)                                     \
    extern "C" __global__ void __cluster_dims__(RNL_SPLIT, 1, 1) __launch_bounds__(NL_WARPS * 32)           \
        fastpath_attention_residual_norm_linear_##SUFFIX##_c192##TAIL(                                       \
            const T* qkv, const uint32_t* cu_seqlens, const T* wp, const T* bp, const T* r, const T* ln_w,   \
            const T* ln_b, const T* w, const T* bias, T* x1, T* y, int M, int N, float eps,                  \
            float scale_log2) {                                                                              \
        attention_residual_norm_linear_tile<T, 192, 128, GELU, LATE>(qkv, cu_seqlens, wp, bp, r, ln_w, ln_b, \
                                                                     w, bias, x1, y, M, N, eps, scale_log2); \
    }
ATTENTION_RESIDUAL_NORM_LINEAR_ENTRY(f16, __half, false, false, )
ATTENTION_RESIDUAL_NORM_LINEAR_ENTRY(f16, __half, true, false, _gelu)
ATTENTION_RESIDUAL_NORM_LINEAR_ENTRY(bf16, __nv_bfloat16, false, false, )
ATTENTION_RESIDUAL_NORM_LINEAR_ENTRY(bf16, __nv_bfloat16, true, false, _gelu)
ATTENTION_RESIDUAL_NORM_LINEAR_ENTRY(f16, __half, false, true, _late)
ATTENTION_RESIDUAL_NORM_LINEAR_ENTRY(f16, __half, true, true, _gelu_late)
ATTENTION_RESIDUAL_NORM_LINEAR_ENTRY(bf16, __nv_bfloat16, false, true, _late)
ATTENTION_RESIDUAL_NORM_LINEAR_ENTRY(bf16, __nv_bfloat16, true, true, _gelu_late)

// attention_residual (lever 86): the same kernel ending at x1 = r + o·Wpᵀ + bp, for a pruning step
// right after the attention (EViT's), which decides which rows the MLP half sees: the norm2 →
// fc1 tile attention_residual_norm_linear computes would be thrown away. W's loads issued at
// once (Wp's 12 KB slice does not delay K and V as W's 48 KB did). Named as the Rust side's
// ATTENTION_RESIDUAL_NAMES expects; dynamic shared memory attention_rnl_smem_bytes(M), as
// attention_residual_norm_linear's (its W region unused).
// `probs` (lever 88), unless null: the class-token scores of arnl_cls_rows, [3 + 1, M] f32, with
// the softmax scale `cls_scale` (the selection's, as f32).
#define ATTENTION_RESIDUAL_ENTRY(SUFFIX, T)                                                                   \
    extern "C" __global__ void __cluster_dims__(RNL_SPLIT, 1, 1) __launch_bounds__(NL_WARPS * 32)           \
        fastpath_attention_residual_##SUFFIX##_c192(const T* qkv, const uint32_t* cu_seqlens, const T* wp,  \
                                                    const T* bp, const T* r, T* x1, int M, float scale_log2, \
                                                    float* probs, float cls_scale) {                          \
        attention_residual_norm_linear_tile<T, 192, 128, false, false, false, true>(                          \
            qkv, cu_seqlens, wp, bp, r, nullptr, nullptr, nullptr, nullptr, x1, nullptr, M, 0, 0.f, scale_log2, \
            ArnlNext<T>{}, probs, cls_scale);                                                                 \
    }
ATTENTION_RESIDUAL_ENTRY(f16, __half)
ATTENTION_RESIDUAL_ENTRY(bf16, __nv_bfloat16)

// attention_block (lever 65): attention_residual_norm_linear's kernel (with the GELU) continuing
// into fc2 + residual → the next block's norm1 → qkv: a whole pre-norm block of one image, from
// its qkv to the next block's, as one launch. The fc1 tile is exchanged through distributed
// shared memory like x1; fc2's and qkv's weights are loaded into K / V's space once the attention
// is done. Dynamic shared memory: attention_block_smem_bytes(M) (the host's), the attention
// kernel's with the K / V region at least 88,064 bytes. Named as ATTENTION_BLOCK_NAMES expects.
// `norms`, unless null, receives x2's row L2 norms (f32, M of them; nl_row_norms).
#define ATTENTION_BLOCK_ENTRY(SUFFIX, T, LATE, TAIL)                                                          \
    extern "C" __global__ void __cluster_dims__(RNL_SPLIT, 1, 1) __launch_bounds__(NL_WARPS * 32)           \
        fastpath_attention_block_##SUFFIX##_c192##TAIL(                                                      \
            const T* qkv, const uint32_t* cu_seqlens, const T* wp, const T* bp, const T* r, const T* ln2_w,  \
            const T* ln2_b, const T* w1, const T* b1, const T* w2, const T* b2, const T* ln1_w,              \
            const T* ln1_b, const T* wq, const T* bq, T* x2, T* qkv_next, int M, int N1, int N2, float eps2, \
            float eps1, float scale_log2, float* norms) {                                                    \
        attention_residual_norm_linear_tile<T, 192, 128, true, LATE, true>(                                  \
            qkv, cu_seqlens, wp, bp, r, ln2_w, ln2_b, w1, b1, nullptr, nullptr, M, N1, eps2, scale_log2,    \
            ArnlNext<T>{w2, b2, ln1_w, ln1_b, wq, bq, x2, qkv_next, N2, eps1, norms});                      \
    }
ATTENTION_BLOCK_ENTRY(f16, __half, false, )
ATTENTION_BLOCK_ENTRY(bf16, __nv_bfloat16, false, )
ATTENTION_BLOCK_ENTRY(f16, __half, true, _late)
ATTENTION_BLOCK_ENTRY(bf16, __nv_bfloat16, true, _late)

// select_attention_block (lever 90): a fixed-count pruning step before a block (Threshold-L2's,
// DynamicViT's; no fused row) run at the head of attention_block: `qkv` [len, 3C] and `r`
// [len, C] the step's input tokens (the block's qkv projection, computed by the block before,
// and its input), `scores` their score rows (step_score's modes, as select_mlp_block takes
// them), M = prefix + keep the kept tokens; x2 and the next qkv [M, ...] as attention_block over
// the kept rows. Named as SELECT_ATTENTION_BLOCK_NAMES expects; dynamic shared memory
// attention_block_smem_bytes(M).
#define SELECT_ATTENTION_BLOCK_ENTRY(SUFFIX, T)                                                               \
    extern "C" __global__ void __cluster_dims__(RNL_SPLIT, 1, 1) __launch_bounds__(NL_WARPS * 32)           \
        fastpath_select_attention_block_##SUFFIX##_c192(                                                     \
            const T* qkv, const float* scores, int len, int prefix, int keep, int mode, int heads,           \
            const T* wp, const T* bp, const T* r, const T* ln2_w, const T* ln2_b, const T* w1, const T* b1,  \
            const T* w2, const T* b2, const T* ln1_w, const T* ln1_b, const T* wq, const T* bq, T* x2,       \
            T* qkv_next, int M, int N1, int N2, float eps2, float eps1, float scale_log2, float* norms) {    \
        attention_residual_norm_linear_tile<T, 192, 128, true, false, true, false, true>(                     \
            qkv, nullptr, wp, bp, r, ln2_w, ln2_b, w1, b1, nullptr, nullptr, M, N1, eps2, scale_log2,       \
            ArnlNext<T>{w2, b2, ln1_w, ln1_b, wq, bq, x2, qkv_next, N2, eps1, norms}, nullptr, 0.f,         \
            StepSelect{scores, len, prefix, keep, 0, mode, heads});                                          \
    }
SELECT_ATTENTION_BLOCK_ENTRY(f16, __half)
SELECT_ATTENTION_BLOCK_ENTRY(bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// linear_residual_norm_tile: lever 98's kernel (its comment is above, at LRN_DIM), and with ATTN
// its attention form, attention_linear_residual_norm (lever 119), for one sequence (batch 1) at
// DeiT-S's width:
//   o = softmax(q kᵀ · scale) v per head (q, k, v read from the fused qkv projection),
//   x1 = (o·Wpᵀ + r) + bp,   z = LayerNorm(x1),
// one launch where the graph ran candle-ragged's attention kernel and then lever 98's (fc1 on
// the thin GEMM follows, as before). The same move as attention_residual_norm_linear's at DeiT-T's
// width (lever 64).
//
// ATTN: ranks h < 6 of a 16-row tile's cluster compute head h for the tile's 16 queries over all
// keys exactly as attention_residual_norm_linear_tile does (K and V of the head staged whole,
// ARNL_PARTS warps over ranges of 16-key tiles, the merge by all warps: arnl_merge_push) and push
// the rounded rows into all eight CTAs' attention tile; ranks 6 and 7 only stage their Wp slice
// and wait for the tile. Otherwise the tile's 16 rows of o are loaded from `in` ([M, C]). From
// there on the two are one code: each rank's 48 columns of x1 (K split over LRN_KW warps,
// partials summed in a fixed order), pushed into every CTA's rows, then two rows per rank
// normalised with the LayerNorm kernel's row code. So x1 and z are lever 98's kernel's outputs
// for the o it saw, bit for bit; the attention's o sums its keys in another order than
// candle-ragged's attention kernel (one rounding of T apart). Query rows at or past the sequence's
// length get zero rows of o (x1 = r + bp there).
//
// Constraints (the host's, linear_residual_norm and attention_linear_residual_norm in
// candle-fastpath): C = 384 (ATTN: six heads of 64, one sequence, cu_seqlens = [0, len], len ≤ M),
// every operand contiguous and 16-byte aligned, compute capability 9.0; grid (LRN_SPLIT,
// ceil(M / NL_BM)) within one wave, clusters of LRN_SPLIT along x, NL_WARPS · 32 threads,
// lrn_smem_bytes() / attention_lrn_smem_bytes(M) (the host's) of dynamic shared memory.
// `in`: o [M, C], or (ATTN) qkv [M, 3C]; cu_seqlens and scale_log2: ATTN only.
template <typename T, bool ATTN>
__device__ void linear_residual_norm_tile(const T* __restrict__ in, const uint32_t* __restrict__ cu_seqlens,
                                          const T* __restrict__ wp, const T* __restrict__ bp,
                                          const T* __restrict__ r, const T* __restrict__ ln_w,
                                          const T* __restrict__ ln_b, T* __restrict__ x1, T* __restrict__ z, int M,
                                          float eps, float scale_log2, int weights_first) {
    constexpr int C = LRN_DIM, D = ARNL_HEAD_DIM, HEADS = C / D, ROW = TileCfg<D>::ROW;
    constexpr int PARTS = ARNL_PARTS, STATE = ARNL_STATE, LDS = C + 8, VECS = C / 8, CHUNKS = (VECS + 31) / 32;
    constexpr int PAIRS = NL_BM * LRN_SLICE / 2, ROWS_PER_RANK = NL_BM / LRN_SPLIT;
    static_assert(LRN_KW <= NL_WARPS && HEADS <= LRN_SPLIT && NL_WARPS == 2 * PARTS && NL_BM == 16 &&
                      PAIRS <= NL_WARPS * 32 && NL_BM % LRN_SPLIT == 0 && ROWS_PER_RANK <= NL_WARPS,
                  "tile shape");
    extern __shared__ __align__(16) unsigned char nl_smem[];
    const uint32_t bars = smem_addr(nl_smem);                // the attention tile's and x1's exchanges
    T* sa = reinterpret_cast<T*>(nl_smem + RNL_BAR_BYTES);  // the tile's 16 rows of x1 (the cluster's)
    T* so = sa + NL_BM * LDS;                                // o's 16 rows (ATTN: the cluster's)
    T* sp = so + NL_BM * LDS;                                // this rank's LRN_SLICE rows of Wp
    float* spart = reinterpret_cast<float*>(sp + LRN_SLICE * LDS);  // [LRN_KW][NL_BM][LRN_SLICE]
    float* sstate = spart + LRN_KW * NL_BM * LRN_SLICE;              // ATTN: [PARTS][STATE][32 lanes]
    T* ks = reinterpret_cast<T*>(sstate + PARTS * STATE * 32);      // ATTN: K rows, then V rows
    const int rank = blockIdx.x, m0 = blockIdx.y * NL_BM, c0 = rank * LRN_SLICE;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const bool attends = ATTN && rank < HEADS;  // uniform over the CTA
    // No remote store before the whole cluster runs, its barriers armed.
    constexpr uint32_t TILE_BYTES = NL_BM * C * sizeof(T);
    if constexpr (ATTN)
        xbar_arm<2>(bars, {TILE_BYTES, TILE_BYTES});
    else
        xbar_arm<1>(bars + 8 * BAR_X1, {TILE_BYTES});
    asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");

    // 1. The LayerNorm's parameters and the bias of the x1 pair this thread finishes (thread t <
    // PAIRS: row t / (SLICE / 2)); ATTN: the query fragments (global → registers, before K / V's
    // cp.async: behind those bytes they would arrive last), K and V of this rank's head (M rows,
    // up to a multiple of 16 zero-filled; a group, empty on ranks 6 and 7); else o's rows. Then
    // this rank's Wp rows (a group) and the residual of that x1 pair. With `weights_first`
    // (lever 124: the host sets it where the kernel gets a programmatic graph edge, so it may
    // start while the kernel producing its input still runs; dependent_launch.cuh) Wp's rows are
    // asked for first, before `griddepcontrol.wait`, as are the parameters and the bias.
    dl_launch_dependents();
    if (weights_first) {
        nl_stage_rows<T, C, LRN_SLICE>(sp, wp, c0, C);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    uint4 wraw[CHUNKS], braw[CHUNKS];
    layer_norm_params<CHUNKS>(ln_w, ln_b, wraw, braw, VECS, lane);
    const int prow = tid / (LRN_SLICE / 2), pcol = c0 + (tid % (LRN_SLICE / 2)) * 2;
    float res[2] = {0.f, 0.f}, pb[2] = {0.f, 0.f};
    if (tid < PAIRS) {
        pb[0] = to_f32(bp[pcol]);
        pb[1] = to_f32(bp[pcol + 1]);
    }
    dl_wait();
    RowState<D> st;
    const int kv_rows = (M + 15) & ~15;
    T* vs = ks + kv_rows * ROW;
    if constexpr (ATTN) {
        if (attends && warp < PARTS) begin_rows<T, D>(st, in + rank * D, 3 * C, m0, M, lane);
        if (attends) arnl_stage_kv<T, C>(ks, vs, in, rank, kv_rows, M, [](int row) { return row; });
    } else {
        nl_stage_rows<T, C, NL_BM>(so, in, m0, M);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    if (!weights_first) {
        nl_stage_rows<T, C, LRN_SLICE>(sp, wp, c0, C);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    if (tid < PAIRS && m0 + prow < M) {
        const NlPair<T> p = *reinterpret_cast<const NlPair<T>*>(r + (size_t)(m0 + prow) * C + pcol);
        res[0] = to_f32(p.a);
        res[1] = to_f32(p.b);
    }

    if constexpr (ATTN) {
        // The attention (ranks h < HEADS): warp p < PARTS over the 16-key tiles [p · kt / PARTS,
        // (p + 1) · kt / PARTS) of the sequence, then the merge into all LRN_SPLIT CTAs' tiles.
        const int len = min(static_cast<int>(cu_seqlens[1]), M);
        if (attends) {
            // K / V (Wp's may be in flight, unless asked for first)
            if (weights_first)
                asm volatile("cp.async.wait_group 0;" ::: "memory");
            else
                asm volatile("cp.async.wait_group 1;" ::: "memory");
            if (len < M) arnl_zero_kv_tail<T>(ks, vs, kv_rows, len);
            __syncthreads();
            if (warp < PARTS) {
                const int kt = (len + 15) / 16;
                const int key0 = warp * kt / PARTS * 16, key_end = min(len, (warp + 1) * kt / PARTS * 16);
                if (key0 < key_end) attend_keys<T, D, 32, false>(st, ks, vs, key0, key_end, scale_log2, lane);
                save_state<D>(st, sstate + warp * STATE * 32 + lane);
            }
            __syncthreads();
            arnl_merge_push<T, LDS, LRN_SPLIT>(sstate, so, rank, m0, len, bars + 8 * BAR_ATTN, 0, warp, lane);
        } else {
            asm volatile("barrier.cluster.wait;" ::: "memory");  // before this CTA's x1 pushes below
        }
        // Wp's rows landed, and this CTA's attention tile complete (the HEADS pushers' bytes),
        // both visible to all its threads.
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        xbar_wait(bars + 8 * BAR_ATTN);
        __syncthreads();
    } else {
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();
    }

    // 2. This rank's 16 × LRN_SLICE slice of o·Wpᵀ, K split over LRN_KW warps into partials.
    front_partials<T, C, LRN_KW, LDS, LRN_SLICE>(so, sp, spart);
    __syncthreads();

    // 3. x1 = (o·Wpᵀ + r) + bp, rounded once, to global memory and into every cluster CTA's rows.
    if constexpr (!ATTN) asm volatile("barrier.cluster.wait;" ::: "memory");
    if (tid < PAIRS) {
        const NlPair<T> p = front_pair<T, LRN_KW, NL_BM, LRN_SLICE>(spart, prow, pcol - c0, res, pb);
        const uint32_t dst = smem_addr(sa + prow * LDS + pcol);
#pragma unroll
        for (int q = 0; q < LRN_SPLIT; ++q) xbar_push(dst, bars + 8 * BAR_X1, q, pair_bits(p));
        if (m0 + prow < M) *reinterpret_cast<NlPair<T>*>(x1 + (size_t)(m0 + prow) * C + pcol) = p;
    }
    // Every rank's x1 pairs in this CTA's rows (no CTA writes another's shared memory after this).
    xbar_wait(bars + 8 * BAR_X1);

    // 4. Rows ROWS_PER_RANK · rank .. of the tile normalised, one warp each, into z.
    if (warp < ROWS_PER_RANK) {
        const int row = rank * ROWS_PER_RANK + warp;
        if (m0 + row < M)
            layer_norm_warp_row<CHUNKS, T>(reinterpret_cast<const uint4*>(sa + row * LDS),
                                           reinterpret_cast<uint4*>(z + (size_t)(m0 + row) * C), wraw, braw, VECS, C,
                                           eps, lane);
    }
}

// One entry per storage type and form, named as the Rust side's LINEAR_RESIDUAL_NORM_NAMES table
// expects (the plain form's `cu_seqlens` and `scale_log2` unused). Compute capability 9.0 and up.
#define LINEAR_RESIDUAL_NORM_ENTRY(NAME, SUFFIX, T, ATTN)                                                    \
    extern "C" __global__ void __cluster_dims__(LRN_SPLIT, 1, 1) __launch_bounds__(NL_WARPS * 32)          \
        fastpath_##NAME##_##SUFFIX##_c384(const T* in, const uint32_t* cu_seqlens, const T* wp, const T* bp, \
                                          const T* r, const T* ln_w, const T* ln_b, T* x1, T* z, int M,       \
                                          float eps, float scale_log2, int weights_first) {                  \
        linear_residual_norm_tile<T, ATTN>(in, cu_seqlens, wp, bp, r, ln_w, ln_b, x1, z, M, eps, scale_log2, \
                                           weights_first);                                                   \
    }
LINEAR_RESIDUAL_NORM_ENTRY(linear_residual_norm, f16, __half, false)
LINEAR_RESIDUAL_NORM_ENTRY(linear_residual_norm, bf16, __nv_bfloat16, false)
LINEAR_RESIDUAL_NORM_ENTRY(attention_linear_residual_norm, f16, __half, true)
LINEAR_RESIDUAL_NORM_ENTRY(attention_linear_residual_norm, bf16, __nv_bfloat16, true)

// ---------------------------------------------------------------------------------------------
// mlp_block (lever 72): a pre-norm block's MLP half from its hidden states x1 on through the next
// block's qkv, for one image at DeiT-T's width:
//   h = GELU(LayerNorm2(x1)·W1ᵀ + b1),  x2 = x1 + h·W2ᵀ + b2,  qkv' = LayerNorm1'(x2)·Wqᵀ + bq.
// A pruning step between a block's halves (EViT's, after the attention) keeps that block from
// running as one attention_block launch; what follows the step was norm_linear (norm2 → fc1 →
// GELU) and then residual_norm_linear's fc2 form, two launches, and is here attention_block's
// second half: cluster rank q computes fc1's 128-column tile q of the row tile's 16 rows with
// norm_linear's arithmetic (the rows normalised in place, mma.sync, bias, rounding, GELU) and
// pushes it into every cluster CTA's `sh` rows, then every CTA finishes with rnl_finish's fc2
// form, as attention_block does. So x2 and qkv' are bit for bit the two launches' outputs.
// Constraints (the host's, mlp_block in candle-fastpath): C = 192, N1 = 4C, N2 in (480, 576],
// compute capability 9.0; grid (RNL_SPLIT, ceil(M / NL_BM)), clusters of RNL_SPLIT along x,
// NL_WARPS · 32 threads, mlp_block_smem_bytes() (the host's) of dynamic shared memory.
// select_mlp_block (lever 87): a fixed-count pruning step after a block's attention (EViT's) run
// at the head of mlp_block instead of in a launch of its own. Every CTA scores the sequence's
// tokens (select_common::step_score over the rows cls_probs wrote, or given scores), ranks them,
// places the kept ones, and stages its tile's rows straight from the step's input x1 (all `len`
// tokens) through that placement; the CTAs whose tile holds the fused token compute it
// (select_common::fused_columns) into their staged rows. The selection is select_top_k's, one
// header for both, so x2 and qkv' are bit for bit select_top_k followed by mlp_block. At batch 1
// the select launch was ~10 µs under ncu for ~40k comparisons and a 60 KB copy: a chain of
// dependent steps, most of which overlaps the weights' loads here.
// (StepSelect: above, with attention_block's.)

// Shared memory of the selection, in floats (it lives where fc2's partial sums go later):
// scores, keys (then src), kept flags, dropped positions (len each), 32 warp counts, the fused
// row's partial sums (2 · FUSE_COLS · NL_WARPS · 32) and its weights' total.
constexpr int SELECT_MLP_MAX_LEN = SELECT_STEP_MAX_LEN;
constexpr int select_scratch_floats(int len) {
    return 4 * len + 32 + 2 * select_common::FUSE_COLS * NL_WARPS * 32 + 1;
}
static_assert(select_scratch_floats(SELECT_MLP_MAX_LEN) <= 12 * NL_BM * 32, "selection scratch in spart");

// This CTA's NL_BM output rows of the step (rows m0 .. m0 + NL_BM - 1 of the kept tokens in
// ascending position, then the fused token) into `sa` (K + 8 apart): kept rows by cp.async (one
// group, committed here; rows past the output zero-filled). Returns whether the tile holds the
// fused row, which the CTA then computes (select_fused_row, once its other loads are issued).
// Every thread must call it (barriers).
// `v`: thread t's token's score inputs (select_common::step_score_load, token t; the host keeps
// len <= the block's threads), loaded before the weights' cp.async were issued.
template <typename T, int K>
__device__ bool select_stage_rows(T* sa, const T* __restrict__ x1, const StepSelect& sel, int m0, float* scratch,
                                  const float (&v)[select_common::STEP_SCORE_ROWS]) {
    using namespace select_common;
    constexpr int LDS = K + 8, VECS = K / 8;
    const int len = sel.len, kept_n = sel.prefix + sel.keep;
    // The scores, then select_place's keys (then src), kept flags, dropped positions and counts.
    const int* src = select_place(sel, reinterpret_cast<int*>(scratch + len), v, scratch);
    const bool fused_here = sel.fuse && kept_n >= m0 && kept_n < m0 + NL_BM;
    for (int i = threadIdx.x; i < NL_BM * VECS; i += blockDim.x) {
        const int row = i / VECS, c = i % VECS, r = m0 + row;
        if (fused_here && r == kept_n) continue;  // written below, not by a cp.async
        const bool ok = r < kept_n;
        nl_cp_async16(sa + row * LDS + c * 8, x1 + (size_t)(ok ? src[r] : 0) * K + c * 8, ok);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    return fused_here;
}

// The fused row of a CTA whose tile holds it (select_stage_rows' result; uniform over the CTA),
// into its staged row: select_common's fused_columns8 (fused_columns' bits, 16-byte row loads),
// from the scores, the dropped positions and the scratch select_stage_rows left in `scratch`.
// Every thread must call it (barriers).
template <typename T, int K>
__device__ void select_fused_row(T* sa, const T* __restrict__ x1, const StepSelect& sel, int m0, float* scratch) {
    using namespace select_common;
    constexpr int LDS = K + 8;
    const int len = sel.len, kept_n = sel.prefix + sel.keep, nd = len - kept_n;
    const float* sc = scratch;
    const int* dropped = reinterpret_cast<const int*>(sc + len) + 2 * len;
    float* part = const_cast<float*>(reinterpret_cast<const float*>(dropped + len + 32));
    float* total = part + 2 * select_common::FUSE_COLS * NL_WARPS * 32;
    static_assert(2 * FUSE_GROUPS * K <= 2 * FUSE_COLS * NL_WARPS * 32 && FUSE_GROUPS * K / 8 <= NL_WARPS * 32,
                  "fused_columns8's partials in the scratch, a thread per (partial, 8 columns)");
    fused_weight_total(sc, dropped, nd, total);
    __syncthreads();
    T* fused = sa + (kept_n - m0) * LDS;
    fused_columns8(
        sc, dropped, nd, sel.fuse, *total, K, part,
        [&](int j, int c) { return *reinterpret_cast<const uint4*>(x1 + (size_t)j * K + c); },
        [](const uint4& raw, int e) { return to_f32(reinterpret_cast<const T*>(&raw)[e]); },
        [&](int c, float f) { fused[c] = from_f32<T>(f); });
}

// SELECT (select_mlp_block): x1 holds the step's `sel.len` input tokens, M = the kept tokens and
// the fused one; the rows come through select_stage_rows, after the weights' loads are issued.
template <typename T, int K, bool SELECT = false>
__device__ void mlp_block_tile(const T* __restrict__ x1, const T* __restrict__ ln_w, const T* __restrict__ ln_b,
                               const T* __restrict__ w1, const T* __restrict__ b1, int M, int N1, float eps2,
                               ArnlNext<T> nx, StepSelect sel = StepSelect{}) {
    constexpr int LDS = K + 8, VECS = K / 8, CHUNKS = (VECS + 31) / 32, BN = 128, SLICE = K / RNL_SPLIT;
    constexpr int WARPS_N = BN / 32, MMA_WARPS = (NL_BM / 16) * WARPS_N, LDY = RNL_SPLIT * BN + 8;
    static_assert(RNL_SPLIT * BN == 4 * K && SLICE == 32 && NL_BM <= NL_WARPS, "tile shape");
    extern __shared__ __align__(16) unsigned char nl_smem[];
    const uint32_t bars = smem_addr(nl_smem);  // the exchanges' barriers (RNL_BAR_BYTES)
    T* sa = reinterpret_cast<T*>(nl_smem + RNL_BAR_BYTES);  // x1's rows, normalised in place; then x2
    T* sb = sa + NL_BM * LDS;                                // fc1's BN weight rows
    T* sh = sb + BN * LDS;                                   // the fc1 tile's rows, 4C wide (the cluster's)
    T* sw2 = sh + NL_BM * LDY;                               // this rank's SLICE rows of W2, 4C wide
    T* swq = sw2 + SLICE * (4 * K + 8);                      // the next qkv's 96-row tile
    float* spart = reinterpret_cast<float*>(swq + 96 * LDS);  // fc2's partial sums, [12][NL_BM][SLICE]
    const int rank = blockIdx.x, m0 = blockIdx.y * NL_BM, n0 = rank * BN;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    // Its two exchanges (the fc1 tile, x2), armed before the entry cluster arrive.
    xbar_arm<2>(bars + 8 * BAR_FC1, {NL_BM * (uint32_t)N1 * (uint32_t)sizeof(T), NL_BM * K * (uint32_t)sizeof(T)});
    asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");

    // 1. x1's rows, fc1's weight rows, then W2's slice and the qkv tile (used ~2 µs later): three
    // cp.async groups. The LayerNorm's parameters and fc1's bias pairs, and the second step's
    // registers (the next LayerNorm's parameters, the qkv tile's bias pairs, the x1 pair and
    // fc2's bias pair a thread below RNL_PAIRS finishes).
    // SELECT: the scores' loads first (a few floats a thread, ahead of every weight byte in the
    // SM's queue), then fc1's weights, which land while the tokens are ranked; the rows once
    // placed, then W2's slice and the qkv tile (needed ~2 µs later), so that the rows do not
    // queue behind those 86 KB; then the fused row's tile computes it (lever 91: before, its
    // CTAs issued W2's and the qkv tile's loads only after the fused row).
    float score_in[select_common::STEP_SCORE_ROWS];
    if (SELECT) {
        if (tid < sel.len) select_common::step_score_load(sel.scores, sel.len, tid, sel.mode, sel.heads, score_in);
    } else {
        nl_stage_rows<T, K, NL_BM>(sa, x1, m0, M);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    nl_stage_rows<T, K, BN>(sb, w1, n0, N1);
    asm volatile("cp.async.commit_group;" ::: "memory");
    auto stage_second_weights = [&] {
        nl_stage_rows<T, 4 * K, SLICE>(sw2, nx.w2, rank * SLICE, K);
        nl_stage_rows<T, K, 96>(swq, nx.wq, rank * 96, nx.N2);
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    if (!SELECT) stage_second_weights();
    uint4 wraw[CHUNKS], braw[CHUNKS];
    layer_norm_params<CHUNKS>(ln_w, ln_b, wraw, braw, VECS, lane);
    float bias_f[4][2];
    nl_load_bias(bias_f, b1, n0 + wn * 32, N1);
    RnlRegs<K> g2;
    // SELECT: the residual pair comes from the staged rows below (0 rows: no read here).
    rnl_load_regs<T, K, 96>(g2, nx.ln_w, nx.ln_b, nx.bq, x1, nx.b2, SELECT ? 0 : M, nx.N2);
    if (SELECT) {
        // The fused row's tile issues W2's and the qkv tile's loads before computing it.
        const bool fused_here = select_stage_rows<T, K>(sa, x1, sel, m0, spart, score_in);
        stage_second_weights();
        if (fused_here) select_fused_row<T, K>(sa, x1, sel, m0, spart);
        asm volatile("cp.async.wait_group 1;" ::: "memory");  // fc1's weights and the rows
        __syncthreads();
        // The x1 pair this thread finishes (rnl_load_regs's), before norm2 overwrites the rows.
        constexpr int RNL_PAIRS = NL_BM * SLICE / 2;
        if (tid < RNL_PAIRS) {
            const int prow = tid / (SLICE / 2), pcol = rank * SLICE + (tid % (SLICE / 2)) * 2;
            const NlPair<T> p = *reinterpret_cast<const NlPair<T>*>(sa + prow * LDS + pcol);
            g2.res[0] = to_f32(p.a);
            g2.res[1] = to_f32(p.b);
        }
        __syncthreads();
    } else {
        asm volatile("cp.async.wait_group 2;" ::: "memory");
        __syncthreads();
    }

    // 2. norm2, the rows normalised in place.
    nl_normalize_rows<CHUNKS, T, K, LDS>(sa, wraw, braw, eps2);
    asm volatile("cp.async.wait_group 1;" ::: "memory");
    __syncthreads();

    // 3. fc1's 16 × 128 tile, a 16 × 32 slice per warp, bias, GELU, pushed into every cluster
    // CTA's `sh` (the whole cluster is running by the wait).
    asm volatile("barrier.cluster.wait;" ::: "memory");
    if (warp < MMA_WARPS)
        nl_slice_to_cluster<T, K, BN, true>(sa + wm * 16 * LDS, sb + wn * 32 * LDS, bias_f, sh, wm * 16, n0 + wn * 32,
                                            N1, bars + 8 * BAR_FC1);
    // 4. Every CTA's fc1 tile here, W2's and the qkv tile's rows landed; then fc2 + residual, x2
    // into every cluster CTA's `sa` (pushed only once every CTA's fc1 tile is here, i.e. after
    // every CTA's last read of its own `sa`), norm1', the qkv tile.
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    xbar_wait(bars + 8 * BAR_FC1);
    __syncthreads();
    rnl_finish<T, K, 4 * K, 12, 96, false, false>(sa, swq, sh, sw2, spart, g2, nx.x2, nx.qkv, M, nx.N2, nx.eps,
                                                  bars + 8 * BAR_X2);
}

// One entry per storage type, named as the Rust side's MLP_BLOCK_NAMES expects.
#define MLP_BLOCK_ENTRY(SUFFIX, T)                                                                           \
    extern "C" __global__ void __cluster_dims__(RNL_SPLIT, 1, 1) __launch_bounds__(NL_WARPS * 32)           \
        fastpath_mlp_block_##SUFFIX##_c192(const T* x1, const T* ln2_w, const T* ln2_b, const T* w1,         \
                                           const T* b1, const T* w2, const T* b2, const T* ln1_w,            \
                                           const T* ln1_b, const T* wq, const T* bq, T* x2, T* qkv_next,     \
                                           int M, int N1, int N2, float eps2, float eps1) {                 \
        mlp_block_tile<T, 192>(x1, ln2_w, ln2_b, w1, b1, M, N1, eps2,                                       \
                               ArnlNext<T>{w2, b2, ln1_w, ln1_b, wq, bq, x2, qkv_next, N2, eps1, nullptr}); \
    }
MLP_BLOCK_ENTRY(f16, __half)
MLP_BLOCK_ENTRY(bf16, __nv_bfloat16)

// select_mlp_block's entries, named as the Rust side's SELECT_MLP_BLOCK_NAMES expects: x1 the
// step's input [len, C], `scores` its score rows, M = prefix + keep (+ 1 with fuse) output rows.
#define SELECT_MLP_BLOCK_ENTRY(SUFFIX, T)                                                                    \
    extern "C" __global__ void __cluster_dims__(RNL_SPLIT, 1, 1) __launch_bounds__(NL_WARPS * 32)           \
        fastpath_select_mlp_block_##SUFFIX##_c192(                                                           \
            const T* x1, const float* scores, int len, int prefix, int keep, int fuse, int mode, int heads,  \
            const T* ln2_w, const T* ln2_b, const T* w1, const T* b1, const T* w2, const T* b2,             \
            const T* ln1_w, const T* ln1_b, const T* wq, const T* bq, T* x2, T* qkv_next, int M, int N1,    \
            int N2, float eps2, float eps1) {                                                                \
        mlp_block_tile<T, 192, true>(x1, ln2_w, ln2_b, w1, b1, M, N1, eps2,                                 \
                                     ArnlNext<T>{w2, b2, ln1_w, ln1_b, wq, bq, x2, qkv_next, N2, eps1, nullptr}, \
                                     StepSelect{scores, len, prefix, keep, fuse, mode, heads});              \
    }
SELECT_MLP_BLOCK_ENTRY(f16, __half)
SELECT_MLP_BLOCK_ENTRY(bf16, __nv_bfloat16)

#endif

// ---------------------------------------------------------------------------------------------
// pooled_mlp_log_prob: DynamicViT's score head (its `out_conv` and log-softmax) over packed rows,
// in two launches where the composed path runs eight (lever 80 in docs/LEVERS.md):
//   g_b   = round(mean_b(h[:, H:2H]) · W0[:, H:2H]ᵀ + b0)               per sequence b
//   y0_r  = round(gelu(round(h_r[0:H] · W0[:, 0:H]ᵀ + g_{seq(r)})))      per row r
//   y1_r  = round(gelu(round(y0_r · W1ᵀ + b1)))
//   out_r = log_softmax(round(y1_r · W2ᵀ + b2))[cls]                     (f32)
// h [rows, 2H] is in_conv's output; the mean runs over each sequence's rows after its first
// `skip` (class / distillation tokens), with sequence_mean's arithmetic (candle-ragged); W0
// [H, 2H] (both halves read in place), W1 [Q, H] with Q = H / 2, W2 [K, Q]. Every rounding point
// is the composed path's (cuBLASLt epilogues, the GELU pass in its Φ form, linear_log_prob's
// row); only the GEMMs' summation order differs. At batch 1–8 the composed path's kernels are a
// few hundred KB of work each, so their launches and dependent ramps are what it costs.
constexpr int PH_WARPS = 8, PH_THREADS = PH_WARPS * 32;
constexpr int PH_BM = 16;         // rows per tail CTA
constexpr int PH_POOL_COLS = 32;  // g outputs per pooling CTA
constexpr int PH_MAX_CU = 1024;   // sequences whose offsets the tail stages in shared memory

// Kernel 1, grid (B, ceil(H / PH_POOL_COLS)): each CTA averages its sequence's pooled half (all
// H columns; each CTA of the sequence does, rather than wait on another) and computes
// PH_POOL_COLS outputs of g_b. Its rows of W0's pooled half are requested first, so that they
// arrive while the mean is summed.
template <typename T, int H>
__device__ void pooled_head_pool(const T* __restrict__ h, const uint32_t* __restrict__ cu, int skip,
                                 const T* __restrict__ w0, const T* __restrict__ b0, T* __restrict__ g) {
    constexpr int VECS = H / 8, LDW = H + 8;  // 16-byte chunks of a row's pooled half
    static_assert(H % 8 == 0 && VECS <= 64, "pooled half width");
    __shared__ float partial[PH_WARPS][H];
    __shared__ __align__(16) float mean[H];
    __shared__ __align__(16) T sw[PH_POOL_COLS * LDW];
    const int b = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n0 = blockIdx.y * PH_POOL_COLS;
    for (int i = threadIdx.x; i < PH_POOL_COLS * VECS; i += PH_THREADS) {
        const int r = i / VECS, c = i % VECS;
        const bool ok = n0 + r < H;
        nl_cp_async16(sw + r * LDW + c * 8, w0 + (size_t)(ok ? n0 + r : 0) * (2 * H) + H + c * 8, ok);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    const int first = (int)cu[b] + skip, end = (int)cu[b + 1];
    // sequence_mean's order: warp w sums rows first + w, first + w + 8, ... per column.
#pragma unroll
    for (int v0 = 0; v0 < VECS; v0 += 32) {
        const int v = v0 + lane;
        if (v < VECS) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            // Four rows' loads in flight before their adds (the adds stay in row order).
            const T* col = h + H + v * 8;
            for (int r = first + warp; r < end; r += 4 * PH_WARPS) {
                uint4 raw[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int ru = r + u * PH_WARPS;
                    raw[u] = ru < end ? *reinterpret_cast<const uint4*>(col + (size_t)ru * (2 * H)) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    if (r + u * PH_WARPS >= end) break;
                    const T* e = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[i] += to_f32(e[i]);
                }
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) partial[warp][v * 8 + i] = acc[i];
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    for (int c = threadIdx.x; c < H; c += PH_THREADS) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < PH_WARPS; ++i) s += partial[i][c];
        mean[c] = to_f32(from_f32<T>(__fdiv_rn(s, (float)(end - first))));
    }
    __syncthreads();
    // g_b[n]: lane l dots the 16-byte chunks l, l + 32 of W0's row n with the mean, in element
    // order, then a butterfly over the lanes; PH_POOL_COLS / PH_WARPS outputs per warp.
#pragma unroll
    for (int j = 0; j < PH_POOL_COLS / PH_WARPS; ++j) {
        const int r = warp * (PH_POOL_COLS / PH_WARPS) + j, n = n0 + r;
        float acc = 0.f;
#pragma unroll
        for (int v0 = 0; v0 < VECS; v0 += 32) {
            const int v = v0 + lane;
            if (v < VECS) {
                const uint4 raw = *reinterpret_cast<const uint4*>(sw + r * LDW + v * 8);
                const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc = fmaf(mean[v * 8 + i], to_f32(e[i]), acc);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0 && n < H) g[(size_t)b * H + n] = from_f32<T>(acc + to_f32(b0[n]));
    }
}

// acc (two m16n8 accumulators: columns n0..n0+15) += A · Bᵀ over K for one warp: A the 16 rows at
// `a`, B's rows n0.. at `b`, both in shared memory (LDS elements apart), read by ldmatrix.
template <typename T, int K, int LDS>
__device__ __forceinline__ void ph_warp_mma_16x16(float (&acc)[2][4], const T* a, const T* b, int n0) {
    const unsigned lane = threadIdx.x % 32;
    const T* a_base = a + (lane % 16) * LDS + (lane / 16) * 8;
    const T* b_base = b + (n0 + (lane % 8) + (lane / 16) * 8) * LDS + ((lane / 8) % 2) * 8;
#pragma unroll 4
    for (int k0 = 0; k0 < K; k0 += 16) {
        unsigned ra[4], rb[4];
        nl_ldmatrix_x4(ra, a_base + k0);
        nl_ldmatrix_x4(rb, b_base + k0);
        nl_mma<T>(acc[0], ra, rb[0], rb[1]);
        nl_mma<T>(acc[1], ra, rb[2], rb[3]);
    }
}

// The tail kernel's dynamic shared memory, in bytes, region by region (16-byte aligned each):
// the rows (a0: local halves, two tiles' worth; a1: y0; a2: y1), the layers' weights (W0's local
// half, W1, W2, b1, b2), the offsets (PH_MAX_CU + 1 of them) and each row's sequence.
// pooled_head_rows_smem_bytes in candle-fastpath/src/cuda.rs computes the same total.
__host__ __device__ constexpr int ph_align16(int bytes) { return (bytes + 15) / 16 * 16; }
// Steps 3 and 4 of pooled_head_rows' epilogue for one warp's 16 × 16 unit (acc from
// ph_warp_mma_16x16, columns n0 ..): round(gelu(round(acc + addend))) for each pair of columns,
// into `dst` (LD elements a row). `addend(j, hh)`: the f32 pair added to the accumulators of
// n-tile j, row half hh (rows lane / 4 + 8 hh, columns n0 + 8 j + 2 (lane % 4) and the next).
template <typename T, int LD, typename Addend>
__device__ __forceinline__ void ph_gelu_epilogue(const float (&acc)[2][4], int n0, T* dst, Addend addend) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int col = n0 + j * 8 + (lane % 4) * 2;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = lane / 4 + hh * 8;
            const float2 add = addend(j, hh);
            const T v0 = from_f32<T>(acc[j][2 * hh] + add.x);
            const T v1 = from_f32<T>(acc[j][2 * hh + 1] + add.y);
            *reinterpret_cast<NlPair<T>*>(dst + row * LD + col) =
                NlPair<T>{from_f32<T>(gelu_phi(to_f32(v0))), from_f32<T>(gelu_phi(to_f32(v1)))};
        }
    }
}

template <typename T, int H> struct PhLayout {
    static constexpr int Q = H / 2, LDA = H + 8, LDQ = Q + 8;
    static constexpr int A0 = 0;  // two buffers: the next tile's rows arrive during this one
    static constexpr int A1 = A0 + 2 * ph_align16(PH_BM * LDA * (int)sizeof(T));
    static constexpr int A2 = A1 + ph_align16(PH_BM * LDA * (int)sizeof(T));
    static constexpr int W0 = A2 + ph_align16(PH_BM * LDQ * (int)sizeof(T));
    static constexpr int W1 = W0 + ph_align16(H * LDA * (int)sizeof(T));
    static constexpr int W2 = W1 + ph_align16(Q * LDA * (int)sizeof(T));
    static constexpr int B1 = W2 + ph_align16(HEAD_MAX_CLASSES * Q * (int)sizeof(T));
    static constexpr int B2 = B1 + ph_align16(Q * (int)sizeof(T));
    static constexpr int CU = B2 + ph_align16(HEAD_MAX_CLASSES * (int)sizeof(T));
    static constexpr int SEQ = CU + ph_align16((PH_MAX_CU + 1) * 4);
    static constexpr int BYTES = SEQ + ph_align16(PH_BM * 4);
};

// Kernel 2, persistent: grid at most ceil(rows / PH_BM), PhLayout<T, H>::BYTES of dynamic shared
// memory; CTA i takes row tiles i, i + gridDim.x, ... of PH_BM rows each through the three
// layers, the intermediate rows kept in shared memory. The weights and offsets are requested
// once per CTA, with its first tile; each next tile's rows are requested before
// the current one is computed. A thread's g pairs are requested once its rows' sequences are
// known, before the first product, so that they arrive during it.
template <typename T, int H>
__device__ __forceinline__ void ph_stage_tile(T* dst, const T* __restrict__ h, int m0, int rows) {
    constexpr int LDA = H + 8;
    for (int i = threadIdx.x; i < PH_BM * (H / 8); i += PH_THREADS) {
        const int r = i / (H / 8), c = i % (H / 8);
        const bool ok = m0 + r < rows;
        nl_cp_async16(dst + r * LDA + c * 8, h + (size_t)(ok ? m0 + r : 0) * (2 * H) + c * 8, ok);
    }
}

template <typename T, int H>
__device__ void pooled_head_rows(const T* __restrict__ h, const T* __restrict__ g, const uint32_t* __restrict__ cu,
                                 int nseq, const T* __restrict__ w0, const T* __restrict__ w1,
                                 const T* __restrict__ b1, const T* __restrict__ w2, const T* __restrict__ b2,
                                 int K, int cls, float* __restrict__ out, int rows) {
    using L = PhLayout<T, H>;
    constexpr int Q = L::Q, LDA = L::LDA, LDQ = L::LDQ;
    constexpr int A_TILE = L::A1 / 2 / (int)sizeof(T);  // elements between the two row buffers
    static_assert(H % 32 == 0 && H <= 192, "tail widths: the weights must fit in shared memory");
    extern __shared__ __align__(16) unsigned char ph_smem[];
    T* a0 = reinterpret_cast<T*>(ph_smem + L::A0);
    T* a1 = reinterpret_cast<T*>(ph_smem + L::A1);
    T* a2 = reinterpret_cast<T*>(ph_smem + L::A2);
    T* sw0 = reinterpret_cast<T*>(ph_smem + L::W0);
    T* sw1 = reinterpret_cast<T*>(ph_smem + L::W1);
    uint32_t* scu = reinterpret_cast<uint32_t*>(ph_smem + L::CU);
    int* seq = reinterpret_cast<int*>(ph_smem + L::SEQ);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int tiles = (rows + PH_BM - 1) / PH_BM;
    const bool cu_staged = nseq + 1 <= PH_MAX_CU + 1;

    // One wave of requests: the first tile's rows, the offsets and the weights.
    ph_stage_tile<T, H>(a0, h, blockIdx.x * PH_BM, rows);
    if (cu_staged) {
        for (int i = tid; i <= nseq; i += PH_THREADS) {
            const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(scu + i));
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(cu + i) : "memory");
        }
    }
    {
        for (int i = tid; i < H * (H / 8); i += PH_THREADS) {
            const int r = i / (H / 8), c = i % (H / 8);
            nl_cp_async16(sw0 + r * LDA + c * 8, w0 + (size_t)r * (2 * H) + c * 8, true);
        }
        for (int i = tid; i < Q * (H / 8); i += PH_THREADS) {
            const int r = i / (H / 8), c = i % (H / 8);
            nl_cp_async16(sw1 + r * LDA + c * 8, w1 + (size_t)r * H + c * 8, true);
        }
        T* sw2 = reinterpret_cast<T*>(ph_smem + L::W2);
        T* sb1 = reinterpret_cast<T*>(ph_smem + L::B1);
        T* sb2 = reinterpret_cast<T*>(ph_smem + L::B2);
        for (int i = tid; i < K * Q; i += PH_THREADS) sw2[i] = w2[i];
        for (int i = tid; i < Q; i += PH_THREADS) sb1[i] = b1[i];
        if (tid < K) sb2[tid] = b2[tid];
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    const T* sb1 = reinterpret_cast<const T*>(ph_smem + L::B1);
    const T* sw2 = reinterpret_cast<const T*>(ph_smem + L::W2);
    const T* sb2 = reinterpret_cast<const T*>(ph_smem + L::B2);

    int buf = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x, buf ^= 1) {
        const int m0 = t * PH_BM;
        const T* at = a0 + buf * A_TILE;
        // 1. The next tile's rows requested; this tile's (and, the first time, everything else)
        //    awaited.
        if (t + (int)gridDim.x < tiles) {
            ph_stage_tile<T, H>(a0 + (buf ^ 1) * A_TILE, h, (t + gridDim.x) * PH_BM, rows);
            asm volatile("cp.async.commit_group;" ::: "memory");
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        __syncthreads();

        // 2. Each row's sequence: the last b with cu[b] <= row (rows past cu[nseq], a capacity
        //    tail, take the last sequence: their values are never read).
        if (tid < PH_BM) {
            const unsigned r = (unsigned)(m0 + tid);
            const uint32_t* c = cu_staged ? scu : cu;
            int lo = 0, hi = nseq - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) / 2;
                if (c[mid] <= r) lo = mid;
                else hi = mid - 1;
            }
            seq[tid] = lo;
        }
        __syncthreads();

        // 3. y0 = round(gelu(round(local · W0[:, :H]ᵀ + g))), 16 columns per warp unit.
        for (int n0 = warp * 16; n0 < H; n0 += PH_WARPS * 16) {
            NlPair<T> gv[2][2];
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
                    gv[j][hh] = *reinterpret_cast<const NlPair<T>*>(g + (size_t)seq[lane / 4 + hh * 8] * H + n0 +
                                                                     j * 8 + (lane % 4) * 2);
            float acc[2][4] = {};
            ph_warp_mma_16x16<T, H, LDA>(acc, at, sw0, n0);
            ph_gelu_epilogue<T, LDA>(acc, n0, a1, [&](int j, int hh) {
                return make_float2(to_f32(gv[j][hh].a), to_f32(gv[j][hh].b));
            });
        }
        __syncthreads();

        // 4. y1 = round(gelu(round(y0 · W1ᵀ + b1))).
        for (int n0 = warp * 16; n0 < Q; n0 += PH_WARPS * 16) {
            float bb[2][2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int col = n0 + j * 8 + (lane % 4) * 2;
                bb[j][0] = to_f32(sb1[col]);
                bb[j][1] = to_f32(sb1[col + 1]);
            }
            float acc[2][4] = {};
            ph_warp_mma_16x16<T, H, LDA>(acc, a1, sw1, n0);
            ph_gelu_epilogue<T, LDQ>(acc, n0, a2, [&](int j, int) { return make_float2(bb[j][0], bb[j][1]); });
        }
        __syncthreads();

        // 5. The keep log-probability, a warp per row. The next iteration's first barrier keeps
        //    a2 and seq from being overwritten before every warp is done with them.
        for (int row = warp; row < PH_BM; row += PH_WARPS) {
            const float lp = row_log_prob<T>(a2 + row * LDQ, sw2, sb2, Q, K, cls);
            if (lane == 0 && m0 + row < rows) out[m0 + row] = lp;
        }
    }
}

#define POOLED_HEAD_ENTRY(SUFFIX, T, H)                                                                      \
    extern "C" __global__ void __launch_bounds__(PH_THREADS)                                                \
        fastpath_pooled_head_pool_##SUFFIX##_h##H(const T* h, const uint32_t* cu, int skip, const T* w0,   \
                                                  const T* b0, T* g) {                                     \
        pooled_head_pool<T, H>(h, cu, skip, w0, b0, g);                                                     \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(PH_THREADS)                                                \
        fastpath_pooled_head_rows_##SUFFIX##_h##H(const T* h, const T* g, const uint32_t* cu, int nseq,    \
                                                  const T* w0, const T* w1, const T* b1, const T* w2,      \
                                                  const T* b2, int K, int cls, float* out, int rows) {     \
        pooled_head_rows<T, H>(h, g, cu, nseq, w0, w1, b1, w2, b2, K, cls, out, rows);                      \
    }
POOLED_HEAD_ENTRY(f16, __half, 96)
POOLED_HEAD_ENTRY(f16, __half, 192)
POOLED_HEAD_ENTRY(bf16, __nv_bfloat16, 96)
POOLED_HEAD_ENTRY(bf16, __nv_bfloat16, 192)
