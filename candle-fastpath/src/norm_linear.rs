//! [`norm_linear`]: `linear(norm(x))`, or its exact GELU, the pair a pre-norm ViT block runs
//! twice (norm1 → qkv, norm2 → fc1 → GELU) and a ViT ends with (final norm → head), as one
//! kernel where that is faster.
//!
//! At batch 1 a block's kernels are each a µs or two of launch and latency around well under a
//! µs of work, back to back in a CUDA graph; the LayerNorm and the GELU pass are three of its
//! eight. The fused kernel loads a tile's input rows whole, normalises them in shared memory
//! (our LayerNorm kernel's arithmetic, so the normalised rows are bit for bit the same), runs the
//! GEMM with tensor cores and applies bias (and GELU) before its one store (lever 58 in
//! `docs/LEVERS.md`). Its GEMM reads whole rows per tile, so it only pays where rows are
//! narrow and few: the widths in [`NORM_LINEAR_DIMS`] (DeiT-T's 192; at 384 and up cuBLASLt's
//! GEMM is faster than the launches saved) and grids of at most one wave: 16-row tiles at one
//! CTA per SM (batch 1), else, outside CUDA-graph captures, 64-row tiles at two (a few thousand
//! rows, DeiT-T at batch 8; lever 81: fewer launches for eager forwards, which the host bounds;
//! inside a graph the two steps run faster).

use candle_core::{Shape, Tensor};

use crate::error::{FastpathError, Result};
use crate::{Epilogue, FusedLinear, LayerNorm};

const OP: &str = "norm_linear";

/// Widths (C, the normalised dim) the fused CUDA kernel is built for.
pub const NORM_LINEAR_DIMS: &[usize] = &[192];

/// When [`norm_linear`] takes the fused kernel, from `CANDLE_FASTPATH_NORM_LINEAR` (read once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormLinearMode {
    /// The default: eligible operands whose grid of 16-row × 128-column tiles fits one wave of
    /// one CTA per SM (batch 1 and pruned batch-1 row counts for DeiT-T), else, while the
    /// device's stream is not being captured, whose grid of 64-row tiles fits one wave of two
    /// CTAs per SM (DeiT-T at batch 8: 1,576 rows).
    OneWave,
    /// Only the first of those (`=narrow`: the rule before lever 81; for A/B measurements).
    Narrow,
    /// Every eligible call, whatever its row count, in 16-row tiles (`=always`; for A/B
    /// measurements).
    Always,
    /// Never (`=0`): the LayerNorm kernel, then [`FusedLinear`].
    Off,
}

/// The mode `CANDLE_FASTPATH_NORM_LINEAR` selects (read once): unset, `narrow`, `always`, `0`.
pub fn norm_linear_mode() -> NormLinearMode {
    static MODE: std::sync::OnceLock<NormLinearMode> = std::sync::OnceLock::new();
    crate::switches::read_once(&MODE, "CANDLE_FASTPATH_NORM_LINEAR", |v| match v {
        Some("always") => NormLinearMode::Always,
        Some("narrow") => NormLinearMode::Narrow,
        Some("0") | Some("off") => NormLinearMode::Off,
        _ => NormLinearMode::OneWave,
    })
}

