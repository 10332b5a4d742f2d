// One pre-norm ViT block (timm's `Block`) in one persistent launch, for small token counts:
//
//   x1 = x + proj(attention(LN1(x)))          (attention per sequence of a cu_seqlens batch)
//   y  = x1 + fc2(GELU(fc1(LN2(x1))))
//
// Why: at batch 1 a DeiT block is ~8 kernels (LayerNorm, qkv, attention, proj, LayerNorm, fc1,
// GELU, fc2) of 3-9 µs each whose arithmetic is well under a microsecond: each kernel's time is
// its own ramp-up, one dependent chain of loads and its drain. Here the block's five phases run
// in one launch of one block per SM, separated by grid-wide barriers (an atomic counter in L2,
// ~1 µs), the LayerNorms inside the GEMM tiles that read their rows anyway, the GELU in fc1's
// epilogue, and each phase's first weight tile requested before the barrier that precedes it
// (weights never depend on the previous phase).
//
// Phases (every block walks a phase's work units u = blockIdx.x, + gridDim.x, ...):
//   1. LN1 + qkv:   tiles of BM rows × BN outputs of qkv[M, 3C] = LN1(x) W_qkvᵀ + b
//   2. attention:   (sequence, head, 16-query tile) units; K/V of the head staged in shared
//                   memory, the keys split over the 8 warps (online softmax each), merged
//   3. proj:        x_out = x + attn W_projᵀ + b
//   4. LN2 + fc1:   hidden = GELU(LN2(x_out) W_fc1ᵀ + b)
//   5. fc2 split-K: partial[p] = hidden[:, pC:(p+1)C] W_fc2[:, pC:(p+1)C]ᵀ (f32), p < 4
//   6. reduce:      x_out = x_out + Σ_p partial[p] + b  (fixed order: deterministic)
// Every GEMM unit has K = C, so an A tile [BM, C] and a W tile [BN, C] are loaded whole (one
// cp.async wave each) and multiplied with mma.sync m16n8k16 (f32 accumulation).
//
// Rounding follows the unfused path: LN1/LN2 outputs, qkv, attention and hidden are rounded to
// the storage type where the unfused path stores them; bias, residual and GELU are applied to the
// f32 sums (as cuBLASLt's epilogue and the CUTLASS fc1 do), the GELU in its x·Φ(x) form.
//
// The host guarantees: C = 64 · heads ∈ {192, 384, 768}; MLP width 4C; head_dim 64;
// max_len <= MAX_LEN; cu_seqlens non-decreasing with cu_seqlens[nseq] <= rows and every length
// at most max_len (empty sequences produce nothing; offsets are clamped to rows and lengths to
// max_len, so a wrong cu_seqlens gives wrong numbers, never an access out of bounds);
// 16-byte aligned operands; the grid co-resident (a cooperative launch); the barrier words
// zero before the first launch (the kernel leaves them zero: the last block to arrive resets
// the count before it releases the others). Rows not covered by a sequence get an undefined
// attention output, as the unfused ragged path leaves them.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "gelu_phi.cuh"

namespace sb {

constexpr int WARPS = 8;
constexpr int THREADS = 32 * WARPS;
constexpr int BM = 32;        // GEMM tile rows
constexpr int BN = 64;        // GEMM tile outputs
constexpr int PAD = 8;        // elements of padding per shared row: conflict-free ldmatrix
constexpr int HD = 64;        // head dim
constexpr int HLD = HD + PAD; // shared row length of K, V, Q
constexpr int QT = 16;        // queries per attention unit
constexpr int KC = 16;        // keys per chunk
constexpr int MAX_LEN = 256;  // longest sequence (the K/V staging size)
constexpr int FC2_SPLIT = 4;  // fc2's K = 4C in four parts of C
constexpr int OLD = HD + 4;   // f32 row length of the merge buffer

__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1, __half) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1, __nv_bfloat16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Grid-wide barrier over two words: [0] arrivals, [1] generation. Thread 0 of each block reads
// the generation, arrives; the last arrival resets the count and bumps the generation, the
// others wait for the bump. Acquire/release at GPU scope order every block's writes before the
// barrier ahead of every block's reads after it (the __syncthreads on either side extend that
// to the whole block).
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void grid_sync(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned gen = ld_acquire(bar + 1);
        __threadfence();
        unsigned arrived;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n"
                     : "=r"(arrived)
                     : "l"(bar)
                     : "memory");
        if (arrived == gridDim.x - 1) {
            asm volatile("st.relaxed.gpu.global.u32 [%0], 0;\n" ::"l"(bar) : "memory");
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(bar + 1) : "memory");
        } else {
            while (ld_acquire(bar + 1) == gen) __nanosleep(20);
        }
        __threadfence();
    }
    __syncthreads();
}

