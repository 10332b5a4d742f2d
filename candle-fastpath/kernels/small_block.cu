// One pre-norm ViT block (timm's `Block`) in one persistent launch, for small token counts:
//
//   x1 = x + proj(attention(LN1(x)))          (attention per sequence of a cu_seqlens batch)
//   y  = x1 + fc2(GELU(fc1(LN2(x1))))
//
// Why: at batch 1 a DeiT block is ~8 kernels (LayerNorm, qkv, attention, proj, LayerNorm, fc1,
// GELU, fc2) whose arithmetic is well under a microsecond; launched one by one through candle,
// each costs ~10 µs of host time. Here the block's phases run in one cooperative launch of 1-2
// blocks per SM, separated by grid-wide barriers (an arrival counter in L2, ~2 µs each), the
// LayerNorms inside the GEMM tiles that read their rows anyway, the GELU in fc1's epilogue,
// and each phase's first weight tile requested before the barrier that precedes it (weights
// never depend on the previous phase). Measured (docs/LEVERS.md, lever 40): ~50 µs per
// DeiT-S block under ncu, longer than the separate kernels in a CUDA graph (each phase is one
// SM's serial chain of loads, reductions and mma steps), shorter than their eager launches.
//
// Phases (every block walks a phase's work units u = blockIdx.x, + gridDim.x, ...):
//   1. LN1 + qkv:   tiles of BM rows × BN outputs of qkv[M, 3C] = LN1(x) W_qkvᵀ + b
//   2. attention:   (sequence, head, 16-query tile) units; K/V of the head staged in shared
//                   memory, the keys split over the 8 warps (online softmax each), merged
//   3. proj:        x_out = x + attn W_projᵀ + b
//   4. LN2 + fc1:   hidden = GELU(LN2(x_out) W_fc1ᵀ + b)
//   5. fc2:         x_out = x_out + hidden W_fc2ᵀ + b: for C <= 384 16 × 32 tiles with the whole
//                   K = 4C loaded at once and split over the 8 warps; wider, K streamed in chunks
// The K = C units load their A tile [BM, C] and W tile [BN, C] whole (one cp.async wave) and
// multiply with mma.sync m16n8k16 (f32 accumulation); bias, residual and LayerNorm parameters
// are requested before the tile arrives.
//
// Rounding follows the unfused path: LN1/LN2 outputs, qkv, attention and hidden are rounded to
// the storage type where the unfused path stores them; bias, residual and GELU are applied to the
// f32 sums (as cuBLASLt's epilogue and the CUTLASS fc1 do), the GELU in its x·Φ(x) form.
//
// The host guarantees: C = 64 · heads ∈ {192, 384, 768}; MLP width 4C; head_dim 64;
// max_len <= 256 (SMALL_BLOCK_MAX_LEN, which sizes the shared memory); cu_seqlens
// non-decreasing with cu_seqlens[nseq] <= rows and every length at most max_len (empty
// sequences produce nothing; offsets are clamped to rows and lengths to max_len, so a wrong
// cu_seqlens gives wrong numbers, never an access out of bounds);
// 16-byte aligned operands; the grid co-resident (a cooperative launch); the barrier words
// zero before the first launch (the kernel leaves them zero: the last block to arrive resets
// the count before it releases the others). Rows not covered by a sequence get an undefined
// attention output, as the unfused ragged path leaves them.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

// candle-ragged's kernel folder (its build metadata puts it on the include path): Pack2,
// smem_addr, cp_async_commit.
#include "attention_common.cuh"
#include "epilogue.cuh"
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
constexpr int OLD = HD + 4;   // f32 row length of the merge buffer

