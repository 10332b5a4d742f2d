// The warp-level pieces of the mma.sync attention kernels (ragged_attention.cu): the m16n8k16
// product, cp.async and ldmatrix wrappers, the shared-memory row layout of K / V, and one warp's
// online softmax over 16 query rows (begin_rows, attend_keys, end_rows; attend_keys_rows walks
// several groups of 16 rows over the same keys, lever 135's paired tiles). A header so that other
// kernels can run the same attention arithmetic inside their own launches: candle-fastpath's
// attention_residual_norm_linear finds it through this crate's `include` build metadata.
#pragma once

#include "attention_common.cuh"

namespace {

// D (16x8, f32) += A (16x16, row) * B (16x8, col)
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16-byte global -> shared copy; src_bytes == 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_16(void *dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Four 8x8 b16 matrices from shared memory, transposed: the B operands of two m16n8k16 products.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p)));
}

// Key-tile size: 64 keys, or 32 for head_dim 128 so that two buffers of K and V stay under 48 KB.
template <int D> struct TileCfg {
    static constexpr int KEYS = D >= 128 ? 32 : 64;
    static constexpr int PAD = 8;            // halves: rows of D+8 halves make 32-bit and ldmatrix reads conflict-free
    static constexpr int ROW = D + PAD;      // shared-memory row length in elements
    static constexpr int CHUNKS = D / 8;     // 16-byte chunks per row
};

// Four 8x8 b16 matrices from shared memory, not transposed: with K's rows (keys) as the matrix
// rows, these are the B operands of Q K^T for two consecutive k-steps.
__device__ __forceinline__ void ldmatrix_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p)));
}

// Per-warp state of 16 query rows: the row of Q as A fragments, the output accumulators and the
// online softmax's running max (log2 units) and partial row sums of rows g and g + 8.
template <int D> struct RowState {
    uint32_t qa[D / 16][4];
    float acc_o[D / 8][4];
    float m0, m1, l0, l1;
};

// Loads the 16 query rows row_base.. of one (sequence, head) as A fragments (rows past the end
// are zero) and resets the accumulators.
template <typename T, int D>
__device__ __forceinline__ void begin_rows(RowState<D> &st, const T *qh, long long q_tok, int row_base, int len, int lane) {
    const int g = lane / 4, t = lane % 4;
    const int row0 = row_base + g, row1 = row0 + 8;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int c = kk * 16 + t * 2;
        st.qa[kk][0] = row0 < len ? *reinterpret_cast<const uint32_t *>(qh + row0 * q_tok + c) : 0u;
        st.qa[kk][1] = row1 < len ? *reinterpret_cast<const uint32_t *>(qh + row1 * q_tok + c) : 0u;
        st.qa[kk][2] = row0 < len ? *reinterpret_cast<const uint32_t *>(qh + row0 * q_tok + c + 8) : 0u;
        st.qa[kk][3] = row1 < len ? *reinterpret_cast<const uint32_t *>(qh + row1 * q_tok + c + 8) : 0u;
    }
#pragma unroll
    for (int i = 0; i < D / 8; ++i) st.acc_o[i][0] = st.acc_o[i][1] = st.acc_o[i][2] = st.acc_o[i][3] = 0.f;
    st.m0 = st.m1 = -INFINITY;
    st.l0 = st.l1 = 0.f;
}

// Resets the accumulators and the online softmax's state (Q's fragments untouched).
template <int D>
__device__ __forceinline__ void reset_rows(RowState<D> &st) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) st.acc_o[i][0] = st.acc_o[i][1] = st.acc_o[i][2] = st.acc_o[i][3] = 0.f;
    st.m0 = st.m1 = -INFINITY;
    st.l0 = st.l1 = 0.f;
}

// Folds the warp's chunk maxima into the running maxima of rows g and g + 8 (the four threads of
// a quad hold one row between them) and returns the factors the old l and O are scaled by.
template <int D>
__device__ __forceinline__ float2 raise_max(RowState<D> &st, float tmax0, float tmax1) {
    tmax0 = fmaxf(tmax0, __shfl_xor_sync(0xffffffff, tmax0, 1));
    tmax0 = fmaxf(tmax0, __shfl_xor_sync(0xffffffff, tmax0, 2));
    tmax1 = fmaxf(tmax1, __shfl_xor_sync(0xffffffff, tmax1, 1));
    tmax1 = fmaxf(tmax1, __shfl_xor_sync(0xffffffff, tmax1, 2));
    const float new_m0 = fmaxf(st.m0, tmax0);
    const float new_m1 = fmaxf(st.m1, tmax1);
    const float2 alpha = make_float2(exp2f(st.m0 - new_m0), exp2f(st.m1 - new_m1));
    st.m0 = new_m0;
    st.m1 = new_m1;
    return alpha;
}