struct Params {
    const void* x;       // [rows, C] block input
    void* out;           // [rows, C] block output
    const void* ln1_w;   // [C]
    const void* ln1_b;   // [C]
    const void* qkv_w;   // [3C, C]
    const void* qkv_b;   // [3C]
    const void* proj_w;  // [C, C]
    const void* proj_b;  // [C]
    const void* ln2_w;   // [C]
    const void* ln2_b;   // [C]
    const void* fc1_w;   // [4C, C]
    const void* fc1_b;   // [4C]
    const void* fc2_w;   // [C, 4C]
    const void* fc2_b;   // [C]
    const unsigned* cu_seqlens;  // [nseq + 1]
    void* qkv;           // scratch [rows, 3C]
    void* attn;          // scratch [rows, C]
    void* hidden;        // scratch [rows, 4C]
    float* partial;      // scratch [FC2_SPLIT, rows, C]
    unsigned* barrier;   // 2 words, zero between launches
    unsigned rows;
    unsigned nseq;
    unsigned max_len;    // bound on every sequence's length (<= MAX_LEN)
    float eps1;
    float eps2;
    float scale_log2;    // softmax scale · log2(e)
};

// ---------------------------------------------------------------------------------------------
// GEMM tiles. Shared layout: W tile [BN][C + PAD] first, then the A tile [BM][C + PAD] (the
// attention phase reuses the A region and beyond).

template <typename T, int C>
__device__ __forceinline__ void load_w_tile(T* ws, const T* w, unsigned ldw, unsigned n0) {
    constexpr int CH = C / 8;
    for (int i = threadIdx.x; i < BN * CH; i += THREADS) {
        const int r = i / CH, c = (i % CH) * 8;
        cp_async_16(ws + r * (C + PAD) + c, w + (size_t)(n0 + r) * ldw + c, true);
    }
}

template <typename T, int C>
__device__ __forceinline__ void load_a_tile(T* as, const T* a, unsigned lda, unsigned m0,
                                            unsigned rows) {
    constexpr int CH = C / 8;
    for (int i = threadIdx.x; i < BM * CH; i += THREADS) {
        const int r = i / CH, c = (i % CH) * 8;
        const bool ok = m0 + r < rows;
        cp_async_16(as + r * (C + PAD) + c, ok ? a + (size_t)(m0 + r) * lda + c : a, ok);
    }
}

// LayerNorm of the BM rows in `as`, in place, as fastpath_layer_norm computes it (mean, then the
// centred sum of squares, f32; one rounding of (x - mean) · rstd · w + b).
template <typename T, int C>
__device__ __forceinline__ void layer_norm_tile(T* as, const T* w, const T* b, float eps) {
    constexpr int PER = C / 32;  // elements per lane: 6, 12, 24
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < BM; r += WARPS) {
        T* row = as + r * (C + PAD);
        float v[PER];
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < PER / 2; ++j) {
            const int c = 2 * (lane + 32 * j);
            v[2 * j] = to_f32(row[c]);
            v[2 * j + 1] = to_f32(row[c + 1]);
            sum += v[2 * j] + v[2 * j + 1];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        const float mean = sum / (float)C;
        float sq = 0.f;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const float d = v[j] - mean;
            sq += d * d;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
        const float rstd = 1.0f / sqrtf(sq / (float)C + eps);
#pragma unroll
        for (int j = 0; j < PER / 2; ++j) {
            const int c = 2 * (lane + 32 * j);
            const float y0 = (v[2 * j] - mean) * rstd * to_f32(w[c]) + to_f32(b[c]);
            const float y1 = (v[2 * j + 1] - mean) * rstd * to_f32(w[c + 1]) + to_f32(b[c + 1]);
            *reinterpret_cast<uint32_t*>(row + c) = pack2<T>(y0, y1);
        }
    }
}

