// fc1 of a ViT MLP on CUTLASS's Hopper GEMM, half precision in and out, f32 accumulation and
// epilogue:
//   y = gelu_erf(x · Wᵀ + b)   (the exact GELU timm's nn.GELU() computes)
//
// Why: cuBLASLt's own GELU epilogue is the tanh approximation, so with cuBLASLt the exact GELU
// runs as a separate pass over the [M, 4C] hidden activations (candle-fastpath's fastpath_gelu_erf
// kernel): at DeiT-S batch 256 that pass reads and writes 2 × 50,432 × 1,536 × 2 bytes per block,
// about 120 µs. Here the GELU is applied to the accumulators before the one store.
//
// The GEMM is CUTLASS 3's Hopper kernel (TMA loads, wgmma, warp-specialised cooperative schedule,
// persistent tile scheduler) built from its collective builders; only the tiling and the epilogue
// (per-column bias, then the activation) are chosen here. Compiled for sm_90a by build.rs into a
// static library when the CUTLASS headers are available (scripts/install-cuda-toolkit.sh).
//
// Tiling, measured on the H100 (docs/LEVERS.md, lever 18): 128 × 256 output tiles, two
// consumer warpgroups of 64 rows each. The erf GELU costs ~20 instructions per element and the
// cooperative epilogue does not overlap the next tile's main loop, so the wider tile (fewer,
// longer main loops per epilogue byte) beat 128 × 128 cooperative, 128 × 128 and 64 × 128
// ping-pong (lever 18), and 64 × 256 ping-pong (lever 26, with the Φ GELU). Even so the fused
// kernel beats cuBLASLt + the GELU pass only on large problems; the caller (src/cutlass.rs)
// sends only those here.
//
// Layout (row-major throughout, as candle stores them):
//   x [M, K] with row stride ldx (a column slice of a wider tensor is fine), W [N, K]
//   (nn.Linear's weight: K-major, i.e. CUTLASS's column-major B of shape K × N), b [N],
//   y [M, N] contiguous.
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "gelu_phi.cuh"

namespace {

using namespace cute;

// CUTLASS's GELU functor shape (scalar and Array<T, N>), evaluating gelu_phi.cuh's x · Φ(x) in
// f32 instead of CUTLASS's 0.5 · x · (1 + erff(x / √2)).
template <typename T>
struct GeluPhi {
    static const bool kIsHeavy = true;
    CUTLASS_DEVICE T operator()(T const& value) const {
        return T(gelu_phi(static_cast<float>(value)));
    }
};
template <typename T, int N>
struct GeluPhi<cutlass::Array<T, N>> {
    static const bool kIsHeavy = true;
    CUTLASS_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& value) const {
        cutlass::Array<T, N> y;
        GeluPhi<T> op;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < N; ++i) y[i] = op(value[i]);
        return y;
    }
};

// Kernel shapes. Lever 18's 128 × 256 cooperative kernel stores its tile in 128 × 32 epilogue
// subtiles (CUTLASS's automatic choice), eight barrier / TMA-store rounds per tile; lever 26's
// 128 × 64 subtiles halve those rounds: on the H100 (ncu, DeiT-B fc1 at batch 256) 546 → 530 µs,
// and 548 / 546 → 538 / 539 µs on a repeat, DeiT-S 194 → 190 µs; the Φ GELU (the default) runs
// on it, `CANDLE_FASTPATH_CUTLASS_TILE=epi32` and the erf form on lever 18's. 64 × 256 ping-pong
// tiles (one warpgroup's epilogue beside the other's main loop) measured 5-25 % slower: not kept.
struct Cooperative128x256 {
    using Tile = Shape<_128, _256, _64>;
    using EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto;
    using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
    using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
};
struct Cooperative128x256Epi64 : Cooperative128x256 {
    using EpilogueTile = Shape<_128, _64>;
};