// O of rows g and g + 8 times their factors.
template <int D>
__device__ __forceinline__ void scale_o(RowState<D> &st, float2 alpha) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
        st.acc_o[i][0] *= alpha.x;
        st.acc_o[i][1] *= alpha.x;
        st.acc_o[i][2] *= alpha.y;
        st.acc_o[i][3] *= alpha.y;
    }
}

// How far (log2 units) a score may pass the running maximum before a LAZY attend_chunk rescales
// O and l: P <= 2^8 = 256, far inside f16's and bf16's range.
constexpr float RESCALE_SLACK = 8.f;

// One warp, R groups of 16 query rows (R = 1, or 2 for lever 135's paired tiles), one chunk of
// KEYS keys staged in shared memory (rows of C::ROW elements starting at kt / vt): S = Q K^T,
// online-softmax update, O += P V, for each group. Each K / V fragment loaded by ldmatrix feeds
// the MMAs of all R groups. `valid` (1..KEYS) keys of the chunk are real; n-tiles and k-steps
// wholly past them are skipped (warp-uniform branches), keys past them inside a live n-tile are
// masked. Shared rows up to the next multiple of 16 past the last valid key must hold finite
// values (zeros): P is exactly 0 there.
//
// FULL (valid == KEYS, every chunk of a sequence but its last): no branch and no mask, and Q K^T
// runs k-step-outer over the n-tiles, so the chunk's MMAs form NT_S · R independent accumulator
// chains and its ldmatrix loads can issue ahead of them. The guarded form (lever 35's
// before) is a single chain: every n-tile's ldmatrix -> 4 dependent MMAs sits behind a branch,
// which keeps ptxas from interleaving n-tiles, so each MMA waits out its predecessor's latency.
// Same products and sums in the same order per element: the results are bit-identical, and
// for any R each group's results are those of R = 1.
//
// QS (lever 136): Q's A fragments are not held in st[r].qa but read by ldmatrix from Q rows
// staged in shared memory (group r's 16 rows at qs + r * q_group elements, rows of C::ROW), two
// k-steps at a time, which frees the registers of Q.
template <typename T, int D, int KEYS, bool FULL, bool LAZY, int R, bool QS = false>
__device__ __forceinline__ void attend_chunk_rows(RowState<D> *st, const T *kt, const T *vt, int valid,
                                                  float scale_log2, int lane, const T *qs = nullptr,
                                                  int q_group = 0) {
    using C = TileCfg<D>;
    constexpr int KSTEPS = D / 16;     // k-steps of Q K^T over the head dim
    constexpr int NT_S = KEYS / 8;     // n-tiles of S per chunk
    constexpr int NT_O = D / 8;        // n-tiles of O over the head dim
    constexpr int PSTEPS = KEYS / 16;  // k-steps of P V over the keys of a chunk
    const int t = lane % 4;

    // S = Q K^T for 16 rows x KEYS keys per group; K's B operands by ldmatrix, two k-steps per load.
    float s[R][NT_S][4];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) s[r][nt][0] = s[r][nt][1] = s[r][nt][2] = s[r][nt][3] = 0.f;
    if constexpr (QS) {
        // Q's fragments of k-steps kk and kk + 1 per group, then as below (same products, same
        // order per element).
        const T *qrow = qs + (lane & 15) * C::ROW + (lane >> 4) * 8;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk += 2) {
            uint32_t qa[R][2][4];
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    ldmatrix_x4(qa[r][j][0], qa[r][j][1], qa[r][j][2], qa[r][j][3], qrow + r * q_group + (kk + j) * 16);
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt) {
                if (!FULL && nt * 8 >= valid) continue;
                uint32_t b0, b1, b2, b3;
                ldmatrix_x4(b0, b1, b2, b3, kt + (nt * 8 + (lane & 7)) * C::ROW + (lane >> 3) * 8 + kk * 16);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    mma_16816<T>(s[r][nt], qa[r][0], b0, b1);
                    mma_16816<T>(s[r][nt], qa[r][1], b2, b3);
                }
            }
        }
    } else if (FULL) {
        const T *krow = kt + (lane & 7) * C::ROW + (lane >> 3) * 8;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk += 2) {
            uint32_t b[NT_S][4];
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt) ldmatrix_x4(b[nt][0], b[nt][1], b[nt][2], b[nt][3], krow + nt * 8 * C::ROW + kk * 16);
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int nt = 0; nt < NT_S; ++nt) mma_16816<T>(s[r][nt], st[r].qa[kk], b[nt][0], b[nt][1]);
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int nt = 0; nt < NT_S; ++nt) mma_16816<T>(s[r][nt], st[r].qa[kk + 1], b[nt][2], b[nt][3]);
        }
    } else {
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) {
            if (nt * 8 >= valid) continue;
            const T *krow = kt + (nt * 8 + (lane & 7)) * C::ROW + (lane >> 3) * 8;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; kk += 2) {
                uint32_t b0, b1, b2, b3;
                ldmatrix_x4(b0, b1, b2, b3, krow + kk * 16);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    mma_16816<T>(s[r][nt], st[r].qa[kk], b0, b1);
                    mma_16816<T>(s[r][nt], st[r].qa[kk + 1], b2, b3);
                }
            }
        }
    }

    uint32_t pa[R][PSTEPS][4];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        // Scale into log2 units; mask keys past the end only in a partial chunk.
        float tmax0 = -INFINITY, tmax1 = -INFINITY;
        const bool partial = !FULL && valid < KEYS;
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = nt * 8 + t * 2 + (e & 1);
                s[r][nt][e] = (!partial || key < valid) ? s[r][nt][e] * scale_log2 : -INFINITY;
            }
            tmax0 = fmaxf(tmax0, fmaxf(s[r][nt][0], s[r][nt][1]));
            tmax1 = fmaxf(tmax1, fmaxf(s[r][nt][2], s[r][nt][3]));
        }
        float sum0 = 0.f, sum1 = 0.f;
        if constexpr (LAZY) {
            // Lazy rescaling (lever 38; LAZY is the 80-register resident kernel only): the running
            // maxima m0 / m1 only move when some score of the warp exceeds its row's maximum by more
            // than RESCALE_SLACK (log2 units), as FlashAttention-3 does, so P = exp2(s - m) stays at
            // most 2^RESCALE_SLACK (finite in f16 and bf16) and O, l stay consistent with the m they
            // were scaled by: softmax = O / l is unchanged, and the key parts' merge weighs each
            // part's state by its own m. Most chunks after a sequence's first then skip the quad
            // shuffles, the two exp2 of alpha and the rescaling of O, which sit on the dependent
            // chain between the two MMA groups. A thread's own column maximum exceeds m + slack iff
            // its row's maximum does for some thread of the quad, so the vote needs no shuffle; the
            // first chunk always rescales (m = -inf). Lever 37 measured it in every form: it pays
            // where registers are short (the 80-register form: 1.03-1.06x) and costs ~2 % in the
            // 96-register one, which keeps the eager form below (the results of before, bit for bit).
            if (__any_sync(0xffffffff, tmax0 > st[r].m0 + RESCALE_SLACK || tmax1 > st[r].m1 + RESCALE_SLACK)) {
                const float2 alpha = raise_max(st[r], tmax0, tmax1);
                st[r].l0 *= alpha.x;
                st[r].l1 *= alpha.y;
                scale_o(st[r], alpha);
            }
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt) {
                const bool live = FULL || nt * 8 < valid;
                const float p0 = live ? exp2f(s[r][nt][0] - st[r].m0) : 0.f;
                const float p1 = live ? exp2f(s[r][nt][1] - st[r].m0) : 0.f;
                const float p2 = live ? exp2f(s[r][nt][2] - st[r].m1) : 0.f;
                const float p3 = live ? exp2f(s[r][nt][3] - st[r].m1) : 0.f;
                sum0 += p0 + p1;
                sum1 += p2 + p3;
                pa[r][nt / 2][(nt % 2) * 2 + 0] = Pack2<T>::from_floats(p0, p1);
                pa[r][nt / 2][(nt % 2) * 2 + 1] = Pack2<T>::from_floats(p2, p3);
            }
            st[r].l0 += sum0;
            st[r].l1 += sum1;
        } else {
            // Every chunk holds at least one valid key, so the new maxima are finite.
            const float2 alpha = raise_max(st[r], tmax0, tmax1);
            const float new_m0 = st[r].m0, new_m1 = st[r].m1;

#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt) {
                const bool live = FULL || nt * 8 < valid;  // masked n-tiles contribute exact zeros without exp2
                const float p0 = live ? exp2f(s[r][nt][0] - new_m0) : 0.f;
                const float p1 = live ? exp2f(s[r][nt][1] - new_m0) : 0.f;
                const float p2 = live ? exp2f(s[r][nt][2] - new_m1) : 0.f;
                const float p3 = live ? exp2f(s[r][nt][3] - new_m1) : 0.f;
                sum0 += p0 + p1;
                sum1 += p2 + p3;
                // The accumulator layout of S is the A-operand layout of P: no shuffles needed.
                pa[r][nt / 2][(nt % 2) * 2 + 0] = Pack2<T>::from_floats(p0, p1);
                pa[r][nt / 2][(nt % 2) * 2 + 1] = Pack2<T>::from_floats(p2, p3);
            }
            st[r].l0 = st[r].l0 * alpha.x + sum0;
            st[r].l1 = st[r].l1 * alpha.y + sum1;
            scale_o(st[r], alpha);
        }
    }

    // O += P V; V's B operands come transposed out of its row-major rows by ldmatrix.
