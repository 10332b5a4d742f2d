// The arithmetic of a fixed-count token-selection step that more than one kernel runs: the score
// of a token from the class-attention probabilities cls_probs writes (or a given score), the
// ranking, where each kept token goes, and the fused token (EViT's extra row). Two kernel files
// use it: candle-ragged's select_top_k (ragged_attention.cu) and candle-fastpath's
// select_mlp_block, which runs a step's selection at the head of the MLP half instead of in a
// launch of its own (lever 87), so both must keep the same tokens and fuse the same bits.
//
// candle-ragged builds with --use_fast_math, candle-fastpath without it, so every floating-point
// operation here is written as the instruction fast math makes of it (denormals flushed; a / b,
// 1 / x approximate; __fsqrt_rn rounded): the same bits in both files, and the bits
// select_top_k gave before this header (only the fused row's summation order is new). Adds and
// multiplies carry an explicit .rn: without a rounding modifier ptxas may contract them with a
// neighbouring multiply (fast math's a / b is one) into a fused multiply-add, which is how a
// class-attention score once came out with other bits inside one kernel than another (lever 85).
//
// Every order below is fixed by the data alone (no launch shape, block size or batch size enters
// it): a sequence selects and fuses the same bits in any batch and in either kernel.
#pragma once

#include <stdint.h>