// acc[nt][0..3] of warp (wm, wn): rows wm·16 + g (+8 for [2], [3]), outputs wn·16 + nt·8 + 2t
// (+1). K walked in two interleaved halves (two accumulator sets) to halve the mma chain.
template <typename T, int C>
__device__ __forceinline__ void tile_mma(const T* as, const T* ws, float (&acc)[2][4]) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp / 4, wn = warp % 4;
    float acc2[2][4] = {};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[nt][j] = 0.f;
    const T* arow = as + (wm * 16 + lane % 16) * (C + PAD) + (lane / 16) * 8;
    const T* wrow = ws + (wn * 16 + (lane / 16) * 8 + lane % 8) * (C + PAD) + ((lane / 8) % 2) * 8;
#pragma unroll 4
    for (int kk = 0; kk < C; kk += 32) {
        uint32_t a0[4], b0[4], a1[4], b1[4];
        ldmatrix_x4(a0, arow + kk);
        ldmatrix_x4(b0, wrow + kk);
        ldmatrix_x4(a1, arow + kk + 16);
        ldmatrix_x4(b1, wrow + kk + 16);
        mma(acc[0], a0, b0[0], b0[1], T());
        mma(acc[1], a0, b0[2], b0[3], T());
        mma(acc2[0], a1, b1[0], b1[1], T());
        mma(acc2[1], a1, b1[2], b1[3], T());
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[nt][j] += acc2[nt][j];
}

enum Epi { EPI_QKV, EPI_PROJ, EPI_FC1, EPI_FC2 };

// One phase of GEMM units. `a`/`lda`: the A operand; `w`/`ldw`, N: the weight rows; for FC2 the
// unit index also picks the K part. `w_ready`: this block's first unit's W tile was requested
// before the barrier (see prefetch_w).
template <typename T, int C, Epi E>
__device__ void gemm_phase(const Params& p, unsigned char* smem, const T* a, unsigned lda,
                           const T* w, unsigned ldw, unsigned N, const T* bias, const T* ln_w,
                           const T* ln_b, float eps, T* out, bool w_ready) {
    T* ws = reinterpret_cast<T*>(smem);
    T* as = ws + BN * (C + PAD);
    const unsigned mt = (p.rows + BM - 1) / BM, nt = N / BN;
    const unsigned parts = E == EPI_FC2 ? FC2_SPLIT : 1;
    const unsigned units = mt * nt * parts;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp / 4, wn = warp % 4, g = lane / 4, t = lane % 4;
    bool first = true;
    for (unsigned u = blockIdx.x; u < units; u += gridDim.x) {
        const unsigned part = u / (mt * nt), rem = u % (mt * nt);
        const unsigned n0 = (rem % nt) * BN, m0 = (rem / nt) * BM;
        const unsigned k0 = part * C;
        __syncthreads();  // the previous unit is done with both tiles
        if (!(first && w_ready)) load_w_tile<T, C>(ws, w + k0, ldw, n0);
        load_a_tile<T, C>(as, a + k0, lda, m0, p.rows);
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
        first = false;
        if (E == EPI_QKV || E == EPI_FC1) {
            layer_norm_tile<T, C>(as, ln_w, ln_b, eps);
            __syncthreads();
        }
        float acc[2][4];
        tile_mma<T, C>(as, ws, acc);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const unsigned col = n0 + wn * 16 + j * 8 + 2 * t;
            float b0 = 0.f, b1 = 0.f;
            if (E != EPI_FC2) {
                b0 = to_f32(bias[col]);
                b1 = to_f32(bias[col + 1]);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned row = m0 + wm * 16 + g + 8 * h;
                if (row >= p.rows) continue;
                float v0 = acc[j][2 * h] + b0, v1 = acc[j][2 * h + 1] + b1;
                if (E == EPI_FC2) {
                    float2* dst = reinterpret_cast<float2*>(
                        p.partial + ((size_t)part * p.rows + row) * C + col);
                    *dst = make_float2(v0, v1);
                    continue;
                }
                if (E == EPI_PROJ) {
                    const T* r = reinterpret_cast<const T*>(p.x) + (size_t)row * C + col;
                    v0 += to_f32(r[0]);
                    v1 += to_f32(r[1]);
                }
                if (E == EPI_FC1) {
                    v0 = gelu_phi(v0);
                    v1 = gelu_phi(v1);
                }
                *reinterpret_cast<uint32_t*>(out + (size_t)row * N + col) = pack2<T>(v0, v1);
            }
        }
    }
}

