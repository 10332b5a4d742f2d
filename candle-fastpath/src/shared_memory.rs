//! What this crate's kernels of fixed shape ask of a block's shared memory, and which of them a
//! GPU can run: the sizes `cuda.rs` opts each kernel into when it loads, kept here (apart from
//! the launches) so that the rule is tested without a GPU.
//!
//! A kernel asking for more dynamic shared memory than the device lets a block opt into
//! (`CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`: 227 KB on compute capability 9.0
//! and 10.0, 163 KB on 8.0 and 8.7, 99 KB on 8.6, 8.9 and 12.x) cannot be opted in: loading it
//! that way fails. Such a kernel is left out on that device ([`FixedKernelsFit`]) and its op's
//! applies check says no, so the composed path runs instead of every op erroring.

// Read by the CUDA loaders and applies checks only; the CPU build keeps it for its tests.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// The input rows of one norm_linear CTA, per kernel form: lever 58's 16-row tile (one wave
/// of one CTA per SM) and lever 81's 64-row tile (a few thousand rows, two CTAs per SM).
pub(crate) const NORM_LINEAR_TILE_ROWS: [usize; 2] = [16, 64];
/// norm_linear's output columns a CTA (NL_BN in kernels/fastpath.cu).
pub(crate) const NL_BN: usize = 128;
/// The residual_norm_linear family's rows a tile (NL_BM in kernels/fastpath.cu).
pub(crate) const NL_BM: usize = 16;
/// The one width [`crate::cuda::RnlForm`]'s kernels are built for (DeiT-T).
pub(crate) const RNL_DIM: usize = 192;
/// The cluster exchanges' transaction barriers at the start of the residual_norm_linear family's
/// dynamic shared memory (RNL_BAR_BYTES in kernels/fastpath.cu, lever 68).
pub(crate) const RNL_BAR_BYTES: usize = 64;

/// Dynamic shared memory of a norm_linear launch at width `c` with `tile_rows`-row tiles,
/// 16-bit storage: the tile's input and weight rows, each padded by 8 elements.
pub(crate) fn norm_linear_bytes(c: usize, tile_rows: usize) -> usize {
    (tile_rows + NL_BN) * (c + 8) * 2
}

/// The shape of one residual_norm_linear form ([`crate::cuda::RnlForm`] reads its own here): the
/// front GEMM's depth and its K warps, the back GEMM's tile width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RnlShape {
    pub front_k: usize,
    pub tile_n: usize,
    pub k_warps: usize,
}

impl RnlShape {
    /// proj (K = C) → norm2 → fc1 (N ≤ 6 · 128), with or without the GELU.
    pub(crate) const PROJ: Self = Self {
        front_k: RNL_DIM,
        tile_n: 128,
        k_warps: 6,
    };
    /// fc2 (K = 4C) → the next block's norm1 → qkv (N ≤ 6 · 96).
    pub(crate) const FC2: Self = Self {
        front_k: 4 * RNL_DIM,
        tile_n: 96,
        k_warps: 12,
    };

    /// Dynamic shared memory of a launch, 16-bit storage: the tile's x1 rows and back-weight
    /// rows (C wide), the front GEMM's input rows and its 32 weight rows (K wide), each padded by
    /// 8 elements, and the front GEMM's f32 partial sums (a 16 × 32 tile per K warp).
    pub(crate) fn bytes(self) -> usize {
        RNL_BAR_BYTES
            + ((NL_BM + self.tile_n) * (RNL_DIM + 8) + (NL_BM + 32) * (self.front_k + 8)) * 2
            + self.k_warps * NL_BM * 32 * 4
    }
}

/// The small-block kernel's tiles (`sb::BM`, `sb::BN`, `sb::PAD`, `sb::KC2` in
/// kernels/small_block.cu).
pub(crate) const SB_BM: usize = 32;
pub(crate) const SB_BN: usize = 64;
const SB_PAD: usize = 8;
const SB_KC2: usize = 192;