// Two floats as one 16-bit pair (attention_common.cuh's Pack2).
template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b) {
    return Pack2<T>::from_floats(a, b);
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
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

// Grid-wide barrier over two words 128 bytes apart (their own L2 lines, so the spinning reads
// of the generation do not contend with the arrivals): bar[0] arrivals, bar[32] generation.
// Thread 0 of each block reads the generation, arrives; the last arrival resets the count and
// bumps the generation, the others spin until they see the bump. Acquire/release at GPU scope
// order every block's writes before the barrier ahead of every block's reads after it (the
// __syncthreads on either side extend that to the whole block).
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void grid_sync(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned* gen_word = bar + 32;
        const unsigned gen = ld_acquire(gen_word);
        unsigned arrived;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n"
                     : "=r"(arrived)
                     : "l"(bar)
                     : "memory");
        if (arrived == gridDim.x - 1) {
            asm volatile("st.relaxed.gpu.global.u32 [%0], 0;\n" ::"l"(bar) : "memory");
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(gen_word) : "memory");
        } else {
            while (ld_acquire(gen_word) == gen) {
            }
        }
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
    unsigned* barrier;   // 33 words (count at [0], generation at [32]); count zero between launches
    unsigned rows;
    unsigned nseq;
    unsigned max_len;    // bound on every sequence's length (<= 256)
    float eps1;
    float eps2;
    float scale_log2;    // softmax scale · log2(e)
    unsigned skip;       // profiling only: phases to leave out (bit i: phase i + 1), else 0
};

// ---------------------------------------------------------------------------------------------
// GEMM units. Every phase lays out shared memory from offset 0 on its own (the host sizes it
// for the largest): K = C phases (qkv, proj, fc1) hold a W tile [BN][C + PAD] and then an A tile
// [BM][C + PAD], loaded whole; fc2 (K = 4C) streams K in chunks of KC2 through a two-stage ring
// of (A [BM][KC2 + PAD], W [BN][KC2 + PAD]).

// Loads `rows_n` rows of `K` elements (row stride `ld`) into a shared tile of row length `LDS`;
// rows at or past `valid` are zero-filled. 8 threads per row, 16 bytes each: no divisions.
template <typename T, int K, int LDS>
__device__ __forceinline__ void load_rows(T* dst, const T* src, unsigned ld, int rows_n,
                                          unsigned first_row, unsigned valid) {
    constexpr int PER_ROW = K / 8;  // 16-byte pieces a row
    const int piece = threadIdx.x % 8;
    for (int r = threadIdx.x / 8; r < rows_n; r += THREADS / 8) {
        const bool ok = first_row + r < valid;
        const T* row = src + (size_t)(ok ? first_row + r : 0) * ld;
#pragma unroll
        for (int c = piece; c < PER_ROW; c += 8)
            cp_async_16(dst + r * LDS + c * 8, row + c * 8, ok);
    }
}

// LayerNorm of the BM rows in `as` (row length C + PAD), in place, as fastpath_layer_norm
// computes it (mean, then the centred sum of squares, f32; one rounding of
// (x - mean) · rstd · w + b). Lane l holds column pairs 2(l + 32j); the weight and bias pairs
// come in registers; each warp normalises two rows at once (their shuffles interleave).
template <typename T, int C>
__device__ __forceinline__ void layer_norm_tile(T* as, const uint32_t (&wv)[C / 64],
                                                const uint32_t (&bv)[C / 64], float eps) {
    constexpr int P = C / 64;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll 1
    for (int r0 = warp; r0 < BM; r0 += 2 * WARPS) {
        T* row[2] = {as + r0 * (C + PAD), as + (r0 + WARPS) * (C + PAD)};
        float v[2][2 * P], sum[2] = {0.f, 0.f}, sq[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < P; ++j) {
                const uint32_t raw = *reinterpret_cast<const uint32_t*>(row[i] + 2 * (lane + 32 * j));
                const T* e = reinterpret_cast<const T*>(&raw);
                v[i][2 * j] = to_f32(e[0]);
                v[i][2 * j + 1] = to_f32(e[1]);
                sum[i] += v[i][2 * j] + v[i][2 * j + 1];
            }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int i = 0; i < 2; ++i) sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], o);
        float mean[2], rstd[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mean[i] = sum[i] / (float)C;
#pragma unroll
            for (int j = 0; j < 2 * P; ++j) {
                const float d = v[i][j] - mean[i];
                sq[i] += d * d;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int i = 0; i < 2; ++i) sq[i] += __shfl_xor_sync(0xffffffffu, sq[i], o);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            rstd[i] = 1.0f / sqrtf(sq[i] / (float)C + eps);
#pragma unroll
            for (int j = 0; j < P; ++j) {
                const T* we = reinterpret_cast<const T*>(&wv[j]);
                const T* be = reinterpret_cast<const T*>(&bv[j]);
                const float y0 = (v[i][2 * j] - mean[i]) * rstd[i] * to_f32(we[0]) + to_f32(be[0]);
                const float y1 =
                    (v[i][2 * j + 1] - mean[i]) * rstd[i] * to_f32(we[1]) + to_f32(be[1]);
                *reinterpret_cast<uint32_t*>(row[i] + 2 * (lane + 32 * j)) = pack2<T>(y0, y1);
            }
        }
    }
}

