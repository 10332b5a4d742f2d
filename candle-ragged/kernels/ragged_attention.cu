// Ragged (packed, variable-length) bidirectional attention, and the pack / unpack copies around it.
//
// Layout conventions (FlashAttention's varlen API):
//   q, k, v : [total_tokens, heads, head_dim], last dim contiguous, token and head strides free
//             (so q, k, v may be strided views of a fused qkv projection [total, 3, heads, head_dim]).
//   o       : [total_tokens, heads, head_dim], contiguous.
//   cu_seqlens : [batch + 1] u32, prefix sums of the sequence lengths; sequence b owns the rows
//             cu_seqlens[b] .. cu_seqlens[b+1].
//
// Grid: (ceil(max_len / 64), heads, batch), computed on the host from values it already knows, so
// nothing waits on the GPU. A block takes 64 queries of one (sequence, head); blocks whose first
// query is past their sequence's end exit at once.
//
// f16 / bf16: tensor cores through mma.sync.m16n8k16 (f32 accumulation), FlashAttention-2 style:
// each of the 4 warps owns 16 query rows, S = Q K^T stays in registers, the online softmax runs
// on the accumulator fragments, and P is re-packed in registers as the A operand of P V. K and V
// are staged in shared memory one key tile at a time with cp.async, double buffered, once per
// block. f32: a plain FMA kernel (one thread per query), exact to f32 rounding.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "attention_warp.cuh"
#include "convert_f32.cuh"
#include "row_norm.cuh"
#include "select_common.cuh"

#define QUERIES_PER_BLOCK 64
#define WARPS 4

namespace {

// Stage keys [key0, key0 + KEYS) of one (sequence, head) into shared memory; rows past the
// sequence's end are zero-filled (their scores are masked below, zeros keep P V finite).
template <typename T, int D>
__device__ __forceinline__ void load_kv_tile(T *ks, T *vs, const T *k, const T *v, long long k_tok, long long v_tok,
                                             int key0, int len) {
    using C = TileCfg<D>;
    for (int i = threadIdx.x; i < C::KEYS * C::CHUNKS; i += WARPS * 32) {
        const int row = i / C::CHUNKS;
        const int chunk = i % C::CHUNKS;
        const int key = key0 + row;
        const bool ok = key < len;
        const int src_key = ok ? key : 0;
        cp_async_16(ks + row * C::ROW + chunk * 8, k + src_key * k_tok + chunk * 8, ok ? 16 : 0);
        cp_async_16(vs + row * C::ROW + chunk * 8, v + src_key * v_tok + chunk * 8, ok ? 16 : 0);
    }
}

// Tiled kernel (any length up to MAX_SEQ_LEN): grid (ceil(max_len / 64), heads, batch), a block
// takes 64 queries of one (sequence, head) and streams K / V through shared memory one key tile at
// a time, double buffered with cp.async.
template <typename T, int D>
__device__ __forceinline__ void attn_mma_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                                                T *__restrict__ o, const uint32_t *__restrict__ cu_seqlens,
                                                long long q_tok, long long q_head, long long k_tok, long long k_head,
                                                long long v_tok, long long v_head, int heads, float scale_log2,
                                                int uniform_len) {
    using C = TileCfg<D>;
    constexpr int KEYS = C::KEYS;

    __shared__ __align__(128) T ks[2][KEYS * C::ROW];
    __shared__ __align__(128) T vs[2][KEYS * C::ROW];

    const int b = blockIdx.z;
    const int h = blockIdx.y;
    int start, len;
    sequence_span(cu_seqlens, uniform_len, b, start, len);
    const int q_block = blockIdx.x * QUERIES_PER_BLOCK;
    if (q_block >= len) return;  // uniform over the block: no barrier is skipped by part of it

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    const T *qh = q + start * q_tok + h * q_head;
    const T *kh = k + start * k_tok + h * k_head;
    const T *vh = v + start * v_tok + h * v_head;

    const int n_tiles = (len + KEYS - 1) / KEYS;
    load_kv_tile<T, D>(ks[0], vs[0], kh, vh, k_tok, v_tok, 0, len);
    cp_async_commit();

    // A warp whose 16 rows all lie past the end only helps with loads and barriers.
    const int row_base = q_block + warp * 16;
    const bool warp_active = row_base < len;
    RowState<D> st;
    begin_rows<T, D>(st, qh, q_tok, row_base, len, lane);

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int buf = tile & 1;
        if (tile + 1 < n_tiles) {
            load_kv_tile<T, D>(ks[buf ^ 1], vs[buf ^ 1], kh, vh, k_tok, v_tok, (tile + 1) * KEYS, len);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (warp_active) {
            const int valid = min(KEYS, len - tile * KEYS);
            if (valid == KEYS) attend_chunk<T, D, KEYS, true, false>(st, ks[buf], vs[buf], KEYS, scale_log2, lane);
            else attend_chunk<T, D, KEYS, false, false>(st, ks[buf], vs[buf], valid, scale_log2, lane);
        }
        __syncthreads();  // this buffer is refilled two tiles from now
    }

    const long long o_tok = static_cast<long long>(heads) * D;
    end_rows<T, D>(st, o + static_cast<long long>(start) * o_tok + h * D, o_tok, row_base, len, lane);
}

// Resident kernel (sequences up to RESIDENT_MAX_LEN, head_dim <= 64): grid (splits, heads, batch),
// blockDim.x / 32 warps per block (chosen on the host: about two 16-row query tiles per warp, so
// that no warp of a block idles while another walks extra tiles). A block stages the whole K and
// V of its (sequence, head) in dynamic shared memory once (one barrier), then every warp walks its
// own query tiles, warp_id, warp_id + warps·splits, ... with warp_id = blockIdx.x · warps + warp,
// over all keys with no further barrier. With splits > 1 (small batches) each split re-reads K / V
// from L2 and every warp takes about one tile.
//
// Key parts (blockDim.y = P > 1; the host picks it when the whole batch is only a few hundred
// warps, e.g. one image): at batch 1 a block's time is one warp's dependent chain over every key
// (ncu: 12 blocks on 132 SMs, ~3,200 instructions per warp at 5.6 cycles each). Then warp
// (x, y) takes query tile blockIdx.x · blockDim.x / 32 + x, one per warp, and only the 16-key
// tiles [y · kt / P, (y + 1) · kt / P); parts y > 0 leave their online-softmax state
// (running maxima, partial sums, unnormalised O, lane by lane in the MMA layout) in shared
// memory after K / V, and part 0 merges them (rescaled to the common maximum) before it
// normalises and writes the rows. Each chain is about 1/P as long; the sums are the same
// quantities added in a different order.
#define RESIDENT_MAX_LEN 256
#define RESIDENT_MAX_WARPS 8

