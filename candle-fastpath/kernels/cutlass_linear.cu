// nn.Linear on CUTLASS's Hopper GEMM, half precision in and out, f32 accumulation and epilogue:
//   y = gelu_erf(x · Wᵀ + b)   (fc1 of a ViT MLP: the exact GELU timm's nn.GELU() computes)
//   y = x · Wᵀ + b             (qkv)
//   y = x · Wᵀ + b + r         (proj and fc2: the residual r read as the GEMM's C operand)
//
// Why: cuBLASLt's own GELU epilogue is the tanh approximation, so the exact GELU runs as a
// separate pass over the [M, 4C] hidden activations (candle-fastpath's fastpath_gelu_erf
// kernel): at batch 256 that pass reads and writes 2 × 12 × 50,432 × 1,536 × 2 bytes ≈ 3.7 GB
// per DeiT-S forward. Here the GELU is applied to the accumulators before the one store.
//
// The GEMM is CUTLASS 3's Hopper kernel (TMA loads, wgmma, warp-specialised cooperative
// schedule, persistent tile scheduler) built from its collective builders; only the epilogue
// (per-column bias, then the activation) is chosen here. Compiled for sm_90a by build.rs into a
// static library when the CUTLASS headers are available (scripts/install-cuda-toolkit.sh), with
// CUTLASS_ENABLE_GDC_FOR_SM90: the kernels wait for the previous grid before reading what it wrote
// and let the next one launch after their main loop, so with `pdl` (programmatic dependent launch,
// see candle_ragged::launch) consecutive kernels overlap their tails and ramp-ups.
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

namespace {

using namespace cute;

// Two tilings. Large: 128 × 128 output tiles, two consumer warpgroups of 64 rows each
// (cooperative). Small, for problems whose large tiles would not fill the GPU (a few hundred
// rows, batch 1–8): 64 × 64 tiles, one consumer warpgroup, so ~4× the blocks.
struct LargeTiles {
    using TileShape = Shape<_128, _128, _64>;
    using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
    using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
struct SmallTiles {
    using TileShape = Shape<_64, _64, _64>;
    using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecialized;
    using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
};

enum class Epi { Bias, BiasGelu, BiasResidual };

template <typename Element, Epi kEpi>
struct FusionFor;
template <typename Element>
struct FusionFor<Element, Epi::Bias> {
    using ElementC = void;
    using Op = cutlass::epilogue::fusion::LinCombPerColBias<Element, float, Element, Element, float>;
};
template <typename Element>
struct FusionFor<Element, Epi::BiasGelu> {
    using ElementC = void;
    using Op = cutlass::epilogue::fusion::LinCombPerColBiasEltAct<
        cutlass::epilogue::thread::GELU, Element, float, Element, Element, float>;
};
template <typename Element>
struct FusionFor<Element, Epi::BiasResidual> {
    using ElementC = Element;  // the residual, added with beta = 1
    using Op = cutlass::epilogue::fusion::LinCombPerColBias<Element, float, Element, Element, float>;
};

template <typename Element, typename Tiles, Epi kEpi>
struct Linear {
    using LayoutA = cutlass::layout::RowMajor;
    using LayoutB = cutlass::layout::ColumnMajor;
    using LayoutD = cutlass::layout::RowMajor;
    static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte accesses
    using TileShape = typename Tiles::TileShape;  // 64-deep K steps either way
    using ClusterShape = Shape<_1, _1, _1>;
    using Fusion = typename FusionFor<Element, kEpi>::Op;
    using ElementC = typename FusionFor<Element, kEpi>::ElementC;
    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD, kAlign,
        Element, LayoutD, kAlign, typename Tiles::EpilogueSchedule, Fusion>::CollectiveOp;
    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element,
        LayoutB, kAlign, float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
            sizeof(typename Epilogue::SharedStorage))>,
        typename Tiles::MainloopSchedule>::CollectiveOp;
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
    kBadEpilogue = 5,
};

template <typename Element, typename Tiles, Epi kEpi>
int linear_tiled(const void* x, long long ldx, const void* w, const void* bias, const void* residual,
                 void* y, int m, int n, int k, int sm_count, bool pdl, cudaStream_t stream) {
    using Gemm = typename Linear<Element, Tiles, kEpi>::Gemm;
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
    if constexpr (kEpi == Epi::BiasResidual) {
        args.epilogue.ptr_C = static_cast<const Element*>(residual);
        args.epilogue.thread.beta = 1.0f;
    } else {
        args.epilogue.ptr_C = nullptr;
        args.epilogue.thread.beta = 0.0f;
    }
    args.epilogue.dC = stride_c;
    args.epilogue.ptr_D = static_cast<Element*>(y);
    args.epilogue.dD = stride_d;
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.bias_ptr = static_cast<const Element*>(bias);
    int device = 0;
    cudaGetDevice(&device);
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count;

    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return kCannotImplement;
    if (Gemm::get_workspace_size(args) != 0) return kNeedsWorkspace;
    if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) return kInitializeFailed;
    if (gemm.run(stream, nullptr, pdl) != cutlass::Status::kSuccess) return kRunFailed;
    return kOk;
}

template <typename Element, Epi kEpi>
int linear(const void* x, long long ldx, const void* w, const void* bias, const void* residual,
           void* y, int m, int n, int k, int sm_count, bool pdl, cudaStream_t stream) {
    const long long large_tiles = (long long)((m + 127) / 128) * ((n + 127) / 128);
    if (large_tiles < sm_count) {
        return linear_tiled<Element, SmallTiles, kEpi>(x, ldx, w, bias, residual, y, m, n, k,
                                                       sm_count, pdl, stream);
    }
    return linear_tiled<Element, LargeTiles, kEpi>(x, ldx, w, bias, residual, y, m, n, k, sm_count,
                                                   pdl, stream);
}

template <typename Element>
int linear_any(int epilogue, const void* x, long long ldx, const void* w, const void* bias,
               const void* residual, void* y, int m, int n, int k, int sm_count, bool pdl,
               cudaStream_t stream) {
    switch (epilogue) {
        case 0:
            return linear<Element, Epi::Bias>(x, ldx, w, bias, residual, y, m, n, k, sm_count, pdl, stream);
        case 1:
            return linear<Element, Epi::BiasGelu>(x, ldx, w, bias, residual, y, m, n, k, sm_count, pdl,
                                                  stream);
        case 2:
            return linear<Element, Epi::BiasResidual>(x, ldx, w, bias, residual, y, m, n, k, sm_count,
                                                      pdl, stream);
        default:
            return kBadEpilogue;
    }
}

}  // namespace

// `epilogue`: 0 = bias, 1 = bias + exact GELU, 2 = bias + residual (`residual` [M, N], contiguous).
extern "C" int fastpath_cutlass_linear_f16(int epilogue, const void* x, long long ldx, const void* w,
                                           const void* bias, const void* residual, void* y, int m,
                                           int n, int k, int sm_count, int pdl, cudaStream_t stream) {
    return linear_any<cutlass::half_t>(epilogue, x, ldx, w, bias, residual, y, m, n, k, sm_count,
                                       pdl != 0, stream);
}

extern "C" int fastpath_cutlass_linear_bf16(int epilogue, const void* x, long long ldx, const void* w,
                                            const void* bias, const void* residual, void* y, int m,
                                            int n, int k, int sm_count, int pdl, cudaStream_t stream) {
    return linear_any<cutlass::bfloat16_t>(epilogue, x, ldx, w, bias, residual, y, m, n, k,
                                           sm_count, pdl != 0, stream);
}