/// The tile height (input rows per CTA) the fused kernel takes for `rows` rows and `n` output
/// columns under [`norm_linear_mode`] on a GPU of `sms` SMs, or `None` where the two-step path
/// runs: 16 where that grid fits one wave of one CTA per SM; else 64 where that grid fits one
/// wave of two (its 76.8 KB of shared memory and 512 threads allow two) and `eager()` (the
/// stream is not being captured).
///
/// Why eager only (lever 81's A/B, DeiT-T at batch 8, H100): launched one by one, a forward's
/// ~100 kernels cost more host time than GPU time, and the fused kernel takes 34 of them away
/// (eager rows 1.2–1.5× faster); replayed in a CUDA graph, where the GPU's time is the forward's,
/// the 64-row kernel (~12 µs under ncu: one CTA per SM, four warps per scheduler, each warp a
/// ~1,200-instruction chain at ~11 cycles an instruction) is slower than the LayerNorm kernel and
/// cuBLASLt's GEMM it replaces (dense graph 0.404 → 0.483 ms).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn tile_rows_rule(
    rows: usize,
    n: usize,
    sms: usize,
    eager: impl FnOnce() -> bool,
) -> Option<usize> {
    let tiles = |tile_rows: usize| rows.div_ceil(tile_rows) * n.div_ceil(128);
    match norm_linear_mode() {
        NormLinearMode::Off => None,
        NormLinearMode::Always => Some(16),
        NormLinearMode::Narrow => (tiles(16) <= sms).then_some(16),
        NormLinearMode::OneWave if tiles(16) <= sms => Some(16),
        NormLinearMode::OneWave => (tiles(64) <= 2 * sms && eager()).then_some(64),
    }
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
/// rows and roundings as the two-step path; only the GEMM's summation order differs), except a
/// shape's first call with 64-row tiles; on the CPU, where the Linear holds packed panels, the
/// two steps a chunk of rows at a time in one parallel pass (the same bits; `block_cpu`);
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
    // On the CPU: the two steps a chunk of rows at a time, one parallel pass (`block_cpu`).
    if let Some(y) = crate::block_cpu::norm_linear(x, norm, linear, gelu)? {
        return Ok(y);
    }
    // A shape's first call with 64-row tiles takes the two steps instead (first_wide_call).
    #[cfg(feature = "cuda")]
    let tile_rows = match (fused_tile_rows(x, norm, linear, gelu), x.device()) {
        (Some(64), candle_core::Device::Cuda(dev))
            if first_wide_call(dev, x, linear.out_dim(), gelu) =>
        {
            None
        }
        (t, _) => t,
    };
    #[cfg(feature = "cuda")]
    if let (Some(tile_rows), Some(bias)) = (tile_rows, linear.bias()) {
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
            tile_rows,
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
/// 16-byte aligned on `x`'s device, the GELU in its default (Φ) form, and a grid
/// [`norm_linear_tile_rows`] accepts (by default one wave). Anything else takes the two-step
/// path, which checks its inputs and reports errors. With 64-row tiles, a shape's first call in
/// the process still takes the two steps (so that its GEMM plan is timed eagerly).
pub fn norm_linear_applies(x: &Tensor, norm: &LayerNorm, linear: &FusedLinear, gelu: bool) -> bool {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, norm, linear, gelu);
        false
    }
    #[cfg(feature = "cuda")]
    {
        fused_tile_rows(x, norm, linear, gelu).is_some()
    }
}

/// The rows of `x` each CTA of the fused kernel takes (16 or 64), `None` where
/// [`norm_linear_applies`] is false (`norm_linear` then runs the two steps).
pub fn norm_linear_tile_rows(
    x: &Tensor,
    norm: &LayerNorm,
    linear: &FusedLinear,
    gelu: bool,
) -> Option<usize> {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, norm, linear, gelu);
        None
    }
    #[cfg(feature = "cuda")]
    {
        fused_tile_rows(x, norm, linear, gelu)
    }
}

/// Whether this is the first eager call with 64-row tiles on `dev` (candle's device instance, as
/// the cuBLASLt plans are kept per instance) for `x`'s (dtype, rows), output width `n` and
/// epilogue in this process, recording it. Such a call runs the two steps instead, so
/// that the GEMM's cuBLASLt plan is made and timed eagerly (lever 79 times a plan on its first
/// call outside a capture only): a CUDA graph captured later runs those two steps (the wide
/// kernel is eager-only) with the tuned pick. Without this, lever 81's A/B measured DeiT-T's
/// batch-8 graphs ~2 % slower (replay events 392.9 → 401.6 µs): their plans were first made
/// inside the capture.
#[cfg(feature = "cuda")]
fn first_wide_call(
    dev: &candle_core::cuda_backend::CudaDevice,
    x: &Tensor,
    n: usize,
    gelu: bool,
) -> bool {
    type Shape = (
        candle_core::cuda_backend::DeviceId,
        candle_core::DType,
        usize,
        usize,
        bool,
    );
    static SEEN: std::sync::Mutex<Vec<Shape>> = std::sync::Mutex::new(Vec::new());
    let rows = x.elem_count() / x.dims().last().copied().unwrap_or(1).max(1);
    let shape = (dev.id(), x.dtype(), rows, n, gelu);
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if seen.contains(&shape) {
        return false;
    }
    // A model has a handful of such shapes per batch size; a bound keeps a long-running
    // process with ever-new row counts from growing the list without end.
    if seen.len() >= 1024 {
        seen.clear();
    }
    seen.push(shape);
    true
}