// acc[nt][0..3] += the warp's (wm, wn) part of A · Wᵀ over K: rows wm·16 + g (+8 for [2], [3]),
// outputs wn·16 + nt·8 + 2t (+1). K walked in two interleaved halves (two accumulator sets) to
// halve the dependent mma chain.
template <typename T, int LDS, int K>
__device__ __forceinline__ void tile_mma(const T* as, const T* ws, float (&acc)[2][4],
                                         float (&acc2)[2][4]) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp / 4, wn = warp % 4;
    const T* arow = as + (wm * 16 + lane % 16) * LDS + (lane / 16) * 8;
    const T* wrow = ws + (wn * 16 + (lane / 16) * 8 + lane % 8) * LDS + ((lane / 8) % 2) * 8;
#pragma unroll 4
    for (int kk = 0; kk < K; kk += 32) {
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
}

enum Epi { EPI_QKV, EPI_PROJ, EPI_FC1, EPI_FC2 };

// Bias pairs and residual pairs of this thread's outputs, requested before the tile arrives.
struct EpiOperands {
    float bias[2][2];
    uint32_t res[2][2];  // [nt][h]: the residual pair at (row h, outputs nt)
};

template <typename T, Epi E>
__device__ __forceinline__ EpiOperands epi_operands(const Params& p, const T* bias, unsigned m0,
                                                    unsigned n0, unsigned ldres) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp / 4, wn = warp % 4, g = lane / 4, t = lane % 4;
    EpiOperands o;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const unsigned col = n0 + wn * 16 + j * 8 + 2 * t;
        const uint32_t b = __ldg(reinterpret_cast<const unsigned*>(bias + col));
        o.bias[j][0] = to_f32(reinterpret_cast<const T*>(&b)[0]);
        o.bias[j][1] = to_f32(reinterpret_cast<const T*>(&b)[1]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned row = m0 + wm * 16 + g + 8 * h;
            o.res[j][h] = 0u;
            if (row >= p.rows) continue;
            if (E == EPI_PROJ)  // the block input: never written in this launch
                o.res[j][h] = __ldg(reinterpret_cast<const unsigned*>(
                    reinterpret_cast<const T*>(p.x) + (size_t)row * ldres + col));
            if (E == EPI_FC2)  // x1, written by other blocks in this launch: from L2
                o.res[j][h] = __ldcg(reinterpret_cast<const unsigned*>(
                    reinterpret_cast<const T*>(p.out) + (size_t)row * ldres + col));
        }
    }
    return o;
}

template <typename T, Epi E>
__device__ __forceinline__ void epilogue(const Params& p, float (&acc)[2][4],
                                         const float (&acc2)[2][4], const EpiOperands& o,
                                         unsigned m0, unsigned n0, T* out, unsigned ldo) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp / 4, wn = warp % 4, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const unsigned col = n0 + wn * 16 + j * 8 + 2 * t;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned row = m0 + wm * 16 + g + 8 * h;
            if (row >= p.rows) continue;
            float v0 = acc[j][2 * h] + acc2[j][2 * h] + o.bias[j][0];
            float v1 = acc[j][2 * h + 1] + acc2[j][2 * h + 1] + o.bias[j][1];
            if (E == EPI_PROJ || E == EPI_FC2) {
                const T* r = reinterpret_cast<const T*>(&o.res[j][h]);
                v0 += to_f32(r[0]);
                v1 += to_f32(r[1]);
            }
            if (E == EPI_FC1) {
                v0 = gelu_phi(v0);
                v1 = gelu_phi(v1);
            }
            *reinterpret_cast<uint32_t*>(out + (size_t)row * ldo + col) = pack2<T>(v0, v1);
        }
    }
}

