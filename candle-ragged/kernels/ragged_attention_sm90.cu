// Ragged attention on Hopper's warpgroup MMA (wgmma), f16 / bf16, head_dim 64, sequences up to
// WG_MAX_LEN tokens. Same arguments, layouts and results as the resident kernel of
// ragged_attention.cu (see its header): q, k, v [total, heads, 64] with free token / head
// strides (16-byte aligned), o contiguous, cu_seqlens [batch + 1].
//
// Compiled for compute_90a only (wgmma has no other target); build.rs makes it a second PTX
// module when CUDA_COMPUTE_CAP >= 90.
//
// Why: the mma.sync kernels are bound by each warp's dependent chain of small MMAs and exp2 at
// 17-27 % occupancy (docs/BENCHMARKS.md, levers 24-42). One wgmma multiplies a 64 x 64 x 16
// block for a whole warpgroup, asynchronously, with B read straight from shared memory (no
// ldmatrix fragments in registers), so a 64-query tile takes 4 + 4 MMA instructions per 64 keys
// instead of 64 + 64 per warp.
//
// Status (lever 46, H100): correct (test-attention, memcheck, racecheck) and at parity with the
// resident kernel, not faster: 0.97-1.19x its time at batch 64/256, 0.56-1.03x at batch 8 (slower
// at keep >= 0.7: one block per (sequence, head) walks its query tiles one after another). ncu at
// 12 heads, batch 256: DRAM 42-48 % of peak, 18-24 % active warps, issue slots 50-54 % busy (the
// resident kernel: the same DRAM, 27 % warps, 47 %). Taking the mask and the scale multiply out
// of full chunks cut issue from 56-58 % without moving the time; a persistent form streaming K /
// V through a ring of chunk buffers across pairs (lever 47: four warpgroups, one block per SM,
// a barrier per chunk) was 0.56-0.80x. So the bound is each warpgroup's serial chain per chunk
// (S, wait, softmax, P V, wait) at these few warps, not MMA instructions, issue or load
// overlap alone; an A/B arm (CANDLE_RAGGED_ATTENTION=wgmma1) and the base for a kernel with two
// independent chains per warpgroup (FlashAttention-3's ping-pong: one tile's softmax while the
// other's MMAs run, S(c + 1) issued before softmax(c)).
//
// Grid (1, heads, batch), WGS warpgroups per block. A block stages K and V of its
// (sequence, head) in shared memory once, in 64-key chunks (one cp.async group each, rows past
// the end zero-filled), in the 128-byte-swizzled layout wgmma reads; warpgroup w then takes query
// tiles w, w + WGS, ... of 64 rows: Q as register A fragments, S = Q K^T per 64-key chunk
// (K-major B), an online softmax on the accumulators, P re-packed in registers as the A operand
// of O += P V (V as an N-major B). The first tile starts on chunk 0 while later chunks land.
// Two warpgroups per block (same code, WGS = 2) measured 0.74-1.09x the resident kernel (two
// blocks per SM by registers): not built.
//
// Levers 48-49 (docs/BENCHMARKS.md; code in docs/benchmarks/history/lever49-wgmma-pool.patch, not
// kept): this kernel pipelined as FlashAttention-3 does (no change), and persistent kernels with
// one block per SM whose consumer warpgroups own whole (sequence, head) pairs and share a pool of
// K / V slots, the next pairs loading while others compute. All correct; the best (3 warpgroups,
// no spills) ran 0.90x the resident kernel at f16 12 heads 256 keep 0.7, 1.00x at keep 1.0.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "attention_common.cuh"
#include "wgmma_common.cuh"

#define WG_MAX_LEN 256

namespace {

constexpr int D = 64;
constexpr int CHUNK = 64;            // keys per online-softmax step
constexpr int ROW_BYTES = D * 2;     // one key row: one 128-byte swizzle row
constexpr int CHUNK_BYTES = CHUNK * ROW_BYTES;

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Waits until at most `pending` (0..3) of this thread's cp.async groups are still in flight.
__device__ __forceinline__ void cp_async_wait_dynamic(int pending) {
    switch (pending) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    default: cp_async_wait<3>(); break;
    }
}