/// [`norm_linear_tile_rows`] on CUDA.
#[cfg(feature = "cuda")]
fn fused_tile_rows(
    x: &Tensor,
    norm: &LayerNorm,
    linear: &FusedLinear,
    gelu: bool,
) -> Option<usize> {
    let candle_core::Device::Cuda(dev) = x.device() else {
        return None;
    };
    if !norm_linear_eligible(x, norm, linear, gelu) {
        return None;
    }
    let rows = x.elem_count() / norm.weight().elem_count();
    tile_rows_rule(
        rows,
        linear.out_dim(),
        crate::cuda::sm_count(dev).ok()?,
        || !crate::cuda::stream_is_capturing(dev),
    )
}

/// [`norm_linear_applies`] but for the grid's size: everything the fused kernel requires of its
/// operands, and [`norm_linear_mode`] not `Off`.
#[cfg(feature = "cuda")]
pub(crate) fn norm_linear_eligible(
    x: &Tensor,
    norm: &LayerNorm,
    linear: &FusedLinear,
    gelu: bool,
) -> bool {
    let Some(bias) = linear.bias() else {
        return false;
    };
    let c = norm.weight().elem_count();
    let n = linear.out_dim();
    let aligned = |t: &Tensor| crate::cuda::contiguous_16b(t.layout(), t.dtype().size_in_bytes());
    let same = |t: &Tensor| t.dtype() == x.dtype() && t.device().same_device(x.device());
    norm_linear_mode() != NormLinearMode::Off
        && matches!(
            x.dtype(),
            candle_core::DType::F16 | candle_core::DType::BF16
        )
        && NORM_LINEAR_DIMS.contains(&c)
        && x.dims().last() == Some(&c)
        && x.elem_count() > 0
        && linear.in_dim() == c
        && n.is_multiple_of(2)
        && [norm.weight(), norm.bias(), linear.weight(), bias]
            .iter()
            .all(|t| same(t))
        && [x, norm.weight(), norm.bias(), linear.weight()]
            .iter()
            .all(|t| aligned(t))
        && bias.is_contiguous()
        && (!gelu || crate::gelu_form::gelu_form() == crate::gelu_form::GeluForm::Phi)
}

/// The grid-size rule of the fused kernels: `tiles` CTAs (one per SM each) fit one wave of `sms`
/// SMs, or [`norm_linear_mode`] is `Always`.
#[cfg(feature = "cuda")]
fn fits_one_wave(sms: usize, tiles: usize) -> bool {
    norm_linear_mode() == NormLinearMode::Always || tiles <= sms
}

/// Which of [`residual_norm_linear`]'s two kernel forms may run, from
/// `CANDLE_FASTPATH_RESIDUAL_NORM_LINEAR` (read once): unset (both, where [`norm_linear`] would
/// take its own kernel), `proj` (only proj → norm2 → fc1, lever 61 alone), `0` (neither); for
/// A/B measurements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResidualNormLinearForms {
    /// proj (K = C) → norm2 → fc1.
    pub proj: bool,
    /// fc2 (K = 4C) → the next block's norm1 → qkv.
    pub fc2: bool,
}

/// The forms `CANDLE_FASTPATH_RESIDUAL_NORM_LINEAR` allows (read once).
pub fn residual_norm_linear_forms() -> ResidualNormLinearForms {
    static FORMS: std::sync::OnceLock<ResidualNormLinearForms> = std::sync::OnceLock::new();
    crate::switches::read_once(
        &FORMS,
        "CANDLE_FASTPATH_RESIDUAL_NORM_LINEAR",
        |v| match v {
            Some("0") | Some("off") => ResidualNormLinearForms {
                proj: false,
                fc2: false,
            },
            Some("proj") => ResidualNormLinearForms {
                proj: true,
                fc2: false,
            },
            _ => ResidualNormLinearForms {
                proj: true,
                fc2: true,
            },
        },
    )
}

