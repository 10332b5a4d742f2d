//! [`norm_linear`]: `linear(norm(x))`, or its exact GELU, the pair a pre-norm ViT block runs
//! twice (norm1 → qkv, norm2 → fc1 → GELU) and a ViT ends with (final norm → head), as one
//! kernel where that is faster.
//!
//! At batch 1 a block's kernels are each a µs or two of launch and latency around well under a
//! µs of work, back to back in a CUDA graph; the LayerNorm and the GELU pass are three of its
//! eight. The fused kernel loads a tile's input rows whole, normalises them in shared memory
//! (our LayerNorm kernel's arithmetic, so the normalised rows are bit for bit the same), runs the
//! GEMM with tensor cores and applies bias (and GELU) before its one store (lever 58 in
//! `docs/BENCHMARKS.md`). Its GEMM reads whole rows per tile, so it only pays where rows are
//! narrow and few: the widths in [`NORM_LINEAR_DIMS`] (DeiT-T's 192; at 384 and up cuBLASLt's
//! GEMM is faster than the launches saved) and grids of at most one wave.

use candle_core::{Shape, Tensor};

use crate::error::{FastpathError, Result};
use crate::{Epilogue, FusedLinear, LayerNorm};

const OP: &str = "norm_linear";

/// Widths (C, the normalised dim) the fused CUDA kernel is built for.
pub const NORM_LINEAR_DIMS: &[usize] = &[192];

/// When [`norm_linear`] takes the fused kernel, from `CANDLE_FASTPATH_NORM_LINEAR` (read once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormLinearMode {
    /// The default: eligible operands whose grid (16-row × 128-column tiles) fits one wave of
    /// one CTA per SM (at batch 1 and pruned batch-1 row counts for DeiT-T).
    OneWave,
    /// Every eligible call, whatever its row count (`=always`; for A/B measurements).
    Always,
    /// Never (`=0`): the LayerNorm kernel, then [`FusedLinear`].
    Off,
}

/// The mode `CANDLE_FASTPATH_NORM_LINEAR` selects (read once): unset, `always`, `0`.
pub fn norm_linear_mode() -> NormLinearMode {
    static MODE: std::sync::OnceLock<NormLinearMode> = std::sync::OnceLock::new();
    crate::switches::read_once(&MODE, "CANDLE_FASTPATH_NORM_LINEAR", |v| match v {
        Some("always") => NormLinearMode::Always,
        Some("0") | Some("off") => NormLinearMode::Off,
        _ => NormLinearMode::OneWave,
    })
}

/// `norm(x)·Wᵀ + b`, then the exact GELU when `gelu`.
///
/// # Arguments
/// * `x` - `[.., C]`, the dtype and device of the weights.
/// * `norm` - LayerNorm over `C`.
/// * `linear` - `W` `[N, C]` (and its bias `[N]`).
///
/// # Returns
/// `[.., N]`, what `linear.forward_with(&norm.forward(x)?, Epilogue::Gelu or Plain)` returns.
/// On CUDA, where [`norm_linear_applies`] says so, one kernel computes it (the same normalised
/// rows and roundings as the two-step path; only the GEMM's summation order differs);
/// everywhere else it is those two steps.
pub fn norm_linear(
    x: &Tensor,
    norm: &LayerNorm,
    linear: &FusedLinear,
    gelu: bool,
) -> Result<Tensor> {
    let c = norm.weight().elem_count();
    if linear.in_dim() != c {
        return Err(FastpathError::ShapeMismatch {
            op: OP,
            what: "linear weight (its in dim must be the norm's width)",
            expected: Shape::from((linear.out_dim(), c)),
            found: linear.weight().shape().clone(),
        });
    }
    #[cfg(feature = "cuda")]
    if let (true, Some(bias)) = (norm_linear_applies(x, norm, linear, gelu), linear.bias()) {
        let rows = x.elem_count() / c;
        let mut out_dims = x.dims().to_vec();
        if let Some(last) = out_dims.last_mut() {
            *last = linear.out_dim();
        }
        let op = crate::cuda::NormLinearOp {
            ln_weight: norm.weight().clone(),
            ln_bias: norm.bias().clone(),
            eps: norm.eps() as f32,
            gelu,
        };
        let y = x
            .reshape((rows, c))?
            .apply_op3_no_bwd(linear.weight(), bias, &op)?;
        return Ok(y.reshape(out_dims)?);
    }
    let h = norm.forward_checked(x)?;
    linear.forward_with(
        &h,
        if gelu {
            Epilogue::Gelu
        } else {
            Epilogue::Plain
        },
    )
}

/// Whether [`norm_linear`] runs `x` through the fused kernel: CUDA (the `cuda` feature), f16 or
/// bf16 everywhere, `C` in [`NORM_LINEAR_DIMS`], a bias, `N` even, every operand contiguous and
/// 16-byte aligned on `x`'s device, the GELU in its default (Φ) form, and what
/// [`norm_linear_mode`] allows (by default a grid of at most one CTA per SM). Anything else
/// takes the two-step path, which checks its inputs and reports errors.
pub fn norm_linear_applies(x: &Tensor, norm: &LayerNorm, linear: &FusedLinear, gelu: bool) -> bool {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, norm, linear, gelu);
        false
    }
    #[cfg(feature = "cuda")]
    {
        let mode = norm_linear_mode();
        let candle_core::Device::Cuda(dev) = x.device() else {
            return false;
        };
        let Some(bias) = linear.bias() else {
            return false;
        };
        let c = norm.weight().elem_count();
        let n = linear.out_dim();
        let aligned =
            |t: &Tensor| crate::cuda::contiguous_16b(t.layout(), t.dtype().size_in_bytes());
        let same = |t: &Tensor| t.dtype() == x.dtype() && t.device().same_device(x.device());
        let eligible = mode != NormLinearMode::Off
            && matches!(
                x.dtype(),
                candle_core::DType::F16 | candle_core::DType::BF16
            )
            && NORM_LINEAR_DIMS.contains(&c)
            && x.dims().last() == Some(&c)
            && x.elem_count() > 0
            && linear.in_dim() == c
            && n % 2 == 0
            && [norm.weight(), norm.bias(), linear.weight(), bias]
                .iter()
                .all(|t| same(t))
            && [x, norm.weight(), norm.bias(), linear.weight()]
                .iter()
                .all(|t| aligned(t))
            && bias.is_contiguous()
            && (!gelu || crate::gelu_form::gelu_form() == crate::gelu_form::GeluForm::Phi);
        if !eligible {
            return false;
        }
        if mode == NormLinearMode::Always {
            return true;
        }
        let tiles = (x.elem_count() / c).div_ceil(16) * n.div_ceil(128);
        crate::cuda::sm_count(dev).is_ok_and(|sms| tiles <= sms)
    }
}