// A K = C phase: units (row tile, output tile) of `N` outputs. `w_ready`: this block's first
// unit's W tile was requested before the barrier (prefetch_w).
template <typename T, int C, Epi E>
__device__ void gemm_phase(const Params& p, unsigned char* smem, const T* a, const T* w,
                           unsigned N, const T* bias, const T* ln_w, const T* ln_b, float eps,
                           T* out, bool w_ready) {
    T* ws = reinterpret_cast<T*>(smem);
    T* as = ws + BN * (C + PAD);
    const unsigned nt = N / BN;
    const unsigned units = ((p.rows + BM - 1) / BM) * nt;
    constexpr bool LN = E == EPI_QKV || E == EPI_FC1;
    uint32_t wv[C / 64], bv[C / 64];
    if (LN) {
        const int lane = threadIdx.x % 32;
#pragma unroll
        for (int j = 0; j < C / 64; ++j) {
            wv[j] = __ldg(reinterpret_cast<const unsigned*>(ln_w + 2 * (lane + 32 * j)));
            bv[j] = __ldg(reinterpret_cast<const unsigned*>(ln_b + 2 * (lane + 32 * j)));
        }
    }
    bool first = true;
    for (unsigned u = blockIdx.x; u < units; u += gridDim.x) {
        const unsigned n0 = (u % nt) * BN, m0 = (u / nt) * BM;
        __syncthreads();  // the previous unit is done with both tiles
        if (!(first && w_ready)) load_rows<T, C, C + PAD>(ws, w + (size_t)n0 * C, C, BN, 0, BN);
        load_rows<T, C, C + PAD>(as, a, C, BM, m0, p.rows);
        cp_async_commit();
        first = false;
        const EpiOperands o = epi_operands<T, E>(p, bias, m0, n0, C);
        cp_async_wait_all();
        __syncthreads();
        if (LN) {
            layer_norm_tile<T, C>(as, wv, bv, eps);
            __syncthreads();
        }
        float acc[2][4] = {}, acc2[2][4] = {};
        tile_mma<T, C + PAD, C>(as, ws, acc, acc2);
        epilogue<T, E>(p, acc, acc2, o, m0, n0, out, N);
    }
}

// fc2: out = x1 + hidden · W_fc2ᵀ + b, K = 4C in chunks of KC2 through a two-stage ring.
constexpr int KC2 = 192;
constexpr int FC2_STAGE_ELEMS = (BM + BN) * (KC2 + PAD);

template <typename T, int C>
__device__ __forceinline__ void fc2_load(unsigned char* smem, const Params& p, unsigned m0,
                                         unsigned n0, unsigned chunk, bool with_w) {
    T* stage = reinterpret_cast<T*>(smem) + (chunk % 2) * FC2_STAGE_ELEMS;
    const unsigned k0 = chunk * KC2;
    load_rows<T, KC2, KC2 + PAD>(stage, reinterpret_cast<const T*>(p.hidden) + k0, 4 * C, BM, m0,
                                 p.rows);
    if (with_w)
        load_rows<T, KC2, KC2 + PAD>(stage + BM * (KC2 + PAD),
                                     reinterpret_cast<const T*>(p.fc2_w) + (size_t)n0 * 4 * C + k0,
                                     4 * C, BN, 0, BN);
}