/// A pre-norm block's step across one of its residual adds into the LayerNorm and Linear after
/// it: `x1 = residual + o·Wpᵀ + bp` (the Linear `front` and the residual add), then
/// `norm(x1)·Wᵀ + b` (`linear`), then the exact GELU when `gelu`. Two such steps in a ViT:
/// the attention's output projection into norm2 → fc1 → GELU, and fc2 into the next block's
/// norm1 → qkv.
///
/// # Arguments
/// * `o` - `[.., K]`: the attention's output with heads merged (K = C), or fc1's GELU output
///   (K = 4C).
/// * `residual` - `[.., C]`, the same leading dims as `o`.
/// * `front` - `Wp` `[C, K]` (and its bias `[C]`): proj, or fc2.
/// * `norm` - LayerNorm over `C`.
/// * `linear` - `W` `[N, C]` (and its bias `[N]`).
///
/// # Returns
/// `(x1, y)`: `x1` shaped like `residual` (the residual stream after the add, which the next
/// residual add reads again) and `y` `[.., N]`, both what `front.forward_residual(o, residual)`
/// and [`norm_linear`] on its result return. On CUDA with compute capability 9.0, where
/// [`residual_norm_linear_applies`] says so, one kernel computes both (levers 61 and 62 in
/// `docs/LEVERS.md`): [`norm_linear`]'s kernel, whose CTAs sharing a row tile (a
/// thread-block cluster) first compute the rows' x1 together. Its GEMMs sum in another order than
/// cuBLASLt's; everything else rounds where the two steps round. On the CPU, where both Linears
/// hold packed panels, the steps a chunk of rows at a time in one parallel pass (the same bits;
/// `block_cpu`). Elsewhere it is those two steps. Both results are contiguous (views of one
/// buffer on the CUDA fused path).
pub fn residual_norm_linear(
    o: &Tensor,
    residual: &Tensor,
    front: &FusedLinear,
    norm: &LayerNorm,
    linear: &FusedLinear,
    gelu: bool,
) -> Result<(Tensor, Tensor)> {
    // On the CPU: the steps a chunk of rows at a time, one parallel pass (`block_cpu`).
    if let Some(both) =
        crate::block_cpu::residual_norm_linear(o, residual, front, norm, linear, gelu)?
    {
        return Ok(both);
    }
    #[cfg(feature = "cuda")]
    if residual_norm_linear_applies(o, residual, front, norm, linear, gelu) {
        if let Some(op) = crate::cuda::ResidualNormLinearOp::from_layers(front, norm, linear, gelu)
        {
            let k = front.in_dim();
            let c = front.out_dim();
            let rows = o.elem_count() / k;
            let n = linear.out_dim();
            let both = o.reshape((rows, k))?.apply_op3_no_bwd(
                &residual.reshape((rows, c))?,
                linear.weight(),
                &op,
            )?;
            let mut y_dims = residual.dims().to_vec();
            if let Some(last) = y_dims.last_mut() {
                *last = n;
            }
            // Narrowing a contiguous 1-D tensor and reshaping it are views, not copies.
            let x1 = both.narrow(0, 0, rows * c)?.reshape(residual.shape())?;
            let y = both.narrow(0, rows * c, rows * n)?.reshape(y_dims)?;
            return Ok((x1, y));
        }
    }
    // DeiT-S's width: the projection (lever 98) or fc2 (lever 103), the residual add and the
    // LayerNorm as one kernel where it applies, then `linear` (the thin GEMM or cuBLASLt).
    if let Some((x1, z)) = fused_linear_residual_norm(o, residual, front, norm)? {
        let epilogue = if gelu {
            Epilogue::Gelu
        } else {
            Epilogue::Plain
        };
        return Ok((x1, linear.forward_with(&z, epilogue)?));
    }
    let x1 = front.forward_residual(o, residual)?;
    let y = norm_linear(&x1, norm, linear, gelu)?;
    Ok((x1, y))
}

/// A pre-norm block's MLP half and, optionally, the next block's norm1 and qkv projection: what
/// [`block_mlp`] and [`block_after_attention`] run.
#[derive(Clone, Copy, Debug)]
pub struct BlockMlp<'a> {
    pub norm2: &'a LayerNorm,
    pub fc1: &'a FusedLinear,
    pub fc2: &'a FusedLinear,
    /// The next block's norm1 and qkv, when its qkv projection is wanted too.
    pub next: Option<(&'a LayerNorm, &'a FusedLinear)>,
}