#pragma unroll
    for (int ps = 0; ps < PSTEPS; ++ps) {
        if (!FULL && ps * 16 >= valid) continue;
        const T *vrow = vt + (ps * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * C::ROW + (lane >> 4) * 8;
#pragma unroll
        for (int dt = 0; dt < NT_O; dt += 2) {
            uint32_t b0, b1, b2, b3;
            ldmatrix_x4_trans(b0, b1, b2, b3, vrow + dt * 8);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                mma_16816<T>(st[r].acc_o[dt], pa[r][ps], b0, b1);
                mma_16816<T>(st[r].acc_o[dt + 1], pa[r][ps], b2, b3);
            }
        }
    }
}

// attend_chunk_rows for one group of 16 rows.
template <typename T, int D, int KEYS, bool FULL, bool LAZY>
__device__ __forceinline__ void attend_chunk(RowState<D> &st, const T *kt, const T *vt, int valid, float scale_log2,
                                             int lane) {
    attend_chunk_rows<T, D, KEYS, FULL, LAZY, 1>(&st, kt, vt, valid, scale_log2, lane);
}

// Keys [key0, key_end) of the staged rows kt / vt (key 0 at row 0) in steps of KEYS, for R groups
// of 16 rows: the full steps branch-free, the last partial one guarded.
template <typename T, int D, int KEYS, bool LAZY, int R, bool QS = false>
__device__ __forceinline__ void attend_keys_rows(RowState<D> *st, const T *kt, const T *vt, int key0, int key_end,
                                                 float scale_log2, int lane, const T *qs = nullptr, int q_group = 0) {
    using C = TileCfg<D>;
    for (; key0 + KEYS <= key_end; key0 += KEYS)
        attend_chunk_rows<T, D, KEYS, true, LAZY, R, QS>(st, kt + key0 * C::ROW, vt + key0 * C::ROW, KEYS, scale_log2,
                                                         lane, qs, q_group);
    if (key0 < key_end)
        attend_chunk_rows<T, D, KEYS, false, LAZY, R, QS>(st, kt + key0 * C::ROW, vt + key0 * C::ROW, key_end - key0,
                                                          scale_log2, lane, qs, q_group);
}