// Requests the W tile of this block's first unit of the next GEMM phase (called before the
// barrier into that phase; the phase then skips that load). Returns whether it did.
template <typename T, int C>
__device__ __forceinline__ bool prefetch_w(unsigned char* smem, const T* w, unsigned ldw,
                                           unsigned N, unsigned rows) {
    const unsigned units = ((rows + BM - 1) / BM) * (N / BN);
    if (blockIdx.x >= units) return false;
    __syncthreads();  // nobody still reads the W region
    load_w_tile<T, C>(reinterpret_cast<T*>(smem), w, ldw, (blockIdx.x % (N / BN)) * BN);
    cp_async_commit();
    return true;
}

// ---------------------------------------------------------------------------------------------
// Attention: unit = (sequence, head, query tile of QT). The head's K and V rows of the sequence
// are staged in shared memory (rows past the length zero-filled up to a whole chunk), warp w
// takes key chunks w, w + 8, ... with an online softmax in registers, and the eight partial
// results are merged through shared memory (which then reuses the K/V space).
template <typename T, int C>
__device__ void attention_phase(const Params& p, unsigned char* smem_base) {
    constexpr int H = C / HD;
    // Past the W region, so a W tile requested before this phase would survive it.
    unsigned char* smem = smem_base + sizeof(T) * BN * (C + PAD);
    T* ks = reinterpret_cast<T*>(smem);
    T* vs = ks + MAX_LEN * HLD;
    T* qs = vs + MAX_LEN * HLD;
    float* om = reinterpret_cast<float*>(smem);   // [WARPS][QT][OLD], after the key loops
    float* mm = om + WARPS * QT * OLD;             // [WARPS][QT]
    float* ll = mm + WARPS * QT;                   // [WARPS][QT]
    const T* qkv = reinterpret_cast<const T*>(p.qkv);
    T* attn = reinterpret_cast<T*>(p.attn);
    const unsigned qtiles = (p.max_len + QT - 1) / QT;
    const unsigned units = p.nseq * qtiles * H;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    for (unsigned u = blockIdx.x; u < units; u += gridDim.x) {
        const unsigned h = u % H, qt = (u / H) % qtiles, s = u / (H * qtiles);
        const unsigned end = min(p.cu_seqlens[s + 1], p.rows);
        const unsigned start = min(p.cu_seqlens[s], end);
        const unsigned len = min(end - start, p.max_len);
        const unsigned q0 = qt * QT;
        if (q0 >= len) continue;  // uniform over the block
        const unsigned chunks = (len + KC - 1) / KC;
        __syncthreads();  // the previous unit's merge is read
        // K and V rows [0, chunks·KC) of head h, Q rows [q0, q0 + QT); 8 16-byte pieces a row.
        for (unsigned i = threadIdx.x; i < chunks * KC * 8 * 2; i += THREADS) {
            const unsigned which = i / (chunks * KC * 8), j = i % (chunks * KC * 8);
            const unsigned r = j / 8, c = (j % 8) * 8;
            const bool ok = r < len;
            const T* src = qkv + (size_t)(start + (ok ? r : 0)) * (3 * C) + (1 + which) * C + h * HD + c;
            cp_async_16((which ? vs : ks) + r * HLD + c, src, ok);
        }
        for (unsigned i = threadIdx.x; i < QT * 8; i += THREADS) {
            const unsigned r = i / 8, c = (i % 8) * 8;
            const bool ok = q0 + r < len;
            const T* src = qkv + (size_t)(start + (ok ? q0 + r : 0)) * (3 * C) + h * HD + c;
            cp_async_16(qs + r * HLD + c, src, ok);
        }
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();

        uint32_t qf[4][4];
#pragma unroll
        for (int kd = 0; kd < 4; ++kd)
            ldmatrix_x4(qf[kd], qs + (lane % 16) * HLD + kd * 16 + (lane / 16) * 8);
        float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.f, 0.f};
        float o[8][4] = {};
        for (unsigned c = warp; c < chunks; c += WARPS) {
            const unsigned k0 = c * KC;
            float sc[2][4] = {};
#pragma unroll
            for (int kd = 0; kd < 4; ++kd) {
                uint32_t kb[4];
                ldmatrix_x4(kb, ks + (k0 + (lane / 16) * 8 + lane % 8) * HLD + kd * 16 +
                                    ((lane / 8) % 2) * 8);
                mma(sc[0], qf[kd], kb[0], kb[1], T());
                mma(sc[1], qf[kd], kb[2], kb[3], T());
            }
            float rmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const unsigned key = k0 + nt * 8 + 2 * t + (j & 1);
                    sc[nt][j] = key < len ? sc[nt][j] * p.scale_log2 : -INFINITY;
                    rmax[j / 2] = fmaxf(rmax[j / 2], sc[nt][j]);
                }
            float corr[2], rsum[2] = {0.f, 0.f};
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                rmax[h2] = fmaxf(rmax[h2], __shfl_xor_sync(0xffffffffu, rmax[h2], 1));
                rmax[h2] = fmaxf(rmax[h2], __shfl_xor_sync(0xffffffffu, rmax[h2], 2));
                const float m_new = fmaxf(m_r[h2], rmax[h2]);  // finite: key k0 < len
                corr[h2] = exp2f(m_r[h2] - m_new);
                m_r[h2] = m_new;
            }
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    sc[nt][j] = exp2f(sc[nt][j] - m_r[j / 2]);
                    rsum[j / 2] += sc[nt][j];
                }
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                rsum[h2] += __shfl_xor_sync(0xffffffffu, rsum[h2], 1);
                rsum[h2] += __shfl_xor_sync(0xffffffffu, rsum[h2], 2);
                l_r[h2] = l_r[h2] * corr[h2] + rsum[h2];
            }