/// A pre-norm block after its attention: `x1 = x + o·Wpᵀ + bp` (`proj`), then [`block_mlp`] on
/// `x1`.
///
/// # Arguments
/// * `o` - `[.., C]`: the attention's output with heads merged.
/// * `x` - `[.., C]`: the block's input (the residual stream), shaped like `o`.
/// * `proj` - `Wp` `[C, C]` (and its bias).
///
/// # Returns
/// `(y, qkv)` as [`block_mlp`] returns them: what [`residual_norm_linear`] (proj into norm2 →
/// fc1 with the GELU) and then fc2 as in [`block_mlp`] return, bit for bit on the CPU. On the
/// CPU, where every Linear holds packed panels ([`crate::cpu_packed`]), one parallel pass over
/// chunks of rows runs all the steps (`CANDLE_FASTPATH_CPU_ROWS=0`: the steps one by one);
/// elsewhere those steps.
pub fn block_after_attention(
    o: &Tensor,
    x: &Tensor,
    proj: &FusedLinear,
    w: &BlockMlp,
) -> Result<(Tensor, Option<Tensor>)> {
    if let Some(done) = crate::block_cpu::mlp_rows(Some((o, proj)), x, w)? {
        return Ok(done);
    }
    let (x1, hidden) = residual_norm_linear(o, x, proj, w.norm2, w.fc1, true)?;
    fc2_then_next(&hidden, &x1, w)
}

/// A pre-norm block's MLP half on its residual stream `x1` (`[.., C]`):
/// `y = x1 + fc2(gelu(fc1(norm2(x1))))` and, with `w.next`, the next block's `qkv(norm1(y))`.
///
/// # Returns
/// `(y, qkv)`: `y` shaped like `x1`, `qkv` `[.., N]` with `w.next` (else `None`): what
/// [`norm_linear`] (norm2 → fc1 with the GELU) and then [`residual_norm_linear`] (fc2 into the
/// next norm1 → qkv) or, without a next block, `fc2.forward_residual` return, bit for bit on the
/// CPU, where one parallel pass over chunks of rows runs them as [`block_after_attention`] does;
/// elsewhere those steps.
pub fn block_mlp(x1: &Tensor, w: &BlockMlp) -> Result<(Tensor, Option<Tensor>)> {
    if let Some(done) = crate::block_cpu::mlp_rows(None, x1, w)? {
        return Ok(done);
    }
    let hidden = norm_linear(x1, w.norm2, w.fc1, true)?;
    fc2_then_next(&hidden, x1, w)
}

/// The last step of [`block_mlp`]: `y = x1 + fc2(hidden)` and, with `w.next`, the next block's
/// `qkv(norm1(y))` in the same step ([`residual_norm_linear`]; without a next block
/// `fc2.forward_residual`). For callers that ran fc1 themselves (a fused kernel through fc1).
///
/// # Arguments
/// * `hidden` - `[.., 4C]`: fc1's GELU output.
/// * `x1` - `[.., C]`: the residual stream after the attention, the same leading dims.
///
/// # Returns
/// `(y, qkv)` as [`block_mlp`] returns them; `w.norm2` and `w.fc1` are not read.
pub fn fc2_then_next(
    hidden: &Tensor,
    x1: &Tensor,
    w: &BlockMlp,
) -> Result<(Tensor, Option<Tensor>)> {
    match w.next {
        Some((norm1, qkv)) => {
            let (y, q) = residual_norm_linear(hidden, x1, w.fc2, norm1, qkv, false)?;
            Ok((y, Some(q)))
        }
        None => Ok((w.fc2.forward_residual(hidden, x1)?, None)),
    }
}

/// A pre-norm block's residual add and the LayerNorm after it: `x1 = residual + o·Wpᵀ + bp`
/// (the Linear `front` and the residual add), then `z = norm(x1)`.
///
/// # Arguments
/// * `o` - `[.., K]`: the attention's output with heads merged (K = C), or fc1's GELU output
///   (K = 4C).
/// * `residual` - `[.., C]`, the same leading dims as `o`.
/// * `front` - `Wp` `[C, K]` and its bias `[C]`: proj, or fc2.
/// * `norm` - LayerNorm over `C`.
///
/// # Returns
/// `(x1, z)`, both shaped like `residual`: what `front.forward_residual(o, residual)` and
/// `norm.forward(x1)` return. On CUDA with compute capability 9.0, where
/// [`linear_residual_norm_applies`] says so (DeiT-S's attention projection or fc2 at batch 1),
/// one kernel computes both (levers 98 and 103 in `docs/LEVERS.md`): the CTAs sharing a
/// tile of rows (a thread-block cluster) each compute a part of x1 and exchange it (fc2's kernel
/// also splits K over the cluster: TMA + wgmma, f32 partials summed in a fixed order), then
/// normalise the rows with the LayerNorm kernel's own row code. Its GEMM sums in another order
/// than cuBLASLt's; everything else rounds where the two steps round, so z is the LayerNorm of
/// the x1 it returns, bit for bit. Elsewhere it is the two steps. Both results are contiguous.
pub fn linear_residual_norm(
    o: &Tensor,
    residual: &Tensor,
    front: &FusedLinear,
    norm: &LayerNorm,
) -> Result<(Tensor, Tensor)> {
    if let Some(both) = fused_linear_residual_norm(o, residual, front, norm)? {
        return Ok(both);
    }
    let x1 = front.forward_residual(o, residual)?;
    let z = norm.forward_checked(&x1)?;
    Ok((x1, z))
}