/// Dynamic shared memory of the C-wide small-block kernel for sequences of at most `max_len`
/// tokens: each phase lays out its own from offset 0, so the largest of the K = C GEMM tiles (W
/// `[BN][C + PAD]` and A `[BM][C + PAD]`), fc2's tiles (C ≤ 384: `[16 + 32][4C + PAD]`, its
/// whole K; wider: a two-stage ring of `[BM + BN][KC2 + PAD]`) and the attention's K, V
/// (`max_len` rounded up to 16 rows each) and Q tile (16 rows) of `64 + PAD` elements, and its
/// merge buffer (`[8][16][68]` f32 and two `[8][16]` f32).
pub(crate) fn small_block_bytes(c: usize, max_len: usize) -> usize {
    let gemm = (SB_BN + SB_BM) * (c + SB_PAD) * 2;
    // C <= 384: a 16 × 32 output tile with its whole K = 4C; wider: the two-stage K ring.
    let fc2 = if c <= 384 {
        (16 + 32) * (4 * c + SB_PAD) * 2
    } else {
        2 * (SB_BN + SB_BM) * (SB_KC2 + SB_PAD) * 2
    };
    let attn = (2 * max_len.div_ceil(16) * 16 + 16) * (64 + SB_PAD) * 2;
    let merge = (8 * 16 * 68 + 2 * 8 * 16) * 4;
    gemm.max(fc2).max(attn).max(merge)
}

/// The pooled head's rows a tail CTA (`PH_BM`) and the most sequences its offsets table holds
/// (`PH_MAX_CU`), as in kernels/fastpath.cu.
pub(crate) const PH_BM: usize = 16;
pub(crate) const PH_MAX_CU: usize = 1024;

/// The pooled head's tail kernel's dynamic shared memory for pooled-half width `h` and element
/// size `elem`: `PhLayout<T, H>::BYTES` in kernels/fastpath.cu (the rows, the layers' weights,
/// PH_MAX_CU + 1 offsets and the rows' sequences, each region rounded up to 16 bytes).
pub(crate) fn pooled_head_tail_bytes(h: usize, elem: usize) -> usize {
    let a16 = |b: usize| b.div_ceil(16) * 16;
    let (q, lda, ldq) = (h / 2, h + 8, h / 2 + 8);
    // Two tiles of local halves, then y0 and y1.
    let rows = 3 * a16(PH_BM * lda * elem) + a16(PH_BM * ldq * elem);
    let weights = a16(h * lda * elem)
        + a16(q * lda * elem)
        + a16(crate::HEAD_MAX_CLASSES * q * elem)
        + a16(q * elem)
        + a16(crate::HEAD_MAX_CLASSES * elem);
    rows + weights + a16((PH_MAX_CU + 1) * 4) + a16(PH_BM * 4)
}

/// Which fixed-shape kernels past the smallest opt-in (99 KB) a device whose blocks may opt into
/// `limit` bytes can run. Their ops' applies checks read it; the loaders opt in only these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FixedKernelsFit {
    /// Per [`crate::SMALL_BLOCK_DIMS`] entry, at [`crate::SMALL_BLOCK_MAX_LEN`].
    pub small_block: [bool; crate::SMALL_BLOCK_DIMS.len()],
    /// Per [`crate::POOLED_HEAD_WIDTHS`] entry (16-bit storage: the kernels are f16 / bf16).
    pub pooled_head: [bool; crate::POOLED_HEAD_WIDTHS.len()],
    /// residual_norm_linear's fc2 form ([`RnlShape::FC2`]); its proj form (89 KB) fits every
    /// device.
    pub residual_norm_linear_fc2: bool,
}

impl FixedKernelsFit {
    /// The kernels whose shared memory is at most `limit` bytes.
    pub(crate) fn within(limit: usize) -> Self {
        Self {
            small_block: crate::SMALL_BLOCK_DIMS
                .map(|c| small_block_bytes(c, crate::SMALL_BLOCK_MAX_LEN) <= limit),
            pooled_head: crate::POOLED_HEAD_WIDTHS.map(|h| pooled_head_tail_bytes(h, 2) <= limit),
            residual_norm_linear_fc2: RnlShape::FC2.bytes() <= limit,
        }
    }
}

