// Lever 99, first version of the thin kernel (not kept), as it sat in candle-fastpath/kernels/fastpath.cu
// after the NORM_LINEAR entries; the Rust side (ThinLinearOp, FusedLinear's dispatch, the test) is
// the same as in lever99-thin-linear-v2.patch except that the op needed no compute-capability check.
constexpr int TL_BM = 48, TL_BN = 64, TL_WARPS_M = TL_BM / 16, TL_WARPS = TL_WARPS_M * (TL_BN / 32),
              TL_CHUNKS = 4;

template <int N> __device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void tl_wait_chunks(int pending) {
    static_assert(TL_CHUNKS == 4, "one case per chunk");
    switch (pending) {
    case 3: cp_async_wait_group<3>(); break;
    case 2: cp_async_wait_group<2>(); break;
    case 1: cp_async_wait_group<1>(); break;
    default: cp_async_wait_group<0>(); break;
    }
}

template <typename T, int K, bool GELU>
__device__ void thin_linear_tile(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                                 T* __restrict__ y, int M, int N) {
    constexpr int LDS = K + 8, KC = K / TL_CHUNKS, VC = KC / 8;
    static_assert(K % (16 * TL_CHUNKS) == 0, "chunks of whole 16-wide MMA steps");
    extern __shared__ __align__(16) unsigned char tl_smem[];
    T* rows = reinterpret_cast<T*>(tl_smem);
    const int m0 = blockIdx.y * TL_BM, n0 = blockIdx.x * TL_BN;
#pragma unroll
    for (int c = 0; c < TL_CHUNKS; ++c) {
        for (int i = threadIdx.x; i < (TL_BM + TL_BN) * VC; i += TL_WARPS * 32) {
            const int r = i / VC, k = c * KC + (i % VC) * 8;
            const bool is_x = r < TL_BM;
            const int row = is_x ? m0 + r : n0 + r - TL_BM;
            const bool ok = row < (is_x ? M : N);
            nl_cp_async16(rows + r * LDS + k, (is_x ? x : w) + (size_t)(ok ? row : 0) * K + k, ok);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    const int warp = threadIdx.x / 32, wm = warp % TL_WARPS_M, wn = warp / TL_WARPS_M;
    float bias_f[4][2];
    nl_load_bias(bias_f, bias, n0 + wn * 32, N);
    float acc[4][4] = {};
#pragma unroll
    for (int c = 0; c < TL_CHUNKS; ++c) {
        tl_wait_chunks(TL_CHUNKS - 1 - c);
        __syncthreads();
        nl_warp_mma_16x32<T, KC, LDS>(acc, rows + wm * 16 * LDS + c * KC, rows + (TL_BM + wn * 32) * LDS + c * KC);
    }
    nl_store_tile<T, GELU>(acc, bias_f, y, m0 + wm * 16, n0 + wn * 32, M, N);
}