// KEYS: keys per online-softmax step; LAZY: lazy rescaling (attend_chunk); PAIR (lever 135): without
// key parts, a warp walks its query tiles two at a time (tile, tile + warps · splits), each K / V
// fragment feeding both tiles' MMAs (attend_chunk_rows with R = 2): half the ldmatrix loads and
// two independent chains per warp, at the price of a second tile's registers.
// QS (lever 136, with PAIR and without key parts): Q's rows staged in shared memory after V (the
// launch adds their bytes), its fragments read per chunk (attend_chunk_rows) instead of held in
// registers.
template <typename T, int D, int KEYS, bool LAZY, bool PAIR = false, bool QS = false>
__device__ __forceinline__ void attn_resident_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                                                     T *__restrict__ o, const uint32_t *__restrict__ cu_seqlens,
                                                     long long q_tok, long long q_head, long long k_tok, long long k_head,
                                                     long long v_tok, long long v_head, int heads, float scale_log2,
                                                int uniform_len) {
    using C = TileCfg<D>;
    static_assert(!QS || PAIR, "Q staged in shared memory only in the paired form");
    extern __shared__ __align__(128) unsigned char resident_smem[];

    const int b = blockIdx.z;
    const int h = blockIdx.y;
    int start, len;
    sequence_span(cu_seqlens, uniform_len, b, start, len);
    const int q_tiles = (len + 15) / 16;
    const int warps = blockDim.x / 32;
    const int parts = blockDim.y;
    const int first_tile = blockIdx.x * warps;
    if (first_tile >= q_tiles) return;  // uniform over the block

    // K rows then V rows, each padded to a multiple of 16 keys with zeros (see attend_chunk).
    const int rows = (len + 15) & ~15;
    T *ks = reinterpret_cast<T *>(resident_smem);
    T *vs = ks + rows * C::ROW;
    const T *qh = q + start * q_tok + h * q_head;
    const T *kh = k + start * k_tok + h * k_head;
    const T *vh = v + start * v_tok + h * v_head;
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int threads = blockDim.x * blockDim.y;
    for (int i = tid; i < rows * C::CHUNKS; i += threads) {
        const int row = i / C::CHUNKS;
        const int chunk = i % C::CHUNKS;
        const bool ok = row < len;
        const int src = ok ? row : 0;
        cp_async_16(ks + row * C::ROW + chunk * 8, kh + src * k_tok + chunk * 8, ok ? 16 : 0);
        cp_async_16(vs + row * C::ROW + chunk * 8, vh + src * v_tok + chunk * 8, ok ? 16 : 0);
        if constexpr (QS) cp_async_16(vs + (rows + row) * C::ROW + chunk * 8, qh + src * q_tok + chunk * 8, ok ? 16 : 0);
    }
    cp_async_commit();

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const long long o_tok = static_cast<long long>(heads) * D;
    T *oh = o + static_cast<long long>(start) * o_tok + h * D;

    int tile = first_tile + warp;
    RowState<D> pair[PAIR ? 2 : 1];
    RowState<D> &st = pair[0];
    if constexpr (QS) {
        reset_rows<D>(pair[0]);
        reset_rows<D>(pair[1]);
    } else {
        if (tile < q_tiles) begin_rows<T, D>(st, qh, q_tok, tile * 16, len, lane);  // overlaps the K / V copy
        if constexpr (PAIR) {
            const int second = tile + gridDim.x * warps;
            if (parts == 1 && second < q_tiles) begin_rows<T, D>(pair[1], qh, q_tok, second * 16, len, lane);
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    if (parts == 1) {
        const int stride = gridDim.x * warps;
        if constexpr (PAIR) {
            const T *qs = vs + rows * C::ROW;  // QS: Q's rows, staged after V
            for (; tile < q_tiles; tile += 2 * stride) {
                const int second = tile + stride;
                if (tile != first_tile + warp) {
                    if constexpr (QS) {
                        reset_rows<D>(pair[0]);
                        reset_rows<D>(pair[1]);
                    } else {
                        begin_rows<T, D>(pair[0], qh, q_tok, tile * 16, len, lane);
                        if (second < q_tiles) begin_rows<T, D>(pair[1], qh, q_tok, second * 16, len, lane);
                    }
                }
                if (second < q_tiles) {
                    attend_keys_rows<T, D, KEYS, LAZY, 2, QS>(pair, ks, vs, 0, len, scale_log2, lane,
                                                             qs + tile * 16 * C::ROW, stride * 16 * C::ROW);
                    end_rows<T, D>(pair[1], oh, o_tok, second * 16, len, lane);
                } else {
                    attend_keys_rows<T, D, KEYS, LAZY, 1, QS>(pair, ks, vs, 0, len, scale_log2, lane,
                                                             qs + tile * 16 * C::ROW, 0);
                }
                end_rows<T, D>(pair[0], oh, o_tok, tile * 16, len, lane);
            }
        } else {
            for (; tile < q_tiles; tile += stride) {
                if (tile != first_tile + warp) begin_rows<T, D>(st, qh, q_tok, tile * 16, len, lane);
                attend_keys<T, D, KEYS, LAZY>(st, ks, vs, 0, len, scale_log2, lane);
                end_rows<T, D>(st, oh, o_tok, tile * 16, len, lane);
            }
        }
        return;
    }

    // Key parts: one tile per warp (the host guarantees gridDim.x · warps >= q_tiles). Part y
    // takes the 16-key tiles [y · kt / P, (y + 1) · kt / P) in steps of up to KEYS keys; a step
    // that ends inside the sequence ends on a multiple of 16, so attend_chunk's masking of the
    // keys past `valid` keeps the next part's keys out.
    const int part = threadIdx.y;
    const bool active = tile < q_tiles;
    const int key_tiles = (len + 15) / 16;
    if (active) {
        const int key_end = min(len, (part + 1) * key_tiles / parts * 16);
        attend_keys<T, D, KEYS, LAZY>(st, ks, vs, part * key_tiles / parts * 16, key_end, scale_log2, lane);
    }
    // Partial states after K / V: [warp][part - 1][STATE][32 lanes] floats (lane-minor: no bank
    // conflicts), STATE = D / 2 accumulators + m0, m1, l0, l1.
    constexpr int STATE = D / 2 + 4;
    float *partial = reinterpret_cast<float *>(vs + rows * C::ROW);
    if (active && part > 0) save_state<D>(st, partial + ((warp * (parts - 1) + part - 1) * STATE) * 32 + lane);
    __syncthreads();
    if (!active || part > 0) return;
    // A part that saw no chunk holds m = -inf and zero sums: its weight exp2(-inf - m) is 0, and
    // at least one part saw a chunk, so the common maxima are finite.
    float m0 = st.m0, m1 = st.m1;
    for (int p = 1; p < parts; ++p) {
        const float *theirs = partial + ((warp * (parts - 1) + p - 1) * STATE) * 32 + lane;
        m0 = fmaxf(m0, theirs[(D / 2 + 0) * 32]);
        m1 = fmaxf(m1, theirs[(D / 2 + 1) * 32]);
    }
    float w0 = exp2f(st.m0 - m0), w1 = exp2f(st.m1 - m1);
    st.l0 *= w0;
    st.l1 *= w1;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
        st.acc_o[i][0] *= w0;
        st.acc_o[i][1] *= w0;
        st.acc_o[i][2] *= w1;
        st.acc_o[i][3] *= w1;
    }
    for (int p = 1; p < parts; ++p) {
        const float *theirs = partial + ((warp * (parts - 1) + p - 1) * STATE) * 32 + lane;
        w0 = exp2f(theirs[(D / 2 + 0) * 32] - m0);
        w1 = exp2f(theirs[(D / 2 + 1) * 32] - m1);
        st.l0 += theirs[(D / 2 + 2) * 32] * w0;
        st.l1 += theirs[(D / 2 + 3) * 32] * w1;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            st.acc_o[i][0] += theirs[(i * 4 + 0) * 32] * w0;
            st.acc_o[i][1] += theirs[(i * 4 + 1) * 32] * w0;
            st.acc_o[i][2] += theirs[(i * 4 + 2) * 32] * w1;
            st.acc_o[i][3] += theirs[(i * 4 + 3) * 32] * w1;
        }
    }
    end_rows<T, D>(st, oh, o_tok, tile * 16, len, lane);
}

// f32: one thread per query, keys in tiles of 32 through shared memory, exact f32 arithmetic.
template <int D>
__device__ __forceinline__ void attn_f32_kernel(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                                                float *__restrict__ o, const uint32_t *__restrict__ cu_seqlens,
                                                long long q_tok, long long q_head, long long k_tok, long long k_head,
                                                long long v_tok, long long v_head, int heads, float scale_log2,
                                                int uniform_len) {
    constexpr int KEYS = 32;
    __shared__ float ks[KEYS][D + 1];
    __shared__ float vs[KEYS][D + 1];

    const int b = blockIdx.z;
    const int h = blockIdx.y;
    int start, len;
    sequence_span(cu_seqlens, uniform_len, b, start, len);
    const int q_block = blockIdx.x * QUERIES_PER_BLOCK;
    if (q_block >= len) return;

    const int row = q_block + threadIdx.x;
    const bool active = row < len;
    const float *kh = k + start * k_tok + h * k_head;
    const float *vh = v + start * v_tok + h * v_head;

    float qr[D];
    float acc[D];
#pragma unroll
    for (int d = 0; d < D; ++d) {
        qr[d] = active ? q[(start + row) * q_tok + h * q_head + d] * scale_log2 : 0.f;
        acc[d] = 0.f;
    }
    float m = -INFINITY, l = 0.f;

    for (int key0 = 0; key0 < len; key0 += KEYS) {
        __syncthreads();
        for (int i = threadIdx.x; i < KEYS * D; i += QUERIES_PER_BLOCK) {
            const int r = i / D, d = i % D;
            const bool ok = key0 + r < len;
            ks[r][d] = ok ? kh[(key0 + r) * k_tok + d] : 0.f;
            vs[r][d] = ok ? vh[(key0 + r) * v_tok + d] : 0.f;
        }
        __syncthreads();
        const int n = min(KEYS, len - key0);
        // One key at a time: the online-softmax update costs 2*D extra FMAs per key, which keeps
        // the register arrays indexed by constants only (no local-memory score array).
#pragma unroll 1
        for (int j = 0; j < n; ++j) {
            float sc = 0.f;
#pragma unroll
            for (int d = 0; d < D; ++d) sc = fmaf(qr[d], ks[j][d], sc);
            const float new_m = fmaxf(m, sc);
            const float alpha = exp2f(m - new_m);
            const float p = exp2f(sc - new_m);
            m = new_m;
            l = l * alpha + p;
#pragma unroll
            for (int d = 0; d < D; ++d) acc[d] = fmaf(p, vs[j][d], acc[d] * alpha);
        }
    }
    if (active) {
        float *orow = o + (static_cast<long long>(start + row) * heads + h) * D;
        const float inv = 1.f / l;
#pragma unroll
        for (int d = 0; d < D; ++d) orow[d] = acc[d] * inv;
    }
}

// Row copies for pack / unpack. Rows are moved in VEC-sized units (uint4, uint2, uint32 or
// uint16), chosen on the host from the row size and the strides so that every access is aligned.
__device__ __forceinline__ int sequence_of(const uint32_t *cu_seqlens, int batch, uint32_t row) {
    int lo = 0, hi = batch;  // find b with cu[b] <= row < cu[b+1]
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (cu_seqlens[mid] <= row) lo = mid; else hi = mid;
    }
    return lo;
}

// out[t, :] = x[b(t), pos(t), :] for every packed row t; pos(t) = positions[t], or t - cu[b] when
// positions is null (leading tokens). Strides in VEC units; out is contiguous.
template <typename VEC>
__device__ __forceinline__ void pack_rows(const VEC *__restrict__ x, VEC *__restrict__ out, const uint32_t *__restrict__ cu_seqlens,
                                          const uint32_t *__restrict__ positions, int batch, long long x_b, long long x_n,
                                          int row_vecs) {
    const uint32_t t = blockIdx.x;
    VEC *dst = out + static_cast<long long>(t) * row_vecs;
    if (t >= cu_seqlens[batch]) {  // spare capacity of a device-lengths batch: zeros
        VEC zero;
        memset(&zero, 0, sizeof(VEC));
        for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) dst[i] = zero;
        return;
    }
    const int b = sequence_of(cu_seqlens, batch, t);
    const uint32_t pos = positions ? positions[t] : t - cu_seqlens[b];
    const VEC *src = x + b * x_b + pos * x_n;
    for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) dst[i] = src[i];
}