/// `limit` bytes, or `kb` KB where that is lower: what `CANDLE_FASTPATH_GPU_SMEM_KB` passes for
/// the per-block opt-in (and one KB more for a SM, as on compute capability 8.0 / 8.6 / 8.9), so
/// that a smaller GPU's choices run on this one (tests of the composed fallbacks on real
/// hardware). `None` or a value that is not a number: `limit`.
pub(crate) fn capped_kb(limit: usize, kb: Option<&str>, extra_kb: usize) -> usize {
    match kb.and_then(|v| v.trim().parse::<usize>().ok()) {
        Some(kb) => limit.min((kb + extra_kb) * 1024),
        None => limit,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Per-block opt-in limits: H100 / B200 and A100.
    const HOPPER: usize = 227 * 1024;
    const A100: usize = 163 * 1024;
    /// The smallest opt-in of the GPUs the kernels build for (compute capability 8.0 and up:
    /// cp.async and bf16 MMA): 99 KB on 8.6, 8.9 and 12.x (RTX 3090 / 4090 / 5090). Kernels
    /// opted in on every device must keep within it.
    const SMALLEST_OPT_IN: usize = 99 * 1024;

    #[test]
    fn every_fixed_kernel_fits_hopper_and_the_a100() {
        let all = FixedKernelsFit {
            small_block: [true; 3],
            pooled_head: [true; 2],
            residual_norm_linear_fc2: true,
        };
        assert_eq!(FixedKernelsFit::within(HOPPER), all);
        assert_eq!(FixedKernelsFit::within(A100), all);
    }

    #[test]
    fn a_99_kb_gpu_leaves_out_the_wide_kernels() {
        // What stopped every fastpath op on compute capability 8.6 / 8.9 / 12.x before: the
        // DeiT-S pooled head's tail (~140 KB) was opted in with the device state, and the
        // DeiT-S / DeiT-B small blocks (~145 KB) on first use.
        assert_eq!(
            FixedKernelsFit::within(SMALLEST_OPT_IN),
            FixedKernelsFit {
                small_block: [true, false, false],
                pooled_head: [true, false],
                residual_norm_linear_fc2: false,
            }
        );
        assert!(pooled_head_tail_bytes(192, 2) > SMALLEST_OPT_IN);
        assert!(small_block_bytes(384, crate::SMALL_BLOCK_MAX_LEN) > SMALLEST_OPT_IN);
        // Nothing fits a limit below the smallest kernel; everything fits exactly at its size.
        let none = FixedKernelsFit::within(0);
        assert_eq!(none.small_block, [false; 3]);
        assert_eq!(none.pooled_head, [false; 2]);
        assert!(!none.residual_norm_linear_fc2);
        let just = FixedKernelsFit::within(pooled_head_tail_bytes(192, 2));
        assert!(just.pooled_head[1]);
        assert!(!FixedKernelsFit::within(pooled_head_tail_bytes(192, 2) - 1).pooled_head[1]);
    }

    #[test]
    fn a_cap_lowers_the_limit_never_raises_it() {
        assert_eq!(capped_kb(HOPPER, Some("99"), 0), SMALLEST_OPT_IN);
        assert_eq!(capped_kb(HOPPER, Some("99"), 1), 100 * 1024);
        assert_eq!(capped_kb(A100, Some(" 500"), 0), A100);
        assert_eq!(capped_kb(A100, None, 0), A100);
        assert_eq!(capped_kb(A100, Some("99 KB"), 0), A100);
    }

    #[test]
    fn kernels_opted_in_everywhere_fit_the_smallest_limit() {
        // norm_linear (every width and tile height) and residual_norm_linear's proj form load
        // with the device state on every GPU (the latter from compute capability 9.0).
        for &c in crate::NORM_LINEAR_DIMS {
            for tile_rows in NORM_LINEAR_TILE_ROWS {
                let bytes = norm_linear_bytes(c, tile_rows);
                assert!(
                    bytes <= SMALLEST_OPT_IN,
                    "norm_linear c {c} rows {tile_rows}: {bytes}"
                );
            }
        }
        let proj = RnlShape::PROJ.bytes();
        assert!(proj <= SMALLEST_OPT_IN, "proj form {proj}");
    }
}