template <typename T, int C>
__device__ void fc2_phase(const Params& p, unsigned char* smem, bool w_ready) {
    constexpr unsigned CHUNKS = 4 * C / KC2;
    const unsigned nt = C / BN;
    const unsigned units = ((p.rows + BM - 1) / BM) * nt;
    bool first = true;
    for (unsigned u = blockIdx.x; u < units; u += gridDim.x) {
        const unsigned n0 = (u % nt) * BN, m0 = (u / nt) * BM;
        __syncthreads();  // the previous unit is done with the ring
        fc2_load<T, C>(smem, p, m0, n0, 0, !(first && w_ready));
        cp_async_commit();
        first = false;
        const EpiOperands o =
            epi_operands<T, EPI_FC2>(p, reinterpret_cast<const T*>(p.fc2_b), m0, n0, C);
        float acc[2][4] = {}, acc2[2][4] = {};
#pragma unroll 1
        for (unsigned k = 0; k < CHUNKS; ++k) {
            if (k + 1 < CHUNKS) {
                fc2_load<T, C>(smem, p, m0, n0, k + 1, true);
                cp_async_commit();
                asm volatile("cp.async.wait_group 1;\n" ::);
            } else {
                cp_async_wait_all();
            }
            __syncthreads();
            const T* stage = reinterpret_cast<const T*>(smem) + (k % 2) * FC2_STAGE_ELEMS;
            tile_mma<T, KC2 + PAD, KC2>(stage, stage + BM * (KC2 + PAD), acc, acc2);
            __syncthreads();  // chunk k + 2 overwrites this stage
        }
        epilogue<T, EPI_FC2>(p, acc, acc2, o, m0, n0, reinterpret_cast<T*>(p.out), C);
    }
}

// fc2 for C <= 384, split over the block's warps: a unit is a [BM2 = 16] × [BN2 = 32] output
// tile with its whole K = 4C loaded in one cp.async wave (A [16][4C + PAD], W [32][4C + PAD]:
// 74 KB at C = 192, 148 KB at 384); warp w multiplies K slice [w·K/8, (w+1)·K/8) and the eight
// partial tiles are summed through shared memory (fixed order) before the epilogue. One load
// latency a unit instead of one per K chunk.
constexpr int BM2 = 16;
constexpr int BN2 = 32;

template <typename T, int C>
__device__ __forceinline__ void fc2_split_load_w(unsigned char* smem, const Params& p, unsigned n0) {
    T* ws = reinterpret_cast<T*>(smem) + BM2 * (4 * C + PAD);
    load_rows<T, 4 * C, 4 * C + PAD>(ws, reinterpret_cast<const T*>(p.fc2_w) + (size_t)n0 * 4 * C,
                                     4 * C, BN2, 0, BN2);
}

template <typename T, int C>
__device__ void fc2_split_phase(const Params& p, unsigned char* smem, bool w_ready) {
    constexpr int K = 4 * C, LDS = K + PAD, KS = K / WARPS;
    T* as = reinterpret_cast<T*>(smem);
    T* ws = as + BM2 * LDS;
    float* red = reinterpret_cast<float*>(smem);  // [WARPS][BM2][BN2], after the mma
    const unsigned nt = C / BN2;
    const unsigned units = ((p.rows + BM2 - 1) / BM2) * nt;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const T* bias = reinterpret_cast<const T*>(p.fc2_b);
    T* out = reinterpret_cast<T*>(p.out);
    bool first = true;
    for (unsigned u = blockIdx.x; u < units; u += gridDim.x) {
        const unsigned n0 = (u % nt) * BN2, m0 = (u / nt) * BM2;
        __syncthreads();  // the previous unit's reduction is read
        if (!(first && w_ready)) fc2_split_load_w<T, C>(smem, p, n0);
        load_rows<T, K, LDS>(as, reinterpret_cast<const T*>(p.hidden), K, BM2, m0, p.rows);
        cp_async_commit();
        first = false;
        // Two outputs a thread: (row i / 16, cols 2 (i % 16)), its bias and residual pairs.
        const unsigned orow = threadIdx.x / (BN2 / 2), ocol = 2 * (threadIdx.x % (BN2 / 2));
        const uint32_t bpair = __ldg(reinterpret_cast<const unsigned*>(bias + n0 + ocol));
        uint32_t rpair = 0u;
        if (m0 + orow < p.rows)
            rpair = __ldcg(reinterpret_cast<const unsigned*>(out + (size_t)(m0 + orow) * C + n0 + ocol));
        cp_async_wait_all();
        __syncthreads();
        float acc[4][4] = {};
        const T* arow = as + (lane % 16) * LDS + (lane / 16) * 8 + warp * KS;
        const T* wrow = ws + ((lane / 16) * 8 + lane % 8) * LDS + ((lane / 8) % 2) * 8 + warp * KS;
#pragma unroll
        for (int kk = 0; kk < KS; kk += 16) {
            uint32_t a[4], b0[4], b1[4];
            ldmatrix_x4(a, arow + kk);
            ldmatrix_x4(b0, wrow + kk);             // outputs 0-15
            ldmatrix_x4(b1, wrow + 16 * LDS + kk);  // outputs 16-31
            mma(acc[0], a, b0[0], b0[1], T());
            mma(acc[1], a, b0[2], b0[3], T());
            mma(acc[2], a, b1[0], b1[1], T());
            mma(acc[3], a, b1[2], b1[3], T());
        }
        __syncthreads();  // every warp is done with A and W: the reduction buffer reuses A
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                *reinterpret_cast<float2*>(red + (warp * BM2 + g + 8 * h) * BN2 + j * 8 + 2 * t) =
                    make_float2(acc[j][2 * h], acc[j][2 * h + 1]);
        __syncthreads();
        if (m0 + orow < p.rows) {
            const T* bp = reinterpret_cast<const T*>(&bpair);
            const T* rp = reinterpret_cast<const T*>(&rpair);
            float v0 = to_f32(bp[0]) + to_f32(rp[0]), v1 = to_f32(bp[1]) + to_f32(rp[1]);
            float s0 = 0.f, s1 = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float2 pr = *reinterpret_cast<const float2*>(red + (w * BM2 + orow) * BN2 + ocol);
                s0 += pr.x;
                s1 += pr.y;
            }
            *reinterpret_cast<uint32_t*>(out + (size_t)(m0 + orow) * C + n0 + ocol) =
                pack2<T>(s0 + v0, s1 + v1);
        }
    }
}