// out[b, pos(t), :] = packed[t, :]; the caller zero-fills out first when positions are given,
// otherwise this kernel runs over every output row and writes zeros past each sequence's end.
template <typename VEC>
__device__ __forceinline__ void unpack_rows(const VEC *__restrict__ packed, VEC *__restrict__ out,
                                            const uint32_t *__restrict__ cu_seqlens, const uint32_t *__restrict__ positions,
                                            int batch, int n, long long p_t, int row_vecs) {
    if (positions) {
        const uint32_t t = blockIdx.x;
        const int b = sequence_of(cu_seqlens, batch, t);
        VEC *dst = out + (static_cast<long long>(b) * n + positions[t]) * row_vecs;
        const VEC *src = packed + t * p_t;
        for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) dst[i] = src[i];
    } else {
        const int b = blockIdx.x / n;
        const int i_tok = blockIdx.x % n;
        const int start = cu_seqlens[b];
        const int len = static_cast<int>(cu_seqlens[b + 1]) - start;
        VEC *dst = out + static_cast<long long>(blockIdx.x) * row_vecs;
        if (i_tok < len) {
            const VEC *src = packed + (start + i_tok) * p_t;
            for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) dst[i] = src[i];
        } else {
            VEC zero;
            memset(&zero, 0, sizeof(VEC));
            for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) dst[i] = zero;
        }
    }
}

}  // namespace

#define ATTN_ARGS(T)                                                                                            \
    const T *q, const T *k, const T *v, T *o, const uint32_t *cu_seqlens, long long q_tok, long long q_head,   \
        long long k_tok, long long k_head, long long v_tok, long long v_head, int heads, float scale_log2, \
        int uniform_len
#define ATTN_PASS q, k, v, o, cu_seqlens, q_tok, q_head, k_tok, k_head, v_tok, v_head, heads, scale_log2, uniform_len

#define MMA_ENTRY(NAME, T, D)                                                                     \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(ATTN_ARGS(T)) {                \
        attn_mma_kernel<T, D>(ATTN_PASS);                                                         \
    }
// The resident kernel (v4) is latency-bound: ncu shows long-scoreboard stalls and ~20 % active
// warps at two 128-register blocks per SM. Lever 24 (docs/BENCHMARKS.md): 32-key online-softmax
// steps halve the S and P registers, so the kernel fits an 85-register cap for three blocks per
// SM (ptxas: 80 registers, 40 bytes spilled); on the H100 that is 27 % active warps and 6-17 %
// less kernel time at batch 256. `k64` keeps v4's 64-key, two-block kernel as the A/B arm
// (CANDLE_RAGGED_RESIDENT=k64). 64-key steps capped for three blocks spill 684 bytes, and 32-key
// steps left at two blocks gained only ~3 %: neither is kept.
//
// Lever 35: the branch-free full chunks need a few more live registers (ldmatrix results of four
// n-tiles in flight). Capped at 96 (`resident_`), ptxas spills 4 bytes instead of 44, but
// registers are allocated per SM sub-partition (16,384 each, whole warps), so 96 registers hold
// 5 warps per sub-partition, 20 per SM, and 7-warp blocks (DeiT's 197 tokens) fit two per SM
// instead of three. `resident_r80_` keeps lever 24's bound (256 threads x 3 blocks: 80
// registers, 6 warps per sub-partition) for the launches that lose a block to the cap (see
// resident_plan.rs); CANDLE_RAGGED_RESIDENT=r96 / r80 forces one of the two.
#define RESIDENT_REGS 96
#define RESIDENT_ENTRY(NAME, T, D, KEYS)                                                          \
    extern "C" __global__ void __maxnreg__(RESIDENT_REGS) NAME(ATTN_ARGS(T)) {                    \
        attn_resident_kernel<T, D, KEYS, false>(ATTN_PASS);                                       \
    }
// Lever 38: LAZY (the last argument) makes the 80-register form rescale lazily (attend_chunk).
#define RESIDENT_ENTRY_BOUNDED(NAME, T, D, KEYS, BLOCKS, LAZY)                                    \
    extern "C" __global__ void __launch_bounds__(RESIDENT_MAX_WARPS * 32, BLOCKS) NAME(ATTN_ARGS(T)) { \
        attn_resident_kernel<T, D, KEYS, LAZY>(ATTN_PASS);                                        \
    }
// Lever 135: the paired form (PAIR above) for blocks of up to 4 warps (resident_plan.rs): 32-key
// steps, lazy rescaling (lever 38), capped at 168 registers (ptxas: no spills), so three warps per
// SM sub-partition where the 96-register kernel has five: the same independent chains per SM,
// 16 % fewer instructions (ncu). 16-key steps under 128 registers (four warps per sub-partition,
// ~0.1 KB spilled) measured 0.77-1.06x the default kernel: not built.
#define RESIDENT_ENTRY_PAIR(NAME, T, D)                                                           \
    extern "C" __global__ void __maxnreg__(168) NAME(ATTN_ARGS(T)) {                              \
        attn_resident_kernel<T, D, 32, true, true>(ATTN_PASS);                                    \
    }
MMA_ENTRY(ragged_attn_f16_d32, __half, 32)
MMA_ENTRY(ragged_attn_f16_d64, __half, 64)
MMA_ENTRY(ragged_attn_f16_d128, __half, 128)
MMA_ENTRY(ragged_attn_bf16_d32, __nv_bfloat16, 32)
MMA_ENTRY(ragged_attn_bf16_d64, __nv_bfloat16, 64)
MMA_ENTRY(ragged_attn_bf16_d128, __nv_bfloat16, 128)
RESIDENT_ENTRY(ragged_attn_resident_f16_d32, __half, 32, 32)
RESIDENT_ENTRY(ragged_attn_resident_f16_d64, __half, 64, 32)
RESIDENT_ENTRY(ragged_attn_resident_bf16_d32, __nv_bfloat16, 32, 32)
RESIDENT_ENTRY(ragged_attn_resident_bf16_d64, __nv_bfloat16, 64, 32)
RESIDENT_ENTRY_BOUNDED(ragged_attn_resident_r80_f16_d32, __half, 32, 32, 3, true)
RESIDENT_ENTRY_BOUNDED(ragged_attn_resident_r80_f16_d64, __half, 64, 32, 3, true)
RESIDENT_ENTRY_BOUNDED(ragged_attn_resident_r80_bf16_d32, __nv_bfloat16, 32, 32, 3, true)
RESIDENT_ENTRY_BOUNDED(ragged_attn_resident_r80_bf16_d64, __nv_bfloat16, 64, 32, 3, true)
RESIDENT_ENTRY_BOUNDED(ragged_attn_resident_k64_f16_d32, __half, 32, 64, 2, false)
RESIDENT_ENTRY_BOUNDED(ragged_attn_resident_k64_f16_d64, __half, 64, 64, 2, false)
RESIDENT_ENTRY_BOUNDED(ragged_attn_resident_k64_bf16_d32, __nv_bfloat16, 32, 64, 2, false)
RESIDENT_ENTRY_BOUNDED(ragged_attn_resident_k64_bf16_d64, __nv_bfloat16, 64, 64, 2, false)
RESIDENT_ENTRY_PAIR(ragged_attn_resident_pair_f16_d32, __half, 32)
RESIDENT_ENTRY_PAIR(ragged_attn_resident_pair_f16_d64, __half, 64)
RESIDENT_ENTRY_PAIR(ragged_attn_resident_pair_bf16_d32, __nv_bfloat16, 32)
RESIDENT_ENTRY_PAIR(ragged_attn_resident_pair_bf16_d64, __nv_bfloat16, 64)
// Lever 136: the paired form with Q staged in shared memory (QS), KEYS-key steps, REGS registers.
// pairq16 under 128 registers has no spills (16 warps a SM); on the H100 it ran 1.04-1.09x the
// other kernels at batch 256 and keep >= 0.7 with every unsplit block paired, but 0.86-1.05x at
// batch 64: resident_plan.rs picks it from 8 (sequence, head) pairs a SM or 5 warps a block
// (levers 137-138). pairq32 (32-key steps, 208 bytes spilled) is an A/B arm
// (CANDLE_RAGGED_PAIRQ=32, see cuda.rs).
#define RESIDENT_ENTRY_PAIRQ(NAME, T, D, KEYS, REGS)                                              \
    extern "C" __global__ void __maxnreg__(REGS) NAME(ATTN_ARGS(T)) {                             \
        attn_resident_kernel<T, D, KEYS, true, true, true>(ATTN_PASS);                            \
    }
#ifndef PAIRQ_REGS
#define PAIRQ_REGS 128
#endif
RESIDENT_ENTRY_PAIRQ(ragged_attn_resident_pairq16_f16_d32, __half, 32, 16, PAIRQ_REGS)
RESIDENT_ENTRY_PAIRQ(ragged_attn_resident_pairq16_f16_d64, __half, 64, 16, PAIRQ_REGS)
RESIDENT_ENTRY_PAIRQ(ragged_attn_resident_pairq16_bf16_d32, __nv_bfloat16, 32, 16, PAIRQ_REGS)
RESIDENT_ENTRY_PAIRQ(ragged_attn_resident_pairq16_bf16_d64, __nv_bfloat16, 64, 16, PAIRQ_REGS)
RESIDENT_ENTRY_PAIRQ(ragged_attn_resident_pairq32_f16_d32, __half, 32, 32, PAIRQ_REGS)
RESIDENT_ENTRY_PAIRQ(ragged_attn_resident_pairq32_f16_d64, __half, 64, 32, PAIRQ_REGS)
RESIDENT_ENTRY_PAIRQ(ragged_attn_resident_pairq32_bf16_d32, __nv_bfloat16, 32, 32, PAIRQ_REGS)
RESIDENT_ENTRY_PAIRQ(ragged_attn_resident_pairq32_bf16_d64, __nv_bfloat16, 64, 32, PAIRQ_REGS)