/// [`linear_residual_norm`]'s kernel where [`linear_residual_norm_applies`] says so (checked
/// once), `None` otherwise: for [`residual_norm_linear`], whose other path fuses the LayerNorm
/// into the Linear after it instead.
fn fused_linear_residual_norm(
    o: &Tensor,
    residual: &Tensor,
    front: &FusedLinear,
    norm: &LayerNorm,
) -> Result<Option<(Tensor, Tensor)>> {
    #[cfg(feature = "cuda")]
    if let (Some(kernel), Some(params)) = (
        linear_residual_norm_kernel(o, residual, front, norm),
        crate::cuda::ResidualNormParams::from_layers(front, norm),
    ) {
        let (k, c) = (front.in_dim(), front.out_dim());
        let rows = o.elem_count() / k;
        let (o2, r2) = (o.reshape((rows, k))?, residual.reshape((rows, c))?);
        let both = match kernel {
            LrnKernel::Proj => o2.apply_op2_no_bwd(
                &r2,
                &crate::cuda::LinearResidualNormOp {
                    params,
                    attention: None,
                },
            )?,
            LrnKernel::Fc2(tiles) => {
                o2.apply_op2_no_bwd(&r2, &crate::cuda::ThinResidualNormOp { params, tiles })?
            }
        };
        // Narrowing a contiguous 1-D tensor and reshaping it are views, not copies.
        let x1 = both.narrow(0, 0, rows * c)?.reshape(residual.shape())?;
        let z = both
            .narrow(0, rows * c, rows * c)?
            .reshape(residual.shape())?;
        return Ok(Some((x1, z)));
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (o, residual, front, norm);
    Ok(None)
}

/// `CANDLE_FASTPATH_LINEAR_RESIDUAL_NORM` (read once): unset (on), `0` / `off` (the two steps
/// everywhere), for A/B measurements.
pub fn linear_residual_norm_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switches::on_unless_off(&ON, "CANDLE_FASTPATH_LINEAR_RESIDUAL_NORM")
}

/// The tile shape of [`linear_residual_norm`]'s fc2 kernel (lever 103 in `docs/LEVERS.md`):
/// the CTAs sharing 64 rows form one thread-block cluster of column tiles times slices of K.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThinResidualNormTiles {
    /// The default: four 96-column tiles × four slices of K (384 each), clusters of 16.
    N96S4,
    /// `CANDLE_FASTPATH_THIN_RESIDUAL_NORM=n64`: six 64-column tiles × two slices of K (768
    /// each), clusters of 12.
    N64S2,
}

/// The fc2 kernel's tiles `CANDLE_FASTPATH_THIN_RESIDUAL_NORM` selects (read once): unset
/// ([`ThinResidualNormTiles::N96S4`]), `n64`, or `0` / `off` (`None`: fc2 takes the two steps,
/// cuBLASLt's GEMM with its residual epilogue, then the LayerNorm kernel).
pub fn thin_residual_norm_tiles() -> Option<ThinResidualNormTiles> {
    static MODE: std::sync::OnceLock<Option<ThinResidualNormTiles>> = std::sync::OnceLock::new();
    crate::switches::read_once(&MODE, "CANDLE_FASTPATH_THIN_RESIDUAL_NORM", |v| match v {
        Some("0") | Some("off") => None,
        Some("n64") => Some(ThinResidualNormTiles::N64S2),
        _ => Some(ThinResidualNormTiles::N96S4),
    })
}