// Byte offset of 16-byte chunk c of row r in a tile of 128-byte rows under the 128-byte swizzle
// (chunk index XOR row mod 8; the tile starts 1024-byte aligned, as the swizzle is on address bits).
__device__ __forceinline__ uint32_t swizzled(int r, int c) { return r * ROW_BYTES + ((c ^ (r & 7)) << 4); }



// d (64 x 64 f32, the warpgroup's accumulator layout) = [d +] A (64 x 16, registers) * B (16 x 64
// from the descriptor); TRANS_B: B is N-major. scale_d == 0 ignores d's old value.
#define WGMMA_64x64x16(NAME, TYPE)                                                                    \
    template <int TRANS_B>                                                                           \
    __device__ __forceinline__ void NAME(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, int scale_d) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                   \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                  \
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "        \
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
                     "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                  \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),         \
                       "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),       \
                       "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),   \
                       "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),   \
                       "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),   \
                       "+f"(d[30]), "+f"(d[31])                                                        \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d),           \
                       "n"(TRANS_B));                                                                  \
    }
WGMMA_64x64x16(wgmma_f16, "f16")
WGMMA_64x64x16(wgmma_bf16, "bf16")

template <typename T> struct Mma;
template <> struct Mma<__half> {
    template <int TRANS_B>
    static __device__ __forceinline__ void run(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
        wgmma_f16<TRANS_B>(d, a, desc, scale_d);
    }
};
template <> struct Mma<__nv_bfloat16> {
    template <int TRANS_B>
    static __device__ __forceinline__ void run(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
        wgmma_bf16<TRANS_B>(d, a, desc, scale_d);
    }
};

template <bool MAX> __device__ __forceinline__ float extremum(float a, float b) { return MAX ? fmaxf(a, b) : fminf(a, b); }

// The max (MAX) or min of rows g and g + 8 of a chunk's 64 x 64 accumulator tile (this thread's
// 16 values of each, then its quad's), every thread of the quad getting both.
template <bool MAX> __device__ __forceinline__ float2 row_extrema(const float (&s)[32]) {
    float e0 = s[0], e1 = s[2];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        e0 = extremum<MAX>(e0, extremum<MAX>(s[4 * j + 0], s[4 * j + 1]));
        e1 = extremum<MAX>(e1, extremum<MAX>(s[4 * j + 2], s[4 * j + 3]));
    }
#pragma unroll
    for (int lanes = 1; lanes <= 2; lanes *= 2) {
        e0 = extremum<MAX>(e0, __shfl_xor_sync(0xffffffff, e0, lanes));
        e1 = extremum<MAX>(e1, __shfl_xor_sync(0xffffffff, e1, lanes));
    }
    return make_float2(e0, e1);
}

// Rows row0 and row0 + 8 of Q (one warp's share of a 64-row tile) as the A fragments of four
// k-steps; rows past the end are zero.
template <typename T>
__device__ __forceinline__ void load_q(uint32_t (&qa)[4][4], const T *qh, long long q_tok, int row0, int len, int t) {
    const int row1 = row0 + 8;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const int c = kk * 16 + t * 2;
        qa[kk][0] = row0 < len ? *reinterpret_cast<const uint32_t *>(qh + row0 * q_tok + c) : 0u;
        qa[kk][1] = row1 < len ? *reinterpret_cast<const uint32_t *>(qh + row1 * q_tok + c) : 0u;
        qa[kk][2] = row0 < len ? *reinterpret_cast<const uint32_t *>(qh + row0 * q_tok + c + 8) : 0u;
        qa[kk][3] = row1 < len ? *reinterpret_cast<const uint32_t *>(qh + row1 * q_tok + c + 8) : 0u;
    }
}