#define F32_ENTRY(NAME, D)                                                                        \
    extern "C" __global__ void __launch_bounds__(QUERIES_PER_BLOCK) NAME(ATTN_ARGS(float)) {     \
        attn_f32_kernel<D>(ATTN_PASS);                                                            \
    }
F32_ENTRY(ragged_attn_f32_d32, 32)
F32_ENTRY(ragged_attn_f32_d64, 64)
F32_ENTRY(ragged_attn_f32_d128, 128)

#define COPY_ENTRIES(SUFFIX, VEC)                                                                                  \
    extern "C" __global__ void ragged_pack_##SUFFIX(const VEC *x, VEC *out, const uint32_t *cu_seqlens,           \
                                                    const uint32_t *positions, int batch, long long x_b,            \
                                                    long long x_n, int row_vecs) {                                  \
        pack_rows<VEC>(x, out, cu_seqlens, positions, batch, x_b, x_n, row_vecs);                                  \
    }                                                                                                              \
    extern "C" __global__ void ragged_unpack_##SUFFIX(const VEC *packed, VEC *out, const uint32_t *cu_seqlens,    \
                                                      const uint32_t *positions, int batch, int n, long long p_t,   \
                                                      int row_vecs) {                                               \
        unpack_rows<VEC>(packed, out, cu_seqlens, positions, batch, n, p_t, row_vecs);                             \
    }
COPY_ENTRIES(v16, uint4)
COPY_ENTRIES(v8, uint2)
COPY_ENTRIES(v4, uint32_t)
COPY_ENTRIES(v2, uint16_t)

// ---------------------------------------------------------------------------------------------
// Top-k token selection over B packed sequences of equal length (token pruning on the device).
//
// Blocks (b, y): sequence b, whose `len` rows start at row b·len of x [B·len, C], keeps
// rows 0..prefix and the `keep` rows of prefix..len with the highest scores, in ascending
// position, writing them to rows b·out_len.. of out. Order of the scores: f32's total order
// (Rust's total_cmp) with NaN as -inf, ties to the lower position: exactly the host pruners'
// rule, so device and host decisions agree bit for bit. With fuse = 1 (weighted mean) or 2
// (weighted sum) one more row follows: the dropped rows weighted by max(score, 0) (NaN: 0), the
// mean falling back to the plain mean when every weight is 0 (EViT's extra token).
// The scores are given, or computed in the block itself (`mode`, see sequence_scores): a row's
// L2 norm (Threshold-L2) or the class token's attention (EViT), so that a pruning step is one
// kernel instead of a handful of small ones, which is what a step costs at small batches.
// Ranks are counted (O(len²) comparisons per block, ~40k for 197 tokens: far below the copy).
// ---------------------------------------------------------------------------------------------

#define SELECT_MAX_LEN 2048

namespace select_detail {

using select_common::total_key;
using select_common::weight;

// Dot product of an f32 vector (shared memory) with n elements of T (global), in ascending
// order whichever path loads them; 16-byte loads when the row allows it.
template <typename T>
__device__ __forceinline__ float dot_row(const float *a, const T *row, int n, bool vec) {
    float acc = 0.f;
    if (vec) {
        constexpr int V = 16 / sizeof(T);
        // Unrolled so that a head's loads are in flight together (the sum's order is unchanged).
#pragma unroll 8
        for (int d0 = 0; d0 < n; d0 += V) {
            const uint4 u = *reinterpret_cast<const uint4 *>(row + d0);
            const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
            for (int i = 0; i < V; ++i) acc = select_common::sel_fma(a[d0 + i], to_f32(e[i]), acc);
        }
    } else {
        acc = select_common::cls_dot(a, n, [&](int d) { return to_f32(row[d]); });
    }
    return acc;
}

// Σ row[c]² over the C elements of SQ_ROWS rows at once (rows j0, j0 + step, ... below len, at
// row_stride elements apart from base), in f32, by one warp: every lane gets every sum. The rows'
// loads are issued together: at batch 1 one block scores a whole image, and a row at a time left
// each warp waiting on one load after another (a 197-token step took ~25 µs). Per row the
// arithmetic is row_norm.cuh's (each lane's columns ascending, then a butterfly over lanes).
// 16-byte loads when `vec` (C a multiple of the vector and the rows aligned).
#define SQ_ROWS 8
template <typename T>
__device__ __forceinline__ void warp_sums_of_squares(float (&acc)[SQ_ROWS], const T *base, size_t row_stride, int j0,
                                                     int step, int len, int C, bool vec) {
    constexpr int V = 16 / sizeof(T);
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int u = 0; u < SQ_ROWS; ++u) acc[u] = 0.f;
    if (vec) {
        for (int c0 = lane * V; c0 < C; c0 += 32 * V) {
            uint4 raw[SQ_ROWS];
#pragma unroll
            for (int u = 0; u < SQ_ROWS; ++u) {
                const int j = j0 + u * step;
                raw[u] = j < len ? *reinterpret_cast<const uint4 *>(base + (size_t)j * row_stride + c0)
                                 : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < SQ_ROWS; ++u) {
                const T *e = reinterpret_cast<const T *>(&raw[u]);
#pragma unroll
                for (int i = 0; i < V; ++i) acc[u] = row_norm_sq_add(to_f32(e[i]), acc[u]);
            }
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            float v[SQ_ROWS];
#pragma unroll
            for (int u = 0; u < SQ_ROWS; ++u) {
                const int j = j0 + u * step;
                v[u] = j < len ? to_f32(base[(size_t)j * row_stride + c]) : 0.f;
            }
#pragma unroll
            for (int u = 0; u < SQ_ROWS; ++u) acc[u] = row_norm_sq_add(v[u], acc[u]);
        }
    }
#pragma unroll
    for (int u = 0; u < SQ_ROWS; ++u) acc[u] = row_norm_lane_sum(acc[u]);
}

// f(j, Σ row_j²) for every row j < len (rows row_stride elements apart from base), on lane 0 of
// the warp that summed it: warps take SQ_ROWS rows at a time (see warp_sums_of_squares).
template <typename T, typename F>
__device__ __forceinline__ void for_each_row_sum_of_squares(const T *base, size_t row_stride, int len, int C,
                                                            bool vec, F f) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (int j0 = warp; j0 < len; j0 += SQ_ROWS * warps) {
        float acc[SQ_ROWS];
        warp_sums_of_squares<T>(acc, base, row_stride, j0, warps, len, C, vec);
#pragma unroll
        for (int u = 0; u < SQ_ROWS; ++u)
            if (lane == 0 && j0 + u * warps < len) f(j0 + u * warps, acc[u]);
    }
}

// The max and the exp-sum of l[0..len) by one warp, every lane getting both: lane-strided, then a
// butterfly. The one order every class-attention score uses (sequence_scores, cls_probs), so they
// give the same bits wherever they run.
// (select_common.cuh's cls_softmax_stats: candle-fastpath's attention_residual computes the same.)
__device__ __forceinline__ void warp_softmax_stats(const float *l, int len, float &m, float &sum) {
    select_common::cls_softmax_stats(l, len, m, sum);
}