/// Whether [`linear_residual_norm`] runs a fused kernel: CUDA with compute capability 9.0 and
/// the kernels built for it, allowed by [`linear_residual_norm_enabled`], f16 or bf16, C = 384,
/// a bias, `o` and `residual` with the same rows, every operand contiguous and 16-byte aligned
/// on one device, and one of:
/// - `front` `[C, C]` (the attention projection, lever 98) with the grid (eight CTAs per 16
///   rows) within one wave: up to 256 rows on the H100;
/// - `front` `[C, 4C]` (fc2, lever 103), allowed by [`thin_residual_norm_tiles`], the device
///   able to place its clusters, and the grid (a cluster of 16 or 12 CTAs per 64 rows) within
///   one wave: up to 512 (16) or 704 (12) rows on the H100.
///
/// Both are batch 1 at DeiT-S's width. Anything else takes the two steps.
pub fn linear_residual_norm_applies(
    o: &Tensor,
    residual: &Tensor,
    front: &FusedLinear,
    norm: &LayerNorm,
) -> bool {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (o, residual, front, norm);
        false
    }
    #[cfg(feature = "cuda")]
    linear_residual_norm_kernel(o, residual, front, norm).is_some()
}

/// The kernel [`linear_residual_norm`] runs.
#[cfg(feature = "cuda")]
#[derive(Clone, Copy)]
enum LrnKernel {
    /// proj in front (LinearResidualNormOp).
    Proj,
    /// fc2 in front (ThinResidualNormOp).
    Fc2(ThinResidualNormTiles),
}

/// [`linear_residual_norm_applies`]'s rule, naming the kernel.
#[cfg(feature = "cuda")]
fn linear_residual_norm_kernel(
    o: &Tensor,
    residual: &Tensor,
    front: &FusedLinear,
    norm: &LayerNorm,
) -> Option<LrnKernel> {
    let candle_core::Device::Cuda(dev) = residual.device() else {
        return None;
    };
    let (c, k) = (crate::cuda::LRN_DIM, front.in_dim());
    let dtype = residual.dtype();
    let same = |t: &Tensor| {
        t.dtype() == dtype
            && t.device().same_device(residual.device())
            && crate::cuda::contiguous_16b(t.layout(), dtype.size_in_bytes())
    };
    let rows = residual.elem_count() / c;
    let shapes = linear_residual_norm_enabled()
        && matches!(dtype, candle_core::DType::F16 | candle_core::DType::BF16)
        && residual.dims().last() == Some(&c)
        && front.out_dim() == c
        && norm.weight().elem_count() == c
        && o.dims().last() == Some(&k)
        && o.rank() == residual.rank()
        && o.dims()[..o.rank() - 1] == residual.dims()[..residual.rank() - 1]
        && [o, residual, front.weight(), norm.weight(), norm.bias()]
            .iter()
            .all(|t| same(t))
        && front.bias().is_some_and(|b| {
            b.dtype() == dtype && b.device().same_device(residual.device()) && b.is_contiguous()
        })
        && rows > 0;
    if !shapes {
        return None;
    }
    if k == c {
        return crate::cuda::linear_residual_norm_sm_count(dev)
            .is_some_and(|sms| fits_one_wave(sms, rows.div_ceil(16) * crate::cuda::LRN_SPLIT))
            .then_some(LrnKernel::Proj);
    }
    if k != crate::cuda::THIN_RESIDUAL_NORM_K {
        return None;
    }
    let tiles = thin_residual_norm_tiles()?;
    let sms = crate::cuda::thin_residual_norm_sm_count(dev, tiles)?;
    (rows.div_ceil(crate::cuda::THIN_GEMM_TILE) * tiles.ctas_per_tile() <= sms)
        .then_some(LrnKernel::Fc2(tiles))
}

/// Whether [`residual_norm_linear`] runs its fused kernel: CUDA with compute capability 9.0 and
/// the kernels built for it, C = 192 and one of the kernel's two forms, allowed by
/// [`residual_norm_linear_forms`] (`front` `[C, C]` and `linear`'s N in (640, 768], six
/// 128-column tiles: DeiT-T's proj → fc1; or `front` `[C, 4C]`, N in (480, 576] and no GELU,
/// six 96-column tiles: its fc2 → qkv),
/// `o` and `residual` contiguous and 16-byte aligned with the same rows, `front` with a bias,
/// whatever [`norm_linear_applies`] requires of the LayerNorm and `linear` (its switch too), and
/// its grid (six CTAs per 16 rows) within one wave under the same rule.
/// Anything else takes the two steps.
pub fn residual_norm_linear_applies(
    o: &Tensor,
    residual: &Tensor,
    front: &FusedLinear,
    norm: &LayerNorm,
    linear: &FusedLinear,
    gelu: bool,
) -> bool {
    let k = front.in_dim();
    let aligned = |t: &Tensor| {
        #[cfg(feature = "cuda")]
        return crate::cuda::contiguous_16b(t.layout(), t.dtype().size_in_bytes());
        #[cfg(not(feature = "cuda"))]
        {
            let _ = t;
            false
        }
    };
    o.dims().last() == Some(&k)
        && o.rank() == residual.rank()
        && o.dims()[..o.rank() - 1] == residual.dims()[..residual.rank() - 1]
        && o.dtype() == residual.dtype()
        && o.device().same_device(residual.device())
        && aligned(o)
        && residual_norm_linear_step_applies(residual, front, norm, linear, gelu)
}