template <typename Element, template <class> class Gelu, typename Shapes = Cooperative128x256>
struct LinearGelu {
    using LayoutA = cutlass::layout::RowMajor;
    using LayoutB = cutlass::layout::ColumnMajor;
    using LayoutD = cutlass::layout::RowMajor;
    static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte accesses
    using TileShape = typename Shapes::Tile;
    using ClusterShape = Shape<_1, _1, _1>;
    using Fusion = cutlass::epilogue::fusion::LinCombPerColBiasEltAct<Gelu, Element, float,
                                                                      Element, Element, float>;
    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        typename Shapes::EpilogueTile, float, float, void, LayoutD, kAlign, Element, LayoutD,
        kAlign, typename Shapes::EpilogueSchedule, Fusion>::CollectiveOp;
    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element,
        LayoutB, kAlign, float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
            sizeof(typename Epilogue::SharedStorage))>,
        typename Shapes::MainloopSchedule>::CollectiveOp;
    using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop,
                                                        Epilogue>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Status codes returned to Rust (candle-fastpath/src/cutlass.rs names them).
enum : int {
    kOk = 0,
    kCannotImplement = 1,
    kNeedsWorkspace = 2,
    kInitializeFailed = 3,
    kRunFailed = 4,
};

template <typename Element, template <class> class Gelu, typename Shapes = Cooperative128x256>
int linear_gelu(const void* x, long long ldx, const void* w, const void* bias, void* y, int m,
                int n, int k, int sm_count, cudaStream_t stream) {
    using Gemm = typename LinearGelu<Element, Gelu, Shapes>::Gemm;
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    using StrideC = typename Gemm::GemmKernel::StrideC;
    using StrideD = typename Gemm::GemmKernel::StrideD;

    StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m, k, 1));
    cute::get<0>(stride_a) = ldx;  // rows of x may be a column slice of a wider tensor
    StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(n, k, 1));
    StrideC stride_c = cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(m, n, 1));
    StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(m, n, 1));

    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {m, n, k, 1};
    args.mainloop.ptr_A = static_cast<const Element*>(x);
    args.mainloop.dA = stride_a;
    args.mainloop.ptr_B = static_cast<const Element*>(w);
    args.mainloop.dB = stride_b;
    args.epilogue.ptr_C = nullptr;  // no C operand: beta = 0
    args.epilogue.dC = stride_c;
    args.epilogue.ptr_D = static_cast<Element*>(y);
    args.epilogue.dD = stride_d;
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.thread.bias_ptr = static_cast<const Element*>(bias);
    int device = 0;
    cudaGetDevice(&device);
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count;

    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return kCannotImplement;
    if (Gemm::get_workspace_size(args) != 0) return kNeedsWorkspace;
    if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) return kInitializeFailed;
    if (gemm.run(stream) != cutlass::Status::kSuccess) return kRunFailed;
    return kOk;
}

// `phi` != 0: the GELU in gelu_phi.cuh's form, else CUTLASS's erf form. `epi32` != 0 (Φ only):
// lever 18's 128 × 32 epilogue subtiles instead of 128 × 64.
template <typename Element>
int linear_gelu_any(int phi, int epi32, const void* x, long long ldx, const void* w,
                    const void* bias, void* y, int m, int n, int k, int sm_count,
                    cudaStream_t stream) {
    if (phi && !epi32) {
        return linear_gelu<Element, GeluPhi, Cooperative128x256Epi64>(x, ldx, w, bias, y, m, n, k,
                                                                     sm_count, stream);
    }
    if (phi) {
        return linear_gelu<Element, GeluPhi>(x, ldx, w, bias, y, m, n, k, sm_count, stream);
    }
    return linear_gelu<Element, cutlass::epilogue::thread::GELU>(x, ldx, w, bias, y, m, n, k,
                                                                 sm_count, stream);
}

}  // namespace

extern "C" int fastpath_cutlass_linear_gelu_f16(int phi, int epi32, const void* x, long long ldx,
                                                const void* w, const void* bias, void* y, int m,
                                                int n, int k, int sm_count, cudaStream_t stream) {
    return linear_gelu_any<cutlass::half_t>(phi, epi32, x, ldx, w, bias, y, m, n, k, sm_count,
                                            stream);
}

extern "C" int fastpath_cutlass_linear_gelu_bf16(int phi, int epi32, const void* x,
                                                 long long ldx, const void* w, const void* bias,
                                                 void* y, int m, int n, int k, int sm_count,
                                                 cudaStream_t stream) {
    return linear_gelu_any<cutlass::bfloat16_t>(phi, epi32, x, ldx, w, bias, y, m, n, k,
                                                sm_count, stream);
}