// The scores of sequence b = blockIdx.x, packed rows start..start + len, into sc (shared), by `mode`:
//   0: given, scores[b·score_stride + j];
//   1: the L2 norm of row j of x (f32 sum of squares);
//   2: the class token's attention averaged over heads, from the fused projection qkv
//      [rows, 3·C] (q, k, v blocks of C = heads · head_dim columns): per head, softmax over j of
//      T(T(q_cls · scale) · k_j) (rounded to T like a T matmul's output), then the mean;
//   3: ATS's significance: the same attention summed over heads (in head order), times the L2
//      norm of row j's value vector (all heads).
// tmp: tmp_floats floats of scratch. Every (head, key) logit of a group of heads is computed at
// once (DeiT: all 12 heads × 197 keys), so a step costs a few barriers, not a few per head: at
// batch 1 this kernel's latency is the step's latency.
template <typename T>
__device__ void sequence_scores(float *sc, float *tmp, int tmp_floats, float *red, const T *__restrict__ x,
                                const float *__restrict__ scores, int score_stride, const T *__restrict__ qkv,
                                int start, int len, int C, int mode, int heads, float scale) {
    const int b = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    constexpr int V = 16 / sizeof(T);
    if (mode == 0) {
        for (int j = threadIdx.x; j < len; j += blockDim.x) sc[j] = scores[(size_t)b * score_stride + j];
    } else if (mode == 4 || mode == 5) {
        // Modes 2 / 3 with each head's probabilities (and, for 3, the value rows' sums of squares)
        // already computed by cls_probs over (sequence, head) blocks: rows h of
        // scores[b·(heads + 1)·score_stride ..], row `heads` the sums of squares. The same
        // operations in the same order as below, so the same bits.
        const float *p = scores + (size_t)b * (heads + 1) * score_stride;
        for (int j = threadIdx.x; j < len; j += blockDim.x)
            sc[j] = select_common::step_score(p, score_stride, j, mode, heads);
    } else if (mode == 1) {
        const T *xb = x + (size_t)start * C;
        const bool vec = C % V == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
        for_each_row_sum_of_squares<T>(xb, C, len, C, vec, [&](int j, float ss) { sc[j] = row_norm_sqrt(ss); });
    } else {
        const int D = C / heads;
        const size_t stride = 3 * (size_t)C;
        const T *qb = qkv + (size_t)start * stride;
        const bool vec = D % V == 0 && C % V == 0 && reinterpret_cast<uintptr_t>(qkv) % 16 == 0;
        // Heads in groups whose queries and logits fit in tmp together (all 12 of DeiT at 197
        // tokens: one group), at most 16 so that red holds each head's max and exp-sum.
        const int group = min(16, max(1, tmp_floats / (len + D)));
        float *logit = tmp;                    // [group][len]
        float *qs = tmp + group * len;         // [group][D]: q_cls · scale rounded to T
        for (int j = threadIdx.x; j < len; j += blockDim.x) sc[j] = 0.f;
        for (int h0 = 0; h0 < heads; h0 += group) {
            const int hn = min(group, heads - h0);
            for (int i = threadIdx.x; i < hn * D; i += blockDim.x)
                qs[i] = to_f32(from_f32<T>(select_common::cls_query(to_f32(qb[h0 * D + i]), scale)));
            __syncthreads();
            for (int p = threadIdx.x; p < hn * len; p += blockDim.x) {
                const int h = p / len, j = p % len;
                logit[p] = to_f32(from_f32<T>(dot_row<T>(qs + h * D, qb + (size_t)j * stride + C + (h0 + h) * D, D, vec)));
            }
            __syncthreads();
            // Each head's max and exp-sum by one warp: red[2h], red[2h + 1].
            for (int h = warp; h < hn; h += warps) {
                float m, sum;
                warp_softmax_stats(logit + h * len, len, m, sum);
                if (lane == 0) {
                    red[2 * h] = m;
                    red[2 * h + 1] = sum;
                }
            }
            __syncthreads();
            // Heads added in order, as the host's mean over heads adds them. Each probability is
            // rounded before it is added (sel_add, an add instruction of its own: under
            // --use_fast_math the division is a multiply by the reciprocal, which the compiler
            // would otherwise fuse into the add),
            // as cls_probs stores it and modes 4 / 5 add it: the same bits whether a batch's
            // scores are split over (sequence, head) blocks or not.
            for (int j = threadIdx.x; j < len; j += blockDim.x) {
                float acc = sc[j];
                for (int h = 0; h < hn; ++h)
                    acc = select_common::sel_add(acc, select_common::cls_prob(logit[h * len + j], red[2 * h], red[2 * h + 1]));
                sc[j] = acc;
            }
            __syncthreads();  // qs, logits and red are rewritten by the next group
        }
        if (mode == 2) {
            const float inv_heads = select_common::sel_rcp((float)heads);
            for (int j = threadIdx.x; j < len; j += blockDim.x) sc[j] = select_common::sel_mul(sc[j], inv_heads);
        } else {
            // Times ‖v_j‖, a warp per row (the head loop ended on a barrier).
            const bool vvec = C % V == 0 && reinterpret_cast<uintptr_t>(qkv) % 16 == 0;
            for_each_row_sum_of_squares<T>(qb + 2 * C, stride, len, C, vvec,
                                           [&](int j, float ss) { sc[j] = select_common::sel_mul(sc[j], select_common::sel_sqrt(ss)); });
        }
    }
    __syncthreads();
}

// The class token's attention probabilities of one (sequence b = blockIdx.x, head h = blockIdx.y)
// into out[(b·(heads + 1) + h)·out_stride + j], by the operations sequence_scores uses for modes 2
// and 3 (logits rounded to T, one warp's max and exp-sum in its order, exp(l - m) / sum); block
// h = heads (with `vnorm`) writes the value rows' sums of squares instead. At small batches one
// block per sequence left those loads to a single SM; here they spread over B · (heads + 1).
// `cu` null: sequences of out_stride tokens each (select_top_k's equal lengths, lever 39).
// Dynamic shared memory: (round_up(D, 4) + len) floats.
template <typename T>
__device__ void cls_probs(const T *__restrict__ qkv, const uint32_t *__restrict__ cu, float *__restrict__ out,
                          int out_stride, int heads, int C, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int b = blockIdx.x, h = blockIdx.y;
    constexpr int V = 16 / sizeof(T);
    const int start = cu ? (int)cu[b] : b * out_stride;
    const int len = cu ? (int)cu[b + 1] - start : out_stride;
    const int D = C / heads;
    const size_t stride = 3 * (size_t)C;
    const T *qb = qkv + (size_t)start * stride;
    float *o = out + ((size_t)b * (heads + 1) + h) * out_stride;
    if (h == heads) {
        const bool vvec = C % V == 0 && reinterpret_cast<uintptr_t>(qkv) % 16 == 0;
        for_each_row_sum_of_squares<T>(qb + 2 * C, stride, len, C, vvec, [&](int j, float ss) { o[j] = ss; });
        return;
    }
    // qs padded to a multiple of 4 floats: dot_row's loop may read a[] in 16-byte chunks past D
    // (the compiler's vector load for the remainder), which must not land on logit being written.
    float *qs = reinterpret_cast<float *>(smem);  // [round_up(D, 4)]
    float *logit = qs + ((D + 3) & ~3);           // [len]
    const bool vec = D % V == 0 && C % V == 0 && reinterpret_cast<uintptr_t>(qkv) % 16 == 0;
    for (int i = threadIdx.x; i < D; i += blockDim.x)
        qs[i] = to_f32(from_f32<T>(select_common::cls_query(to_f32(qb[h * D + i]), scale)));
    __syncthreads();
    for (int j = threadIdx.x; j < len; j += blockDim.x)
        logit[j] = to_f32(from_f32<T>(dot_row<T>(qs, qb + (size_t)j * stride + C + h * D, D, vec)));
    __syncthreads();
    // Every warp finds the max and the exp-sum itself (the same bits in every warp) and writes its
    // own share of the row: no shared result to hand between warps.
    float m, sum;
    warp_softmax_stats(logit, len, m, sum);
    for (int j = threadIdx.x; j < len; j += blockDim.x) o[j] = select_common::cls_prob(logit[j], m, sum);
}

template <typename T>
__device__ void select_top_k(const T *__restrict__ x, const float *__restrict__ scores, const T *__restrict__ qkv,
                             T *__restrict__ out, int len, int C, int prefix, int keep, int fuse, int mode, int heads,
                             float scale, const T *__restrict__ also, T *__restrict__ also_out, int C2) {
    using namespace select_common;
    __shared__ int scratch[2 * SELECT_MAX_LEN];
    int *key = scratch;                      // each token's key; then src (place_tokens)
    int *kept = scratch + SELECT_MAX_LEN;    // 0 / 1 per token
    // (then both, the fused row's partial sums)
    __shared__ int dropped[SELECT_MAX_LEN];  // the dropped tokens' positions, ascending
    __shared__ float sc[SELECT_MAX_LEN];     // the sequence's scores
    __shared__ float red[32];
    const int b = blockIdx.x;
    // The scratch holds the logits of mode 2 until the ranking below.
    sequence_scores<T>(sc, reinterpret_cast<float *>(scratch), 2 * SELECT_MAX_LEN, red, x, scores, len, qkv,
                       b * len, len, C, mode, heads, scale);
    const float *s = sc;
    for (int j = threadIdx.x; j < len; j += blockDim.x) key[j] = total_key(s[j]);
    __syncthreads();
    rank_tokens(key, kept, len, prefix, keep);
    __syncthreads();
    // Kept tokens in ascending position: output row r is token src[r]. Written over `key`, no
    // longer needed.
    int *src = key;
    place_tokens(kept, len, src, dropped, reinterpret_cast<int *>(red));
    const int out_len = prefix + keep + (fuse ? 1 : 0);
    const T *xb = x + (size_t)b * len * C;
    T *ob = out + (size_t)b * out_len * C;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    // This block copies output rows blockIdx.y, blockIdx.y + gridDim.y, ... (every block of a
    // sequence ranks the whole sequence, which is cheap, so the copy spreads over many SMs even
    // at batch 1). 16-byte vectors when rows allow it.
    const bool vec = ((C * sizeof(T)) % 16 == 0) && ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(out)) % 16 == 0);
    const bool also_vec = ((C2 * sizeof(T)) % 16 == 0) &&
                          ((reinterpret_cast<uintptr_t>(also) | reinterpret_cast<uintptr_t>(also_out)) % 16 == 0);
    // One warp copies a row: 16-byte vectors when the row allows it.
    auto copy_row = [](const T *src_row, T *dst, int n_elems, bool vectors, int lane) {
        if (vectors) {
            const int n = n_elems * sizeof(T) / 16;
            for (int c = lane; c < n; c += 32)
                reinterpret_cast<uint4 *>(dst)[c] = reinterpret_cast<const uint4 *>(src_row)[c];
        } else {
            for (int c = lane; c < n_elems; c += 32) dst[c] = src_row[c];
        }
    };
    for (int r = blockIdx.y + gridDim.y * warp; r < prefix + keep; r += gridDim.y * warps) {
        const int j = src[r];
        copy_row(xb + (size_t)j * C, ob + (size_t)r * C, C, vec, lane);
        // `also` (never with fuse): the same rows of a second [B·len, C2] tensor, e.g. the next
        // block's qkv projection, gathered with the tokens.
        if (also != nullptr)
            copy_row(also + ((size_t)b * len + j) * C2, also_out + ((size_t)b * out_len + r) * C2, C2, also_vec, lane);
    }
    if (!fuse) return;
    // The fused row. Its columns are split over the sequence's blocks (a slice per blockIdx.y);
    // select_common's order, which no launch shape enters (lever 87: at batch 1 it used to sum
    // in as many groups as a block's threads spread over its slice, at 132 sequences and more in
    // two, so the fused row's bits depended on the batch size).
    const int cols = (C + (int)gridDim.y - 1) / (int)gridDim.y;
    const int c_begin = blockIdx.y * cols, c_end = min(C, c_begin + cols);
    if (c_begin >= c_end) return;  // the whole block leaves: no barrier below is split
    const int nd = len - prefix - keep;
    fused_weight_total(s, dropped, nd, &red[0]);
    __syncthreads();  // also: every warp's copies (which read src) are done
    const float total = red[0];
    // src and kept are free now: 2 · FUSE_COLS · blockDim.x <= 2 · SELECT_MAX_LEN floats.
    float *part = reinterpret_cast<float *>(scratch);
    T *fused = ob + (size_t)(prefix + keep) * C;
    fused_columns(
        s, dropped, nd, fuse, total, c_begin, c_end, part, [&](int j, int c) { return to_f32(xb[(size_t)j * C + c]); },
        [&](int c, float f) { fused[c] = from_f32<T>(f); });
}

}  // namespace select_detail