// attend_keys_rows for one group of 16 rows.
template <typename T, int D, int KEYS, bool LAZY>
__device__ __forceinline__ void attend_keys(RowState<D> &st, const T *kt, const T *vt, int key0, int key_end,
                                            float scale_log2, int lane) {
    attend_keys_rows<T, D, KEYS, LAZY, 1>(&st, kt, vt, key0, key_end, scale_log2, lane);
}

// Normalises the 16 rows row_base.. and writes those inside the sequence to o (contiguous).
template <typename T, int D>
__device__ __forceinline__ void end_rows(RowState<D> &st, T *oh, long long o_tok, int row_base, int len, int lane) {
    const int g = lane / 4, t = lane % 4;
    float l0 = st.l0, l1 = st.l1;
    l0 += __shfl_xor_sync(0xffffffff, l0, 1);
    l0 += __shfl_xor_sync(0xffffffff, l0, 2);
    l1 += __shfl_xor_sync(0xffffffff, l1, 1);
    l1 += __shfl_xor_sync(0xffffffff, l1, 2);
    const float inv0 = 1.f / l0;
    const float inv1 = 1.f / l1;
    const int row0 = row_base + g, row1 = row0 + 8;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
        const int c = dt * 8 + t * 2;
        if (row0 < len)
            *reinterpret_cast<uint32_t *>(oh + row0 * o_tok + c) = Pack2<T>::from_floats(st.acc_o[dt][0] * inv0, st.acc_o[dt][1] * inv0);
        if (row1 < len)
            *reinterpret_cast<uint32_t *>(oh + row1 * o_tok + c) = Pack2<T>::from_floats(st.acc_o[dt][2] * inv1, st.acc_o[dt][3] * inv1);
    }
}

// A warp's online-softmax state in shared memory, for a merge by other threads: the D / 2
// accumulators and m0, m1, l0, l1 of each lane, STATE = D / 2 + 4 floats, lane-minor
// (`lane_base` is the state's first float plus the lane: no bank conflicts).
template <int D>
__device__ __forceinline__ void save_state(const RowState<D> &st, float *lane_base) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) lane_base[(i * 4 + e) * 32] = st.acc_o[i][e];
    lane_base[(D / 2 + 0) * 32] = st.m0;
    lane_base[(D / 2 + 1) * 32] = st.m1;
    lane_base[(D / 2 + 2) * 32] = st.l0;
    lane_base[(D / 2 + 3) * 32] = st.l1;
}

}  // namespace