#pragma unroll
            for (int dt = 0; dt < 8; ++dt) {
                o[dt][0] *= corr[0];
                o[dt][1] *= corr[0];
                o[dt][2] *= corr[1];
                o[dt][3] *= corr[1];
            }
            uint32_t pa[4];
            pa[0] = pack2<T>(sc[0][0], sc[0][1]);
            pa[1] = pack2<T>(sc[0][2], sc[0][3]);
            pa[2] = pack2<T>(sc[1][0], sc[1][1]);
            pa[3] = pack2<T>(sc[1][2], sc[1][3]);
#pragma unroll
            for (int dt = 0; dt < 4; ++dt) {
                uint32_t vb[4];
                ldmatrix_x4_trans(vb, vs + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * HLD + dt * 16 +
                                          (lane / 16) * 8);
                mma(o[2 * dt], pa, vb[0], vb[1], T());
                mma(o[2 * dt + 1], pa, vb[2], vb[3], T());
            }
        }
        __syncthreads();  // every warp is done with K, V, Q: the merge buffer reuses them
#pragma unroll
        for (int dt = 0; dt < 8; ++dt)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                om[(warp * QT + g + 8 * (j / 2)) * OLD + dt * 8 + 2 * t + (j & 1)] = o[dt][j];
        if (t == 0) {
            mm[warp * QT + g] = m_r[0];
            mm[warp * QT + g + 8] = m_r[1];
            ll[warp * QT + g] = l_r[0];
            ll[warp * QT + g + 8] = l_r[1];
        }
        __syncthreads();
        for (unsigned i = threadIdx.x; i < QT * HD; i += THREADS) {
            const unsigned r = i / HD, d = i % HD;
            if (q0 + r >= len) continue;
            float mt = -INFINITY;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) mt = fmaxf(mt, mm[w * QT + r]);
            float num = 0.f, den = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float f = exp2f(mm[w * QT + r] - mt);  // 0 for warps without keys
                num += f * om[(w * QT + r) * OLD + d];
                den += f * ll[w * QT + r];
            }
            attn[(size_t)(start + q0 + r) * C + h * HD + d] = from_f32<T>(num / den);
        }
    }
}