// Requests the W tile of this block's first unit of the next K = C phase before the barrier
// into it (weights never depend on the phase before). Returns whether it did.
template <typename T, int C>
__device__ __forceinline__ bool prefetch_w(unsigned char* smem, const T* w, unsigned N,
                                           unsigned rows) {
    const unsigned units = ((rows + BM - 1) / BM) * (N / BN);
    if (blockIdx.x >= units) return false;
    __syncthreads();  // nobody still reads this region
    load_rows<T, C, C + PAD>(reinterpret_cast<T*>(smem), w + (size_t)(blockIdx.x % (N / BN)) * BN * C,
                             C, BN, 0, BN);
    cp_async_commit();
    return true;
}

// The same for fc2's first unit: its whole W tile (C <= 384), or its first chunk.
template <typename T, int C>
__device__ __forceinline__ bool prefetch_fc2(unsigned char* smem, const Params& p) {
    if constexpr (C <= 384) {
        const unsigned units = ((p.rows + BM2 - 1) / BM2) * (C / BN2);
        if (blockIdx.x >= units) return false;
        __syncthreads();
        fc2_split_load_w<T, C>(smem, p, (blockIdx.x % (C / BN2)) * BN2);
        cp_async_commit();
        return true;
    }
    const unsigned units = ((p.rows + BM - 1) / BM) * (C / BN);
    if (blockIdx.x >= units) return false;
    __syncthreads();
    T* stage = reinterpret_cast<T*>(smem);
    load_rows<T, KC2, KC2 + PAD>(stage + BM * (KC2 + PAD),
                                 reinterpret_cast<const T*>(p.fc2_w) +
                                     (size_t)(blockIdx.x % (C / BN)) * BN * 4 * C,
                                 4 * C, BN, 0, BN);
    cp_async_commit();
    return true;
}