#define SELECT_ENTRY(SUFFIX, T)                                                                             \
    extern "C" __global__ void ragged_select_top_k_##SUFFIX(const T *x, const float *scores, const T *qkv, T *out, \
                                                            int len, int C, int prefix, int keep, int fuse,        \
                                                            int mode, int heads, float scale, const T *also,       \
                                                            T *also_out, int C2) {                                 \
        select_detail::select_top_k<T>(x, scores, qkv, out, len, C, prefix, keep, fuse, mode, heads, scale, also,  \
                                       also_out, C2);                                                              \
    }
SELECT_ENTRY(f32, float)
SELECT_ENTRY(f16, __half)
SELECT_ENTRY(bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// Rule-based token selection over a ragged batch: token pruning whose counts depend on the
// scores (adaptive thresholds, attention-mass shares, ATS's inverse-transform sampling).
//
// Two kernels with one host read between them. `ragged_select_decide_*` (one block per sequence)
// computes the sequence's scores (sequence_scores), applies the keep rule and writes a plan; the
// host reads the new lengths and uploads the new cu_seqlens; `ragged_select_gather_*` copies the
// kept rows and builds the fused rows. select_by_rule_bounded replaces the host read with
// `ragged_lengths_to_offsets` (cu_seqlens built on the device); at small batches
// `ragged_cls_probs_*` computes the class-attention scores first, over (sequence, head) blocks. The rules repeat KeepRule::keep (src/keep.rs) operation
// for operation: the same comparisons, f64 sums in the same order with no contraction into
// fused multiply-adds, the same roundings, so a device decision equals the host's given the
// same scores.
//
// plan (u32): [0, B) each sequence's new length; [B, 2B) 1 where a fused row ends it;
// [2B, 2B + total) each input row's slot inside its sequence's output, -1 when dropped;
// [2B + total, 2B + 2·total) the f32 bits of each dropped row's weight in the fused row.
// ---------------------------------------------------------------------------------------------

#define RULE_TOP 0
#define RULE_AT_LEAST 1
#define RULE_ABOVE 2
#define RULE_MEAN_TIMES 3
#define RULE_MASS_SHARE 4
#define RULE_INVERSE_TRANSFORM 5

// Threads of a ragged_select_gather block (the host launches exactly this many).
#define GATHER_THREADS 256

namespace rule_detail {
using namespace select_detail;

// KeepCount::of / samples: count_kind 0 is Exactly(count), 1 is CeilRatio(ratio).
__device__ __forceinline__ int ceil_count(double ratio, int n) {
    const double v = ceil(__dmul_rn(ratio, (double)n));
    if (!(v >= 1.0)) return 1;  // NaN too, as Rust's saturating cast then clamp
    return v >= (double)max(n, 1) ? max(n, 1) : (int)v;
}

// First position of ascending a[0, n) that is not below y (Rust's partition_point(|c| c < y)).
__device__ __forceinline__ int lower_bound(const double *a, int n, double y) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (a[mid] < y) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// nearest_first of src/keep.rs: the position of the value nearest to y, the lowest on ties.
__device__ __forceinline__ int nearest_first(const double *a, int n, double y) {
    const int above = lower_bound(a, n, y);
    if (above == 0) return 0;
    const double below_value = a[above - 1];
    const int below = lower_bound(a, n, below_value);
    if (above == n || fabs(__dsub_rn(y, below_value)) <= fabs(__dsub_rn(y, a[above]))) return below;
    return above;
}

// Block-wide minimum of a double (every thread gets it). dred: 32 doubles of shared memory.
__device__ __forceinline__ double block_min(double v, double *dred) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmin(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) dred[warp] = v;
    __syncthreads();
    // Every warp reduces the partials by shuffles (lever 118: a chain of 32 dependent shared
    // loads was ~1,000 cycles). A minimum does not depend on the order.
    double m = lane < warps ? dred[lane] : INFINITY;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmin(m, __shfl_xor_sync(0xffffffffu, m, o));
    __syncthreads();  // dred is reused
    return m;
}

// Ranks of the distinct 64-bit keys K[from..to): cnt[j] (zero on entry) += the number of i with
// K[i] ranking before K[j], i.e. K[i] > K[j] (DESC) or K[i] < K[j]. Callers pack a 32-bit sort
// key and the position into one key, so one unsigned compare is their whole ordering rule. A warp
// takes 32 consecutive j (one a lane, its key in a register) against a slice of the i: every
// lane reads the same K[i], a shared-memory broadcast. Lever 110: the per-element form before
// (a thread per (j, slice) and the rule as a lambda over two arrays: f64 weights and positions
// for ATS) was the decide kernel's longest phase, ~9,000 of ~36,000 cycles for 196 patches.
// Warps first_warp and up take part (ATS leaves warp 0 its f64 total meanwhile, lever 118); no
// barrier at the end: the caller's comes before anyone reads cnt.
template <bool DESC>
__device__ __forceinline__ void count_ranks(const unsigned long long *__restrict__ K, int from, int to, int *cnt,
                                            int first_warp) {
    const int n = to - from;
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) - first_warp,
              warps = (blockDim.x >> 5) - first_warp;
    if (warp < 0) return;
    const int groups = (n + 31) / 32;
    const int parts = max(1, min(warps / max(groups, 1), (n + 15) / 16));
    const int slice = (n + parts - 1) / parts;
    for (int w = warp; w < groups * parts; w += warps) {
        const int g = w / parts, p = w % parts;
        const int j = from + g * 32 + lane;
        const unsigned long long kj = j < to ? K[j] : 0ull;
        const int lo = from + p * slice, hi = min(to, lo + slice);
        int c = 0;
#pragma unroll 4
        for (int i = lo; i < hi; ++i) {
            const unsigned long long ki = K[i];
            c += DESC ? (ki > kj) : (ki < kj);
        }
        if (j < to && c) atomicAdd(&cnt[j], c);
    }
}

// Exclusive prefix sum of in[from..to) into out[from..to) (out may not alias in), chunks of
// blockDim.x scanned with warp shuffles and carried in order; returns the total to every thread.
// Ends on a barrier. select_by_rule_bounded's offsets use it (the decide kernel's slots did until
// lever 118, which scans them with one warp beside the fused-row total).
template <typename T>
__device__ __forceinline__ T block_exclusive_sum(const T *in, T *out, int from, int to) {
    __shared__ T warp_sums[32];
    __shared__ T carry;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int base = from; base < to; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const T f = i < to ? in[i] : 0;
        const T v = select_common::warp_inclusive_sum(f);
        if (lane == 31) warp_sums[w] = v;
        __syncthreads();
        if (w == 0) {
            const T s = select_common::warp_inclusive_sum(lane < warps ? warp_sums[lane] : T(0));
            if (lane < warps) warp_sums[lane] = s;  // inclusive sums of the warps
        }
        __syncthreads();
        if (i < to) out[i] = carry + (w > 0 ? warp_sums[w - 1] : 0) + v - f;
        __syncthreads();  // every thread has read carry and warp_sums
        if (threadIdx.x == 0) carry += warp_sums[warps - 1];
        __syncthreads();
    }
    return carry;
}

// The best-scoring position of from..to by `key` (highest key, the lowest position on ties), to
// every thread: one 64-bit max over (key with its sign bit flipped, ~position).
__device__ __forceinline__ int block_best(const int *key, int from, int to) {
    __shared__ unsigned long long best[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, warps = blockDim.x >> 5;
    unsigned long long m = 0;
    for (int j = from + threadIdx.x; j < to; j += blockDim.x) {
        const unsigned long long v =
            ((unsigned long long)((unsigned)key[j] ^ 0x80000000u) << 32) | (unsigned)~j;
        m = v > m ? v : m;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long u = __shfl_xor_sync(0xffffffffu, m, o);
        m = u > m ? u : m;
    }
    if (lane == 0) best[w] = m;
    __syncthreads();
    // As block_min: shuffles over the partials (a maximum of distinct keys: any order).
    unsigned long long all = lane < warps ? best[lane] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long u = __shfl_xor_sync(0xffffffffu, all, o);
        all = u > all ? u : all;
    }
    __syncthreads();  // best[] is free again
    return (int)~(unsigned)(all & 0xffffffffu);
}