// x_out = x_out + Σ_p partial[p] + b, two elements a thread.
template <typename T, int C>
__device__ void reduce_phase(const Params& p) {
    T* out = reinterpret_cast<T*>(p.out);
    const T* b = reinterpret_cast<const T*>(p.fc2_b);
    const size_t n2 = (size_t)p.rows * C / 2;
    const size_t plane = (size_t)p.rows * C;
    for (size_t i = (size_t)blockIdx.x * THREADS + threadIdx.x; i < n2;
         i += (size_t)gridDim.x * THREADS) {
        const size_t e = 2 * i;
        const unsigned col = e % C;
        float v0 = to_f32(b[col]), v1 = to_f32(b[col + 1]);
#pragma unroll
        for (int q = 0; q < FC2_SPLIT; ++q) {
            const float2 s = __ldcg(reinterpret_cast<const float2*>(p.partial + q * plane + e));
            v0 += s.x;
            v1 += s.y;
        }
        // x1 was written by other blocks in this launch: read it from L2.
        const unsigned x1 = __ldcg(reinterpret_cast<const unsigned*>(out + e));
        v0 += to_f32(reinterpret_cast<const T*>(&x1)[0]);
        v1 += to_f32(reinterpret_cast<const T*>(&x1)[1]);
        *reinterpret_cast<uint32_t*>(out + e) = pack2<T>(v0, v1);
    }
}

template <typename T, int C>
__device__ void block_forward(const Params& p) {
    extern __shared__ __align__(16) unsigned char smem[];
    const T* x = reinterpret_cast<const T*>(p.x);
    T* out = reinterpret_cast<T*>(p.out);
    T* qkv = reinterpret_cast<T*>(p.qkv);
    T* attn = reinterpret_cast<T*>(p.attn);
    T* hidden = reinterpret_cast<T*>(p.hidden);
    const T* qkv_w = reinterpret_cast<const T*>(p.qkv_w);
    const T* proj_w = reinterpret_cast<const T*>(p.proj_w);
    const T* fc1_w = reinterpret_cast<const T*>(p.fc1_w);
    const T* fc2_w = reinterpret_cast<const T*>(p.fc2_w);

    gemm_phase<T, C, EPI_QKV>(p, smem, x, C, qkv_w, C, 3 * C, reinterpret_cast<const T*>(p.qkv_b),
                              reinterpret_cast<const T*>(p.ln1_w),
                              reinterpret_cast<const T*>(p.ln1_b), p.eps1, qkv, false);
    grid_sync(p.barrier);
    attention_phase<T, C>(p, smem);
    bool ready = prefetch_w<T, C>(smem, proj_w, C, C, p.rows);
    grid_sync(p.barrier);
    gemm_phase<T, C, EPI_PROJ>(p, smem, attn, C, proj_w, C, C, reinterpret_cast<const T*>(p.proj_b),
                               nullptr, nullptr, 0.f, out, ready);
    ready = prefetch_w<T, C>(smem, fc1_w, C, 4 * C, p.rows);
    grid_sync(p.barrier);
    gemm_phase<T, C, EPI_FC1>(p, smem, out, C, fc1_w, C, 4 * C, reinterpret_cast<const T*>(p.fc1_b),
                              reinterpret_cast<const T*>(p.ln2_w),
                              reinterpret_cast<const T*>(p.ln2_b), p.eps2, hidden, ready);
    ready = prefetch_w<T, C>(smem, fc2_w, 4 * C, C, p.rows);
    grid_sync(p.barrier);
    gemm_phase<T, C, EPI_FC2>(p, smem, hidden, 4 * C, fc2_w, 4 * C, C, nullptr, nullptr, nullptr,
                              0.f, nullptr, ready);
    grid_sync(p.barrier);
    reduce_phase<T, C>(p);
}

}  // namespace sb

#define SMALL_BLOCK_ENTRY(SUFFIX, T, C)                                                            \
    extern "C" __global__ void __launch_bounds__(sb::THREADS, 1)                                  \
        fastpath_small_block_##SUFFIX##_c##C(const sb::Params p) {                                \
        sb::block_forward<T, C>(p);                                                                \
    }
SMALL_BLOCK_ENTRY(f16, __half, 192)
SMALL_BLOCK_ENTRY(f16, __half, 384)
SMALL_BLOCK_ENTRY(f16, __half, 768)
SMALL_BLOCK_ENTRY(bf16, __nv_bfloat16, 192)
SMALL_BLOCK_ENTRY(bf16, __nv_bfloat16, 384)
SMALL_BLOCK_ENTRY(bf16, __nv_bfloat16, 768)