/// [`residual_norm_linear_applies`] without its checks of `o`, for a caller that makes `o` itself
/// (`residual`'s rows, `front`'s K wide, contiguous and 16-byte aligned in the residual's dtype
/// and device) and asks before making it: the kernel, its form and switch, `residual`, the
/// weights, the grid.
pub fn residual_norm_linear_step_applies(
    residual: &Tensor,
    front: &FusedLinear,
    norm: &LayerNorm,
    linear: &FusedLinear,
    gelu: bool,
) -> bool {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (residual, front, norm, linear, gelu);
        false
    }
    #[cfg(feature = "cuda")]
    {
        let candle_core::Device::Cuda(dev) = residual.device() else {
            return false;
        };
        let c = norm.weight().elem_count();
        let k = front.in_dim();
        let aligned =
            |t: &Tensor| crate::cuda::contiguous_16b(t.layout(), t.dtype().size_in_bytes());
        let dtype = residual.dtype();
        let front_ok = front.out_dim() == c
            && front.weight().dtype() == dtype
            && front.weight().device().same_device(residual.device())
            && aligned(front.weight())
            && front.bias().is_some_and(|b| {
                b.dtype() == dtype && b.device().same_device(residual.device()) && b.is_contiguous()
            });
        let rows = residual.elem_count() / c.max(1);
        let forms = residual_norm_linear_forms();
        let form = crate::cuda::RnlForm::of(k, linear.out_dim(), gelu);
        let form_on = match form {
            Some(crate::cuda::RnlForm::Proj) => forms.proj,
            Some(crate::cuda::RnlForm::Fc2) => forms.fc2,
            None => false,
        };
        let eligible = form_on
            && c == crate::cuda::RNL_DIM
            && aligned(residual)
            && front_ok
            && norm_linear_eligible(residual, norm, linear, gelu);
        // Its grid is six CTAs per 16 rows, at least norm_linear's ceil(N / 128) for either form.
        eligible
            && form
                .and_then(|form| crate::cuda::residual_norm_linear_sm_count(dev, form))
                .is_some_and(|sms| fits_one_wave(sms, rows.div_ceil(16) * crate::cuda::RNL_SPLIT))
    }
}

#[cfg(test)]
mod tests {
    use super::{norm_linear_mode, tile_rows_rule, NormLinearMode};

    #[test]
    fn tile_rows_follow_the_wave_rule() {
        // The rule of the mode this process runs under (unset in CI: the default).
        if norm_linear_mode() != NormLinearMode::OneWave {
            return;
        }
        let h100 = 132;
        let rule = |rows, n| tile_rows_rule(rows, n, h100, || true);
        // DeiT-T at batch 1: 13 row tiles × 5 (qkv) or 6 (fc1) column tiles, one wave, captured
        // or not.
        assert_eq!(rule(197, 576), Some(16));
        assert_eq!(rule(197, 768), Some(16));
        assert_eq!(tile_rows_rule(197, 768, h100, || false), Some(16));
        // Batch 8 (1,576 rows): 495 / 594 narrow tiles; 125 / 150 of 64 rows, two per SM, but
        // only outside a capture.
        assert_eq!(rule(1576, 576), Some(64));
        assert_eq!(rule(1576, 768), Some(64));
        assert_eq!(tile_rows_rule(1576, 576, h100, || false), None);
        // DynamicViT's in_conv (N = C = 192) at batch 8: 25 × 2 wide tiles.
        assert_eq!(rule(1576, 192), Some(64));
        // Past one wave of two wide CTAs per SM (batch 64): the two steps.
        assert_eq!(rule(12608, 576), None);
        assert_eq!(rule(45 * 64, 768), None);
        assert_eq!(rule(44 * 64, 768), Some(64));
    }
}