// ATS's inverse-transform sampling over the n = len - prefix patches (inverse_transform_sample
// of src/keep.rs): sets flag[j] for every kept position j. a, c: n doubles each of scratch;
// order: n ints; cnt: n ints, zero on entry (the rank counts).
__device__ void inverse_transform(const float *sc, int prefix, int n, int samples, double *a, double *c, int *order,
                                  int *flag, int *cnt, double *dred, double *dshared) {
    if (n <= 1) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) flag[prefix + i] = 1;
        return;
    }
    // Ranking keys in c's space (c is written only once the order is known): (the weight's f32
    // bits, the position), ascending. The order of the f64 weights below: the weights are these
    // f32 values divided by one positive total (or all 1 / n), and distinct f32 values divided by
    // one double stay distinct and in order (24 significant bits against 53), so (weight,
    // position) and (key, position) order the patches alike.
    unsigned long long *rank_key = reinterpret_cast<unsigned long long *>(c);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float f = sc[prefix + i];  // NaN fails both tests below
        const float w = (isfinite(f) && f > 0.f) ? f : 0.f;
        a[i] = (double)w;
        rank_key[i] = ((unsigned long long)__float_as_uint(w) << 32) | (unsigned)i;
    }
    __syncthreads();
    // Thread 0's ordered f64 total and the ranking by the other warps at once (lever 118: they
    // read the same arrays and write different ones); then the weights normalised and the order
    // laid out in one phase. Ascending (weight, position), counted into cnt (n ints, zero on
    // entry).
    if (threadIdx.x == 0) {
        double total = -0.0;  // Rust's f64 sum starts at -0.0
        // Unrolled so that the loads run ahead of the (ordered, unchanged) chain of adds.
#pragma unroll 8
        for (int i = 0; i < n; ++i) total = __dadd_rn(total, a[i]);
        dshared[0] = total;
    }
    count_ranks<false>(rank_key, 0, n, cnt, blockDim.x > 32 ? 1 : 0);
    __syncthreads();
    const double total = dshared[0];
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        a[i] = total > 0.0 ? __ddiv_rn(a[i], total) : __ddiv_rn(1.0, (double)n);
        order[cnt[i]] = i;
    }
    __syncthreads();
    // The weights in ascending order first (in parallel), then the running sum over that
    // contiguous array: a chain of a[order[r]] loads, each waiting on the one before, made this
    // one thread's loop the step's longest part.
    for (int r = threadIdx.x; r < n; r += blockDim.x) c[r] = a[order[r]];
    __syncthreads();
    if (threadIdx.x == 0) {
        double acc = 0.0;
#pragma unroll 8
        for (int r = 0; r < n; ++r) {
            acc = __dadd_rn(acc, c[r]);
            c[r] = acc;
        }
    }
    __syncthreads();
    const double lo = c[0], hi = c[n - 1];
    const double range = __dsub_rn(hi, lo);
    if (!(range > 0.0)) {
        if (threadIdx.x == 0) flag[prefix + order[n - 1]] = 1;
        return;
    }
    __syncthreads();  // every thread has read c[0] and c[n - 1] before they are normalised
    double smallest = INFINITY;
    for (int r = threadIdx.x; r < n; r += blockDim.x) {
        const double v = __ddiv_rn(__dsub_rn(c[r], lo), range);
        c[r] = v;
        if (v > 0.0) smallest = fmin(smallest, v);
    }
    double y0 = block_min(smallest, dred);  // its barrier also publishes the normalised c
    if (!isfinite(y0)) y0 = 1.0;
    for (int i = threadIdx.x; i < samples; i += blockDim.x) {
        const double y = samples == 1
                             ? 1.0
                             : __dadd_rn(y0, __ddiv_rn(__dmul_rn((double)i, __dsub_rn(1.0, y0)), (double)(samples - 1)));
        // Several points may pick one token: an atomic store, so the writes do not race.
        atomicExch(&flag[prefix + order[nearest_first(c, n, y)]], 1);
    }
}

// Threads of a decide block (the Rust launch uses the same number): at small batches one block's
// latency is the step's, and its parallel phases (logits, value norms, ranks) split over them.
#define DECIDE_THREADS 1024

// One block per sequence. Dynamic shared memory: tmp_floats floats of scratch (at least 4·len:
// the score computation's logits, then two f64 arrays for inverse_transform), then sc, key,
// order and flag, len entries each.
template <typename T>
__device__ void select_decide(const T *__restrict__ x, const float *__restrict__ scores, int score_stride,
                              const T *__restrict__ qkv, const uint32_t *__restrict__ cu, uint32_t *__restrict__ plan,
                              int batch, int total, int C, int prefix, int mode, int heads, float scale, int rule,
                              int count_kind, int count, double param, int fuse, int tmp_floats) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ float red[32];
    __shared__ double dred[32];
    __shared__ double dshared[1];
    __shared__ int ishared[2];
    const int b = blockIdx.x;
    const int start = (int)cu[b], len = (int)cu[b + 1] - start;
    const int n = len - prefix;  // >= 1, checked on the host
    float *tmp = reinterpret_cast<float *>(smem);
    float *sc = tmp + tmp_floats;
    int *key = reinterpret_cast<int *>(sc + len);
    int *order = key + len;
    int *flag = order + len;

    sequence_scores<T>(sc, tmp, tmp_floats, red, x, scores, score_stride, qkv, start, len, C, mode, heads, scale);
    // Ranking keys in tmp (free once the scores are in sc; tmp_floats >= 4 · len): the score's
    // total_key as an unsigned (sign bit flipped), then the position inverted, so that a larger
    // key is a higher score, or the same score at a lower position.
    unsigned long long *rank_key = reinterpret_cast<unsigned long long *>(tmp);
    const bool best_first = rule == RULE_TOP || rule == RULE_MASS_SHARE;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        key[j] = total_key(sc[j]);
        flag[j] = 0;
        if (best_first) rank_key[j] = ((unsigned long long)((unsigned)key[j] ^ 0x80000000u) << 32) | (unsigned)~j;
    }
    __syncthreads();
    // order[r]: the patch position ranked r-th best (descending score, ties to the lower position),
    // for the rules that take tokens best-first; counted into flag (zero), which is cleared after.
    if (best_first) {
        count_ranks<true>(rank_key, prefix, len, flag, 0);
        __syncthreads();
        for (int j = prefix + threadIdx.x; j < len; j += blockDim.x) order[flag[j]] = j;
        __syncthreads();
        for (int j = prefix + threadIdx.x; j < len; j += blockDim.x) flag[j] = 0;
        __syncthreads();
    }
    int k = -1;  // best-first tokens kept (count rules); -1: the rule set the flags itself
    if (rule == RULE_TOP) {
        k = count_kind == 0 ? min(max(count, 1), n) : ceil_count(param, n);
    } else if (rule == RULE_AT_LEAST || rule == RULE_ABOVE || rule == RULE_MEAN_TIMES) {
        float t = (float)param;
        if (rule == RULE_MEAN_TIMES) {
            if (threadIdx.x == 0) {
                double sum = -0.0;
#pragma unroll 8
                for (int j = prefix; j < len; ++j) sum = __dadd_rn(sum, (double)sc[j]);
                red[0] = __double2float_rn(__dmul_rn(param, __ddiv_rn(sum, (double)n)));
            }
            __syncthreads();
            t = red[0];
        }
        int any = 0;
        for (int j = prefix + threadIdx.x; j < len; j += blockDim.x) {
            const int pass = rule == RULE_ABOVE ? sc[j] > t : sc[j] >= t;
            flag[j] = pass;
            any |= pass;
        }
        // Nothing passes: the best one.
        if (!__syncthreads_or(any)) {
            const int best = block_best(key, prefix, len);
            if (threadIdx.x == 0) flag[best] = 1;
        }
    } else if (rule == RULE_MASS_SHARE) {
        // The weights in rank order, gathered in parallel into the (now free) scratch, then their
        // running sums in rank order by one thread: a plain chain of adds, stored in place. The
        // total is the last sum and the cut the first sum reaching share · total, found by every
        // thread at once. The host sums the total from -0.0 and the running sum from 0.0; the
        // two differ at most in the sign of a zero total, which leaves target's comparisons alike.
        double *ranked = reinterpret_cast<double *>(tmp);
        for (int r = threadIdx.x; r < n; r += blockDim.x) ranked[r] = (double)weight(sc[order[r]]);
        if (threadIdx.x == 0) ishared[0] = n;
        __syncthreads();
        if (threadIdx.x == 0) {
            double acc = 0.0;
#pragma unroll 8
            for (int r = 0; r < n; ++r) {
                acc = __dadd_rn(acc, ranked[r]);
                ranked[r] = acc;
            }
        }
        __syncthreads();
        const double target = __dmul_rn(param, ranked[n - 1]);
        int first = n;
        for (int r = threadIdx.x; r < n; r += blockDim.x)
            if (ranked[r] >= target) first = min(first, r + 1);
        if (first < n) atomicMin(&ishared[0], first);
        __syncthreads();
        k = max(ishared[0], 1);
    } else {
        const int samples = count_kind == 0 ? max(count, 1) : ceil_count(param, n);
        double *a = reinterpret_cast<double *>(tmp);
        // key as the rank counts (the generic ranking above did not run for this rule).
        for (int i = threadIdx.x; i < n; i += blockDim.x) key[i] = 0;
        __syncthreads();
        inverse_transform(sc, prefix, n, samples, a, a + len, order, flag, key, dred, dshared);
    }
    for (int r = threadIdx.x; r < k; r += blockDim.x) flag[order[r]] = 1;
    __syncthreads();
    // The dropped rows' weights, f64 in position order (the EViT pruner's host rule): laid out in
    // parallel first, kept rows as -0.0 (x + -0.0 is x, signed zeros included), then summed over
    // the contiguous array by one thread. Lever 118: laid out and summed whenever the step fuses
    // (used only if some row is dropped), so that thread 0's sum runs while warp 1 scans the
    // flags: slots (kept rows in ascending position after the prefix) into key, free by now, and
    // the kept count. One warp's scan, not the block's: no barriers, and the block's four cost
    // more than its 32-row chunks (integer sums: the same slots either way).
    double *dropped_w = reinterpret_cast<double *>(tmp);
    if (fuse != 0) {
        for (int j = prefix + threadIdx.x; j < len; j += blockDim.x)
            dropped_w[j - prefix] = flag[j] ? -0.0 : (double)weight(sc[j]);
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        double whole = -0.0;
        if (fuse != 0) {
#pragma unroll 8
            for (int i = 0; i < n; ++i) whole = __dadd_rn(whole, dropped_w[i]);
        }
        dshared[0] = whole;
    } else if (threadIdx.x / 32 == 1) {  // DECIDE_THREADS: 32 warps
        const int lane = threadIdx.x % 32;
        int carry = 0;
        for (int base = prefix; base < len; base += 32) {
            const int j = base + lane;
            const int f = j < len ? flag[j] : 0;
            const int inclusive = select_common::warp_inclusive_sum(f);
            if (j < len) key[j] = carry + inclusive - f;
            carry += __shfl_sync(0xffffffffu, inclusive, 31);
        }
        if (lane == 0) ishared[1] = carry;
    }
    __syncthreads();
    const int kept = ishared[1];
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const int slot = j < prefix ? j : (flag[j] ? prefix + key[j] : -1);
        plan[2 * batch + start + j] = (uint32_t)slot;
    }
    const int fused = fuse != 0 && kept < n;
    float *w_out = reinterpret_cast<float *>(plan + 2 * batch + total) + start;
    if (threadIdx.x == 0) {
        plan[b] = (uint32_t)(prefix + kept + fused);
        plan[batch + b] = (uint32_t)fused;
    }
    const double whole = dshared[0];
    const int dropped = n - kept;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        float v = 0.f;
        if (fused && j >= prefix && !flag[j]) {
            const double wj = (double)weight(sc[j]);
            if (fuse == 2) v = (float)wj;
            else if (whole > 0.0) v = __double2float_rn(__ddiv_rn(wj, whole));
            else v = __double2float_rn(__ddiv_rn(1.0, (double)dropped));
        }
        w_out[j] = v;
    }
}