// ---------------------------------------------------------------------------------------------
// Attention: unit = (sequence, head, query tile of QT). The head's K and V rows of the sequence
// are staged in shared memory (rows past the length zero-filled up to a whole chunk), warp w
// takes key chunks w, w + 8, ... with an online softmax in registers, and the eight partial
// results are merged through shared memory (which then reuses the K/V space).
template <typename T, int C>
__device__ void attention_phase(const Params& p, unsigned char* smem) {
    constexpr int H = C / HD;
    const unsigned lpad = (p.max_len + KC - 1) / KC * KC;
    T* ks = reinterpret_cast<T*>(smem);
    T* vs = ks + lpad * HLD;
    T* qs = vs + lpad * HLD;
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
        const unsigned piece = (threadIdx.x % 8) * 8;
        for (unsigned r = threadIdx.x / 8; r < chunks * KC; r += THREADS / 8) {
            const bool ok = r < len;
            const T* src = qkv + (size_t)(start + (ok ? r : 0)) * (3 * C) + h * HD + piece;
            cp_async_16(ks + r * HLD + piece, src + C, ok);
            cp_async_16(vs + r * HLD + piece, src + 2 * C, ok);
        }
        if (threadIdx.x < QT * 8) {
            const unsigned r = threadIdx.x / 8;
            const bool ok = q0 + r < len;
            const T* src = qkv + (size_t)(start + (ok ? q0 + r : 0)) * (3 * C) + h * HD + piece;
            cp_async_16(qs + r * HLD + piece, src, ok);
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
        // Two outputs a thread (a pair of dims), the warps' weights computed once per pair.
        for (unsigned i = threadIdx.x; i < QT * HD / 2; i += THREADS) {
            const unsigned r = i / (HD / 2), d = 2 * (i % (HD / 2));
            if (q0 + r >= len) continue;
            float mw[WARPS], mt = -INFINITY;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                mw[w] = mm[w * QT + r];
                mt = fmaxf(mt, mw[w]);
            }
            float n0 = 0.f, n1 = 0.f, den = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float f = exp2f(mw[w] - mt);  // 0 for warps without keys
                const float2 ov = *reinterpret_cast<const float2*>(om + (w * QT + r) * OLD + d);
                n0 += f * ov.x;
                n1 += f * ov.y;
                den += f * ll[w * QT + r];
            }
            const float inv = 1.0f / den;
            *reinterpret_cast<uint32_t*>(attn + (size_t)(start + q0 + r) * C + h * HD + d) =
                pack2<T>(n0 * inv, n1 * inv);
        }
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
    const T* proj_w = reinterpret_cast<const T*>(p.proj_w);
    const T* fc1_w = reinterpret_cast<const T*>(p.fc1_w);

    // Weights never depend on the kernel before: request this block's first qkv weight tile,
    // then wait for that kernel (a no-op unless launched with programmatic dependent launch,
    // where this kernel may start while the previous block's fc2 is still running).
    const bool qkv_ready = !(p.skip & 1) && prefetch_w<T, C>(smem, reinterpret_cast<const T*>(p.qkv_w), 3 * C, p.rows);
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
    if (!(p.skip & 1))
        gemm_phase<T, C, EPI_QKV>(p, smem, x, reinterpret_cast<const T*>(p.qkv_w), 3 * C,
                                  reinterpret_cast<const T*>(p.qkv_b),
                                  reinterpret_cast<const T*>(p.ln1_w),
                                  reinterpret_cast<const T*>(p.ln1_b), p.eps1, qkv, qkv_ready);
    grid_sync(p.barrier);
    if (!(p.skip & 2)) attention_phase<T, C>(p, smem);
    bool ready = !(p.skip & 4) && prefetch_w<T, C>(smem, proj_w, C, p.rows);
    grid_sync(p.barrier);
    if (!(p.skip & 4))
        gemm_phase<T, C, EPI_PROJ>(p, smem, attn, proj_w, C, reinterpret_cast<const T*>(p.proj_b),
                                   nullptr, nullptr, 0.f, out, ready);
    ready = !(p.skip & 8) && prefetch_w<T, C>(smem, fc1_w, 4 * C, p.rows);
    grid_sync(p.barrier);
    if (!(p.skip & 8))
        gemm_phase<T, C, EPI_FC1>(p, smem, out, fc1_w, 4 * C, reinterpret_cast<const T*>(p.fc1_b),
                                  reinterpret_cast<const T*>(p.ln2_w),
                                  reinterpret_cast<const T*>(p.ln2_b), p.eps2, hidden, ready);
    ready = !(p.skip & 16) && prefetch_fc2<T, C>(smem, p);
    grid_sync(p.barrier);
#if __CUDA_ARCH__ >= 900
    // The next kernel may be scheduled now (its blocks only prefetch weights until we exit).
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
    if (!(p.skip & 16)) {
        if constexpr (C <= 384)
            fc2_split_phase<T, C>(p, smem, ready);
        else
            fc2_phase<T, C>(p, smem, ready);
    }
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