template <typename T, int WGS>
__device__ __forceinline__ void attn_wgmma_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                                                  T *__restrict__ o, const uint32_t *__restrict__ cu_seqlens,
                                                  long long q_tok, long long q_head, long long k_tok, long long k_head,
                                                  long long v_tok, long long v_head, int heads, float scale_log2,
                                                  int uniform_len) {
    extern __shared__ __align__(16) uint8_t smem_raw[];
    const int b = blockIdx.z, h = blockIdx.y;
    int start, len;
    sequence_span(cu_seqlens, uniform_len, b, start, len);
    if (len <= 0) return;
    const int chunks = (len + CHUNK - 1) / CHUNK;

    // K then V, each chunks x 8 KB, from the first 1024-byte boundary of the dynamic buffer.
    const uint32_t raw = smem_addr(smem_raw);
    const uint32_t ks = (raw + 1023u) & ~1023u;
    const uint32_t vs = ks + chunks * CHUNK_BYTES;

    const T *kh = k + start * k_tok + h * k_head;
    const T *vh = v + start * v_tok + h * v_head;
    const int tid = threadIdx.x;
    for (int c = 0; c < chunks; ++c) {
        for (int i = tid; i < CHUNK * (D / 8); i += WGS * 128) {
            const int row = c * CHUNK + i / (D / 8), part = i % (D / 8);
            const bool ok = row < len;
            const int src = ok ? row : 0;
            cp_async_16(ks + swizzled(row, part), kh + src * k_tok + part * 8, ok ? 16 : 0);
            cp_async_16(vs + swizzled(row, part), vh + src * v_tok + part * 8, ok ? 16 : 0);
        }
        cp_async_commit();
    }

    const int wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const T *qh = q + start * q_tok + h * q_head;
    T *oh = o + static_cast<long long>(start) * heads * D + h * D;
    const long long o_tok = static_cast<long long>(heads) * D;
    const int tiles = (len + 63) / 64;
    const int iters = (tiles + WGS - 1) / WGS;

    uint32_t qa[4][4];
    for (int it = 0; it < iters; ++it) {
        const int tile = it * WGS + wg;
        const bool active = tile < tiles;  // uniform over the warpgroup
        const int row0 = tile * 64 + warp * 16 + g, row1 = row0 + 8;

        float acc[32];
        float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
        if (it == 0 && active) load_q(qa, qh, q_tok, row0, len, t);
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] = 0.f;

        for (int c = 0; c < chunks; ++c) {
            if (it == 0) {
                // Chunk c has landed (every thread's copies), and is visible to wgmma's async proxy.
                cp_async_wait_dynamic(chunks - 1 - c);
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                __syncthreads();
            }
            if (!active) continue;

            // S = Q K^T over the chunk's 64 keys.
            float s[32];
            pin(acc);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                Mma<T>::template run<0>(s, qa[kk], desc_k_major(ks + c * CHUNK_BYTES + kk * 32), kk > 0);
            wg_commit();
            wg_wait0();
            pin(s);
            pin(acc);

            // The next tile's Q, now that this tile's last S is done: its loads fly during the
            // softmax, P V and the stores below instead of stalling the next tile's first MMA.
            if (c == chunks - 1 && it + 1 < iters) load_q(qa, qh, q_tok, (tile + WGS) * 64 + warp * 16 + g, len, t);

            // Online softmax in log2 units. A full chunk (every key real) needs no mask: the row
            // extremum of the raw scores (max for a positive scale, min for a negative one) times
            // the scale is the scaled maximum, and the scale rides in exp2's FMA. The last,
            // partial chunk scales first and masks keys past the end with -inf.
            const int valid = len - c * CHUNK;
            const bool full = valid >= CHUNK;  // uniform over the block
            float2 mx;
            if (full) {
                const float2 e = scale_log2 >= 0.f ? row_extrema<true>(s) : row_extrema<false>(s);
                mx = make_float2(e.x * scale_log2, e.y * scale_log2);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int col = j * 8 + t * 2;
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[4 * j + e] *= scale_log2;
                    if (col >= valid) s[4 * j + 0] = s[4 * j + 2] = -INFINITY;
                    if (col + 1 >= valid) s[4 * j + 1] = s[4 * j + 3] = -INFINITY;
                }
                mx = row_extrema<true>(s);
            }
            const float n0 = fmaxf(m0, mx.x), n1 = fmaxf(m1, mx.y);
            const float a0 = exp2f(m0 - n0), a1 = exp2f(m1 - n1);
            m0 = n0;
            m1 = n1;
            float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                // Full chunks hold raw scores, the partial one scaled scores.
                const float k = full ? scale_log2 : 1.f;
                s[4 * j + 0] = exp2f(fmaf(s[4 * j + 0], k, -n0));
                s[4 * j + 1] = exp2f(fmaf(s[4 * j + 1], k, -n0));
                s[4 * j + 2] = exp2f(fmaf(s[4 * j + 2], k, -n1));
                s[4 * j + 3] = exp2f(fmaf(s[4 * j + 3], k, -n1));
                sum0 += s[4 * j + 0] + s[4 * j + 1];
                sum1 += s[4 * j + 2] + s[4 * j + 3];
            }
            l0 = l0 * a0 + sum0;
            l1 = l1 * a1 + sum1;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                acc[4 * j + 0] *= a0;
                acc[4 * j + 1] *= a0;
                acc[4 * j + 2] *= a1;
                acc[4 * j + 3] *= a1;
            }
            // P as A fragments: k-step kk holds keys 16 kk .. 16 kk + 15 (n8 blocks 2 kk, 2 kk + 1).
            uint32_t pa[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                pa[kk][0] = Pack2<T>::from_floats(s[8 * kk + 0], s[8 * kk + 1]);
                pa[kk][1] = Pack2<T>::from_floats(s[8 * kk + 2], s[8 * kk + 3]);
                pa[kk][2] = Pack2<T>::from_floats(s[8 * kk + 4], s[8 * kk + 5]);
                pa[kk][3] = Pack2<T>::from_floats(s[8 * kk + 6], s[8 * kk + 7]);
            }

            // O += P V over the same keys.
            pin(acc);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                Mma<T>::template run<1>(acc, pa[kk], desc_n_major(vs + c * CHUNK_BYTES + kk * 2048, chunks * CHUNK_BYTES), 1);
            wg_commit();
            wg_wait0();
            pin(acc);
        }
        if (!active) continue;

        l0 += __shfl_xor_sync(0xffffffff, l0, 1);
        l0 += __shfl_xor_sync(0xffffffff, l0, 2);
        l1 += __shfl_xor_sync(0xffffffff, l1, 1);
        l1 += __shfl_xor_sync(0xffffffff, l1, 2);
        const float inv0 = 1.f / l0, inv1 = 1.f / l1;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int col = j * 8 + t * 2;
            if (row0 < len)
                *reinterpret_cast<uint32_t *>(oh + row0 * o_tok + col) = Pack2<T>::from_floats(acc[4 * j + 0] * inv0, acc[4 * j + 1] * inv0);
            if (row1 < len)
                *reinterpret_cast<uint32_t *>(oh + row1 * o_tok + col) = Pack2<T>::from_floats(acc[4 * j + 2] * inv1, acc[4 * j + 3] * inv1);
        }
    }
}

}  // namespace

#define WG_ARGS(T)                                                                                              \
    const T *q, const T *k, const T *v, T *o, const uint32_t *cu_seqlens, long long q_tok, long long q_head,   \
        long long k_tok, long long k_head, long long v_tok, long long v_head, int heads, float scale_log2, \
        int uniform_len
#define WG_PASS q, k, v, o, cu_seqlens, q_tok, q_head, k_tok, k_head, v_tok, v_head, heads, scale_log2, uniform_len

#define WG_ENTRY(NAME, T, WGS, BLOCKS)                                                                  \
    extern "C" __global__ void __launch_bounds__(WGS * 128, BLOCKS) NAME(WG_ARGS(T)) {                 \
        attn_wgmma_kernel<T, WGS>(WG_PASS);                                                             \
    }
WG_ENTRY(ragged_attn_wg1_f16_d64, __half, 1, 4)
WG_ENTRY(ragged_attn_wg1_bf16_d64, __nv_bfloat16, 1, 4)