// Copies kept rows to their slots and builds the fused rows. Blocks [0, row_blocks): a warp per
// input row (its sequence found by binary search in cu); blocks [row_blocks, row_blocks + B·F):
// column slices of the fused row of each sequence (when the plan says so), Σ w_j x_j over its
// dropped rows.
template <typename T>
__device__ void select_gather(const T *__restrict__ x, const uint32_t *__restrict__ plan, const uint32_t *__restrict__ cu,
                              const uint32_t *__restrict__ new_cu, T *__restrict__ out, int batch, int total, int C,
                              int row_blocks, int fused_slices) {
    const int *slot = reinterpret_cast<const int *>(plan + 2 * batch);
    const float *w = reinterpret_cast<const float *>(plan + 2 * batch + total);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    if ((int)blockIdx.x < row_blocks) {
        const int row = blockIdx.x * warps + warp;
        // Rows past cu[batch] (a device-lengths batch's spare capacity) have no plan entry.
        if (row >= total || row >= (int)cu[batch]) return;
        const int s = slot[row];
        if (s < 0) return;
        int lo = 0, hi = batch;  // the last b with cu[b] <= row
        while (hi - lo > 1) {
            const int mid = (lo + hi) / 2;
            if ((int)cu[mid] <= row) lo = mid;
            else hi = mid;
        }
        const T *src = x + (size_t)row * C;
        T *dst = out + ((size_t)new_cu[lo] + s) * C;
        const bool vec = ((C * sizeof(T)) % 16 == 0) && ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(out)) % 16 == 0);
        if (vec) {
            const int nv = C * sizeof(T) / 16;
            for (int c = lane; c < nv; c += 32)
                reinterpret_cast<uint4 *>(dst)[c] = reinterpret_cast<const uint4 *>(src)[c];
        } else {
            for (int c = lane; c < C; c += 32) dst[c] = src[c];
        }
        return;
    }
    // Fused rows: `fused_slices` blocks per sequence, a column slice each; inside a block thread
    // (g, c) sums the dropped rows start + g, start + g + G, ... of column c and the G partials
    // are added in order (one thread walking every row of a column was a chain of loads).
    const int q = blockIdx.x - row_blocks;
    const int b = q / fused_slices, f = q % fused_slices;
    if (!plan[batch + b]) return;
    const int cols = (C + fused_slices - 1) / fused_slices;
    const int c_begin = f * cols, c_end = min(C, c_begin + cols);
    if (c_begin >= c_end) return;  // the whole block leaves: no barrier below is split
    const int start = (int)cu[b], end = (int)cu[b + 1];
    T *dst = out + ((size_t)new_cu[b + 1] - 1) * C;
    __shared__ float part[GATHER_THREADS];
    const int width = min(c_end - c_begin, (int)blockDim.x);
    const int groups = blockDim.x / width;
    const int g = threadIdx.x / width, ci = threadIdx.x % width;
    for (int c0 = c_begin; c0 < c_end; c0 += width) {
        const int c = c0 + ci;
        float acc = 0.f;
        if (g < groups && c < c_end)
            for (int j = start + g; j < end; j += groups)
                if (slot[j] < 0) acc = fmaf(w[j], to_f32(x[(size_t)j * C + c]), acc);
        __syncthreads();  // the previous chunk's partials have been read
        if (g < groups) part[g * width + ci] = acc;
        __syncthreads();
        if (threadIdx.x < width && c < c_end) {
            float a = 0.f;
            for (int k = 0; k < groups; ++k) a += part[k * width + ci];
            dst[c] = from_f32<T>(a);
        }
    }
}

}  // namespace rule_detail

#define RULE_ENTRIES(SUFFIX, T)                                                                                    \
    extern "C" __global__ void __launch_bounds__(DECIDE_THREADS) ragged_select_decide_##SUFFIX(                   \
        const T *x, const float *scores, int score_stride, const T *qkv, const uint32_t *cu, uint32_t *plan,      \
        int batch, int total, int C, int prefix, int mode, int heads, float scale, int rule, int count_kind,      \
        int count, double param, int fuse, int tmp_floats) {                                                       \
        rule_detail::select_decide<T>(x, scores, score_stride, qkv, cu, plan, batch, total, C, prefix, mode,      \
                                      heads, scale, rule, count_kind, count, param, fuse, tmp_floats);             \
    }                                                                                                              \
    extern "C" __global__ void ragged_select_gather_##SUFFIX(const T *x, const uint32_t *plan, const uint32_t *cu, \
                                                             const uint32_t *new_cu, T *out, int batch, int total, \
                                                             int C, int row_blocks, int fused_slices) {            \
        rule_detail::select_gather<T>(x, plan, cu, new_cu, out, batch, total, C, row_blocks, fused_slices);        \
    }
RULE_ENTRIES(f32, float)
RULE_ENTRIES(f16, __half)
RULE_ENTRIES(bf16, __nv_bfloat16)

#define CLS_PROBS_ENTRY(SUFFIX, T)                                                                                 \
    extern "C" __global__ void ragged_cls_probs_##SUFFIX(const T *qkv, const uint32_t *cu, float *out,            \
                                                         int out_stride, int heads, int C, float scale) {         \
        select_detail::cls_probs<T>(qkv, cu, out, out_stride, heads, C, scale);                                   \
    }
CLS_PROBS_ENTRY(f32, float)
CLS_PROBS_ENTRY(f16, __half)
CLS_PROBS_ENTRY(bf16, __nv_bfloat16)

// select_by_rule_bounded's middle kernel: cu[0] = 0, cu[b + 1] = lengths[0] + ... + lengths[b]
// (the plan's leading B entries), in one block of OFFSETS_THREADS threads (block_exclusive_sum).
#define OFFSETS_THREADS 1024
extern "C" __global__ void __launch_bounds__(OFFSETS_THREADS)
    ragged_lengths_to_offsets(const uint32_t *__restrict__ lengths, uint32_t *__restrict__ cu, int batch) {
    const uint32_t total = rule_detail::block_exclusive_sum(lengths, cu, 0, batch);
    if (threadIdx.x == 0) cu[batch] = total;
}

// ---------------------------------------------------------------------------------------------
// Per-sequence mean rows (sequence_mean): block (b, y) averages columns 32y..32y+31 of sequence
// b's rows after its first `skip`. Warp w sums rows first+w, first+w+8, ... (MEAN_PARTIALS
// partials per column), then warp 0 adds the partials in order and divides with IEEE rounding:
// the CPU path sums in the same order, so both give the same bits. x rows may be strided.
// ---------------------------------------------------------------------------------------------

#define MEAN_PARTIALS 8

namespace mean_detail {

template <typename T>
__device__ __forceinline__ void sequence_mean_cols(const T *__restrict__ x, T *__restrict__ out,
                                                   const uint32_t *__restrict__ cu, long long row_stride, int D,
                                                   int skip) {
    __shared__ float partial[MEAN_PARTIALS][32];
    const int b = blockIdx.x;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int col = blockIdx.y * 32 + lane;
    const int first = (int)cu[b] + skip, end = (int)cu[b + 1];
    float acc = 0.f;
    if (col < D)
        for (int r = first + w; r < end; r += MEAN_PARTIALS) acc += to_f32(x[(long long)r * row_stride + col]);
    partial[w][lane] = acc;
    __syncthreads();
    if (w == 0 && col < D) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < MEAN_PARTIALS; ++i) s += partial[i][lane];
        out[(long long)b * D + col] = from_f32<T>(__fdiv_rn(s, (float)(end - first)));
    }
}

}  // namespace mean_detail

#define MEAN_ENTRY(SUFFIX, T)                                                                                     \
    extern "C" __global__ void __launch_bounds__(MEAN_PARTIALS * 32)                                             \
        ragged_sequence_mean_##SUFFIX(const T *x, T *out, const uint32_t *cu, long long row_stride, int D,       \
                                      int skip) {                                                                 \
        mean_detail::sequence_mean_cols<T>(x, out, cu, row_stride, D, skip);                                     \
    }
MEAN_ENTRY(f32, float)
MEAN_ENTRY(f16, __half)
MEAN_ENTRY(bf16, __nv_bfloat16)