namespace select_common {

__device__ __forceinline__ float sel_add(float a, float b) {
    float d;
    asm("add.rn.ftz.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}
__device__ __forceinline__ float sel_mul(float a, float b) {
    float d;
    asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}
// a · b + c, one rounding (fast math contracts `acc += w * v` into this).
__device__ __forceinline__ float sel_fma(float a, float b, float c) {
    float d;
    asm("fma.rn.ftz.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
    return d;
}
// a / b as fast math divides.
__device__ __forceinline__ float sel_div(float a, float b) {
    float d;
    asm("div.approx.ftz.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}
// 1 / x as fast math computes it.
__device__ __forceinline__ float sel_rcp(float x) {
    float d;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(d) : "f"(x));
    return d;
}
// __fsqrt_rn under fast math.
__device__ __forceinline__ float sel_sqrt(float x) {
    float d;
    asm("sqrt.rn.ftz.f32 %0, %1;" : "=f"(d) : "f"(x));
    return d;
}

__device__ __forceinline__ float sel_sub(float a, float b) {
    float d;
    asm("sub.rn.ftz.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}
__device__ __forceinline__ float sel_max(float a, float b) {
    float d;
    asm("max.ftz.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}
// expf as fast math computes it: 2^(x · log2 e), the product rounded first.
__device__ __forceinline__ float sel_exp(float x) {
    float t, d;
    asm("mul.rn.ftz.f32 %0, %1, 0f3FB8AA3B;" : "=f"(t) : "f"(x));
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(d) : "f"(t));
    return d;
}

// ---------------------------------------------------------------------------------------------
// The class token's attention probabilities of one head, the arithmetic of cls_probs (and of the
// selection kernels' in-kernel scores, and of candle-fastpath's attention_residual, which
// computes them beside the attention: lever 88): the query q_cls · scale rounded to the storage
// type (cls_query), each key's logit as the fused multiply-adds of the query and the key in
// ascending order rounded to the storage type (cls_dot, by the caller's rounding), the maximum
// and the exp-sum of the logits by one warp (cls_softmax_stats), and each probability
// exp(l - max) / sum (cls_prob).

// q · scale, rounded by the caller to the storage type.
__device__ __forceinline__ float cls_query(float q, float scale) { return sel_mul(q, scale); }

// Σ qs[i] · k(i) over i < n, ascending, one fused multiply-add each; `k(i)`: the key's element i
// as f32.
template <typename Key>
__device__ __forceinline__ float cls_dot(const float *qs, int n, Key k) {
    float acc = 0.f;
    for (int i = 0; i < n; ++i) acc = sel_fma(qs[i], k(i), acc);
    return acc;
}

// The max and the exp-sum of l[0 .. len) by one warp, every lane getting both: lane-strided, then
// a butterfly (xor 16, 8, 4, 2, 1). Every warp that calls it gets the same bits.
__device__ __forceinline__ void cls_softmax_stats(const float *l, int len, float &m, float &sum) {
    const int lane = threadIdx.x % 32;
    m = -INFINITY;
    for (int j = lane; j < len; j += 32) m = sel_max(m, l[j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = sel_max(m, __shfl_xor_sync(0xffffffffu, m, o));
    sum = 0.f;
    for (int j = lane; j < len; j += 32) sum = sel_add(sum, sel_exp(sel_sub(l[j], m)));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum = sel_add(sum, __shfl_xor_sync(0xffffffffu, sum, o));
}

__device__ __forceinline__ float cls_prob(float l, float m, float sum) { return sel_div(sel_exp(sel_sub(l, m)), sum); }

// NaN → -inf, then the integer key whose order is f32's total order (Rust's total_cmp).
__device__ __forceinline__ int total_key(float s) {
    int bits = __float_as_int(s);
    if ((bits & 0x7fffffff) > 0x7f800000) bits = __float_as_int(-INFINITY);
    return bits ^ ((bits >> 31) & 0x7fffffff);
}

// max(score, 0) with NaN → 0: a dropped token's weight in the fused row.
__device__ __forceinline__ float weight(float s) {
    const int bits = __float_as_int(s);
    if ((bits & 0x7fffffff) > 0x7f800000) return 0.f;
    float d;
    asm("max.ftz.f32 %0, %1, 0f00000000;" : "=f"(d) : "f"(s));
    return d;
}

// Token j's score from one sequence's rows `p` (row stride `stride`) as the selection kernels'
// modes read them: 0, p[j] (given); 4, the heads' class-attention probabilities (rows 0 ..
// heads - 1, cls_probs) added in head order, times 1 / heads (EViT); 5, that sum times the square
// root of row `heads` (the value rows' sums of squares: ATS's significance).
__device__ __forceinline__ float step_score(const float *__restrict__ p, int stride, int j, int mode, int heads) {
    if (mode == 0) return p[j];
    float acc = 0.f;
    for (int h = 0; h < heads; ++h) acc = sel_add(acc, p[(size_t)h * stride + j]);
    return mode == 4 ? sel_mul(acc, sel_rcp((float)heads)) : sel_mul(acc, sel_sqrt(p[(size_t)heads * stride + j]));
}

// step_score in two halves, for a kernel that issues the loads first and computes later (with
// other loads issued in between): the values step_score reads for token j into v (heads + 1 rows
// at most, STEP_SCORE_ROWS), then the score from them by step_score's operations in its order,
// so the same bits.
constexpr int STEP_SCORE_ROWS = 8;
__device__ __forceinline__ void step_score_load(const float *__restrict__ p, int stride, int j, int mode, int heads,
                                                float (&v)[STEP_SCORE_ROWS]) {
#pragma unroll
    for (int h = 0; h < STEP_SCORE_ROWS; ++h) {
        const bool wanted = mode == 0 ? h == 0 : (h < heads || (mode == 5 && h == heads));
        v[h] = wanted ? p[(size_t)h * stride + j] : 0.f;
    }
}
__device__ __forceinline__ float step_score_from(const float (&v)[STEP_SCORE_ROWS], int mode, int heads) {
    if (mode == 0) return v[0];
    float acc = 0.f, vnorm = 0.f;
#pragma unroll
    for (int h = 0; h < STEP_SCORE_ROWS; ++h) {
        if (h < heads) acc = sel_add(acc, v[h]);
        if (h == heads) vnorm = v[h];
    }
    return mode == 4 ? sel_mul(acc, sel_rcp((float)heads)) : sel_mul(acc, sel_sqrt(vnorm));
}

// kept[j] (0 / 1) for every token j < len, from every token's key (shared memory): the first
// `prefix` tokens always; a patch when fewer than `keep` patches rank before it (a higher key, or
// the same key at a lower position: the host pruners' rule, so device and host keep the same
// tokens). P = 1, 2, 4 or 8 adjacent threads count one patch's rank, each over every P-th patch,
// and add their counts by shuffles (integers: no order to fix): at 197 tokens and 512 threads
// each thread compares ~98 pairs instead of 196. The patches before j rank before it with a key
// at least as high, those after it with a higher one: two loops of one comparison each (the
// ranking is issue-bound on one SM, ~39k comparisons at 197 tokens: lever 91). No barrier at
// the end.
__device__ __forceinline__ void rank_tokens(const int *key, int *kept, int len, int prefix, int keep) {
    int parts = 1;
    while (parts < 8 && len * parts * 2 <= (int)blockDim.x) parts *= 2;
    const int p = threadIdx.x % parts;
    for (int base = 0; base < len * parts; base += blockDim.x) {
        const int j = (base + (int)threadIdx.x) / parts;
        int count = 0;
        if (j < len && j >= prefix) {
            const int kj = key[j];
            int i = prefix + p;
#pragma unroll 8
            for (; i < j; i += parts) count += key[i] >= kj;
            if (i == j) i += parts;
#pragma unroll 8
            for (; i < len; i += parts) count += key[i] > kj;
        }
        for (int o = 1; o < parts; o <<= 1) count += __shfl_xor_sync(0xffffffffu, count, o);
        if (j < len && p == 0) kept[j] = j < prefix ? 1 : count < keep;
    }
}

// v summed over lanes 0 .. this lane of the warp (every lane must call it).
template <typename T>
__device__ __forceinline__ T warp_inclusive_sum(T v) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const T u = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += u;
    }
    return v;
}

// Where each token goes, from kept[0 .. len) (0 / 1, shared memory): src[r] for r < the number
// kept, the position of the r-th kept token in ascending order (its output row), and
// dropped[d], the d-th dropped token's position in ascending order. A scan over chunks of
// blockDim.x (a multiple of 32, at most 1024) by warp ballots; `warp_counts` holds 32 ints.
// Ends on a barrier.
__device__ __forceinline__ void place_tokens(const int *kept, int len, int *src, int *dropped, int *warp_counts) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    int kept_before = 0, dropped_before = 0;
    for (int j0 = 0; j0 < len; j0 += blockDim.x) {
        const int j = j0 + threadIdx.x;
        const int k = j < len ? kept[j] : 0;
        const unsigned ballot = __ballot_sync(0xffffffffu, k);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        // The warps' counts scanned by each warp's lanes (warps <= 32): lane w holds the kept
        // tokens of warps 0 .. w.
        const int c = lane < warps ? warp_counts[lane] : 0;
        const int scan = warp_inclusive_sum(c);
        const int in_warps_before = __shfl_sync(0xffffffffu, scan - c, warp);
        const int in_chunk = __shfl_sync(0xffffffffu, scan, warps - 1);
        const int k_pos = kept_before + in_warps_before + __popc(ballot & ((1u << lane) - 1u));
        if (j < len) {
            if (k) src[k_pos] = j;
            else dropped[dropped_before + (j - j0) - (k_pos - kept_before)] = j;
        }
        kept_before += in_chunk;
        dropped_before += min((int)blockDim.x, len - j0) - in_chunk;
        __syncthreads();  // warp_counts is rewritten by the next chunk
    }
}

// Dropped tokens per partial sum of a fused-row column: partial g adds dropped[g],
// dropped[g + FUSE_GROUPS], ... in that order, then the partials are added in order g = 0, 1, ...
constexpr int FUSE_GROUPS = 8;

// The sum of the dropped tokens' weights, w(s[dropped[0]]) + ..., by warp 0: lane l adds dropped
// l, l + 32, ... in order, then a butterfly (xor 16, 8, 4, 2, 1). Into *out (shared memory) for
// the whole block after the caller's next barrier. `s`: the scores by position.
__device__ __forceinline__ void fused_weight_total(const float *s, const int *dropped, int nd, float *out) {
    if (threadIdx.x >= 32) return;
    float t = 0.f;
    for (int d = threadIdx.x; d < nd; d += 32) t = sel_add(t, weight(s[dropped[d]]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t = sel_add(t, __shfl_xor_sync(0xffffffffu, t, o));
    if (threadIdx.x == 0) *out = t;
}

// The fused row's columns [0, width) from FUSE_GROUPS partial sums per column (partial q of
// column c at part[q · stride + c], the plain sums at part_plain): the partials added in order
// q = 0, 1, ..., then fuse 2 the weighted sum, fuse 1 that over `total` (or the plain mean over nd
// when the weights sum to 0); store(c, value). One thread per column; no barrier. fused_columns
// and fused_columns8 both end with it, so their rows have the same bits.
template <typename Store>
__device__ __forceinline__ void fused_partials_sum(const float *part, const float *part_plain, int stride, int width,
                                                   int fuse, float total, int nd, Store store) {
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        float a = 0.f, p = 0.f;
#pragma unroll
        for (int q = 0; q < FUSE_GROUPS; ++q) {
            a = sel_add(a, part[q * stride + c]);
            p = sel_add(p, part_plain[q * stride + c]);
        }
        store(c, fuse == 2 ? a : (total > 0.f ? sel_div(a, total) : sel_div(p, (float)nd)));
    }
}

// Columns a thread of fused_columns sums at once (FUSE_GROUPS · blockDim.x / FUSE_GROUPS threads
// cover FUSE_COLS · blockDim.x / FUSE_GROUPS columns per pass: 192 at 512 threads).
constexpr int FUSE_COLS = 3;

// Columns [c_begin, c_end) of the fused token of one sequence from its nd > 0 dropped tokens:
// fuse 2, Σ w_d · x_d (the weighted sum); fuse 1, that over `total` = Σ w_d (fused_weight_total),
// or the plain mean Σ x_d / nd when the weights sum to 0. `load(row, col)`: x's element as f32;
// `store(col, value)`. Thread (g, l) of the block sums partial g of columns l, l + L, l + 2L
// (L = blockDim.x / FUSE_GROUPS), their loads of a dropped row issued together; then one thread
// per column adds the partials in order. `part` (shared memory) holds 2 · FUSE_COLS · blockDim.x
// floats. Every thread must call it (it has barriers); ends on one.
template <typename Load, typename Store>
__device__ __forceinline__ void fused_columns(const float *s, const int *dropped, int nd, int fuse, float total,
                                              int c_begin, int c_end, float *part, Load load, Store store) {
    const int lanes = blockDim.x / FUSE_GROUPS, span = FUSE_COLS * lanes;
    const int g = threadIdx.x / lanes, l = threadIdx.x % lanes;
    float *part_plain = part + FUSE_GROUPS * span;
    for (int c0 = c_begin; c0 < c_end; c0 += span) {
        const int width = min(span, c_end - c0);
        float acc[FUSE_COLS], plain[FUSE_COLS];
#pragma unroll
        for (int k = 0; k < FUSE_COLS; ++k) acc[k] = plain[k] = 0.f;
        if (g < FUSE_GROUPS) {
#pragma unroll 4
            for (int d = g; d < nd; d += FUSE_GROUPS) {
                const int j = dropped[d];
                const float w = weight(s[j]);
#pragma unroll
                for (int k = 0; k < FUSE_COLS; ++k) {
                    const int c = l + k * lanes;
                    if (c < width) {
                        const float v = load(j, c0 + c);
                        acc[k] = sel_fma(w, v, acc[k]);
                        plain[k] = sel_add(plain[k], v);
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < FUSE_COLS; ++k) {
                const int c = l + k * lanes;
                if (c < width) {
                    part[g * span + c] = acc[k];
                    part_plain[g * span + c] = plain[k];
                }
            }
        }
        __syncthreads();
        fused_partials_sum(part, part_plain, span, width, fuse, total, nd,
                           [&](int c, float v) { store(c0 + c, v); });
        __syncthreads();  // the partials are rewritten by the next pass
    }
}

// fused_columns for a row that a caller can read 8 columns at a time: the same arithmetic for
// every column (partial g adds dropped[g], dropped[g + FUSE_GROUPS], ... in that order, each a
// fused multiply-add of its weight and a plain add; the partials added in order; then the same
// division), so the same bits, with one thread per (partial, 8 columns) whose row loads are
// issued FUSE_BATCH at a time: at 59 dropped tokens one round trip instead of fused_columns'
// two of 2-byte loads (lever 91). `width` columns, a multiple of 8, with FUSE_GROUPS · width / 8
// <= blockDim.x; `load8(row, col)`: x's elements col .. col + 7 of row `row` as one 16-byte value
// (kept raw until used: 4 registers a row), `elem(raw, e)` its element e as f32;
// `store(col, value)`. `part` holds 2 · FUSE_GROUPS · width floats. Every thread must call it (it
// has barriers); ends on one.
constexpr int FUSE_BATCH = 8;
template <typename Load8, typename Elem, typename Store>
__device__ __forceinline__ void fused_columns8(const float *s, const int *dropped, int nd, int fuse, float total,
                                               int width, float *part, Load8 load8, Elem elem, Store store) {
    const int chunks = width / 8, g = threadIdx.x / chunks, c8 = threadIdx.x % chunks;
    float *part_plain = part + FUSE_GROUPS * width;
    if (g < FUSE_GROUPS) {
        float acc[8], plain[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = plain[e] = 0.f;
        for (int d0 = g; d0 < nd; d0 += FUSE_GROUPS * FUSE_BATCH) {
            uint4 raw[FUSE_BATCH];
            float w[FUSE_BATCH];
#pragma unroll
            for (int u = 0; u < FUSE_BATCH; ++u) {
                const int d = d0 + u * FUSE_GROUPS;
                w[u] = 0.f;
                raw[u] = make_uint4(0u, 0u, 0u, 0u);
                if (d < nd) {
                    const int j = dropped[d];
                    w[u] = weight(s[j]);
                    raw[u] = load8(j, c8 * 8);
                }
            }
#pragma unroll
            for (int u = 0; u < FUSE_BATCH; ++u) {
                if (d0 + u * FUSE_GROUPS < nd) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        const float v = elem(raw[u], e);
                        acc[e] = sel_fma(w[u], v, acc[e]);
                        plain[e] = sel_add(plain[e], v);
                    }
                }
            }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            part[g * width + c8 * 8 + e] = acc[e];
            part_plain[g * width + c8 * 8 + e] = plain[e];
        }
    }
    __syncthreads();
    fused_partials_sum(part, part_plain, width, width, fuse, total, nd, store);
    __syncthreads();
}

}  // namespace select_common
